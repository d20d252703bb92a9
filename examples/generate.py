"""Generate text with the Python API: one chat answer, a streamed answer, and a batch.

python examples/generate.py ENGINE_DIR
"""

import sys

from precast import LLM, SamplingParams

engine = sys.argv[1] if len(sys.argv) > 1 else "engines/smollm2-135m-instruct"

with LLM(engine) as llm:
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32))
    print("chat:", answer.text)

    prompt = llm.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    print("stream: ", end="")
    for out in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=32)):
        print(out.delta, end="", flush=True)
    print()

    # Many prompts run together (in-flight batching); outputs come back in order.
    batch = llm.generate(["The sky is", "Water boils at", "The opposite of hot is"], SamplingParams(temperature=0, max_tokens=8))
    for out in batch:
        print("batch:", repr(out.text), out.finish_reason)
    print("stats: iterations", llm.stats().iterations, "prefix hit rate", round(llm.stats().kv.hit_rate, 3))
