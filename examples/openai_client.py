"""Talk to `precast serve` with the official openai client.

precast serve engines/smollm2-135m-instruct --port 8000 &
python examples/openai_client.py [BASE_URL] [API_KEY]
"""

import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key=sys.argv[2] if len(sys.argv) > 2 else "none")
model = client.models.list().data[0].id

reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=32
)
print("chat:", reply.choices[0].message.content)

print("stream: ", end="")
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Name three colours."}], temperature=0, max_tokens=32, stream=True
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
