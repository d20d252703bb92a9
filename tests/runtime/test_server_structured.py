"""`precast serve` with what real clients send: response_format, vLLM's structured_outputs, tools through the
official openai client (SmolLM2 with a Hermes-style template given by --chat-template; Qwen2.5-Coder-0.5B with its
own), logit_bias, unknown fields, /tokenize, /v1/models/{id}, cached-token usage and content-only logprobs."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.runtime.test_server import MODEL, start_server, stop_server

# A Hermes-style template (tool calls as <tool_call> JSON) for SmolLM2, whose own template renders no tools.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these functions. To call one, write <tool_call>
{"name": <name>, "arguments": <arguments as JSON>}
</tool_call>
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 1000}, "b": {"type": "integer", "maximum": 1000}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol(smollm2_bf16_engine, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    proc, base = start_server(smollm2_bf16_engine, "--chat-template", str(template))
    yield base, OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120)
    stop_server(proc)


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_response_format_json_schema_and_json_object(smol):
    _, client = smol
    for temperature in (0.0, 0.8):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            temperature=temperature,
            seed=1,
            max_tokens=80,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, temperature=0.7, seed=2, max_tokens=150, frequency_penalty=0.5
    )
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_extension_streamed_and_not(smol):
    _, client = smol
    extra = {"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra, temperature=0, max_tokens=10)
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra, temperature=0, max_tokens=10, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert r.choices[0].message.content in ("sunny", "rainy", "cloudy") and text == r.choices[0].message.content
    r = client.completions.create(
        model=MODEL, prompt="Call me at ", extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, max_tokens=20
    )
    assert len(r.choices[0].text) == 8 and r.choices[0].text[3] == "-"


def test_tool_calls_required_named_and_streamed(smol):
    _, client = smol
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], WEATHER if choice.message.tool_calls[0].function.name == "get_weather" else ADD)
    named = {"type": "function", "function": {"name": "add"}}
    for temperature in (0.0, 0.9):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice=named, temperature=temperature, seed=3, max_tokens=60
        )
        assert r.choices[0].finish_reason == "tool_calls"
        check_call(r.choices[0].message.tool_calls[0], ADD)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=80,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()  # call text is not content
    assert calls and calls[0].index == 0
    check_call(calls[0], WEATHER)


def test_tool_result_turn_and_tool_choice_none(smol):
    _, client = smol
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)
    call = r.choices[0].message.tool_calls[0]
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "body, text",
    [
        ({"frobnicate": 1}, "unsupported field 'frobnicate'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
            "uniqueItems",
        ),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex cannot be used"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"logit_bias": {"the": 5}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)
def test_refused_with_a_400_naming_the_problem(smol, body, text):
    base, client = smol
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5} | body, timeout=60)
    assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).usage.completion_tokens == 2


def test_tools_need_a_template_that_renders_them(smollm2_bf16_engine):
    proc, base = start_server(smollm2_bf16_engine)  # SmolLM2's own template: no tools
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60)
        with pytest.raises(BadRequestError, match="--chat-template"):
            client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5)
    finally:
        stop_server(proc)


def test_logit_bias_models_tokenize_usage_and_logprobs(smol):
    base, client = smol
    ids = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 2048
    assert httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}).json()["prompt"].endswith("Hello world")
    chat_ids = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": ASK}).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0, logprobs=True)
    assert r.usage.prompt_tokens == len(chat_ids)
    assert httpx.get(f"{base}/v1/models/{MODEL}").json()["id"] == MODEL
    assert httpx.get(f"{base}/v1/models/other").status_code == 404
    # logit_bias: -100 bans the greedy token, +100 forces one
    first = r.choices[0].logprobs.content[0].token
    first_id = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    banned = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, temperature=0, logprobs=True, logit_bias={str(first_id): -100}
    )
    assert banned.choices[0].logprobs.content[0].token != first
    forced = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logit_bias={"42": 100})
    assert forced.choices[0].text == httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": [42] * 3}).json()["prompt"]
    # chat logprobs cover exactly the content tokens (not the end-of-turn token); cached prompt tokens are reported
    long_ask = [{"role": "system", "content": "You answer briefly. " * 30}, *ASK]
    client.chat.completions.create(model=MODEL, messages=long_ask, max_tokens=1)
    r = client.chat.completions.create(
        model=MODEL,
        messages=long_ask,
        max_tokens=60,
        temperature=0,
        logprobs=True,
        extra_body={"structured_outputs": {"choice": ["It is sunny."]}},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "It is sunny."
    assert "".join(t.token for t in r.choices[0].logprobs.content) == r.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens >= 64


def test_qwen_tool_calls_through_its_own_template(qwen05_engine):
    proc, base = start_server(qwen05_engine)
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120)
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert check_call(r.choices[0].message.tool_calls[0], WEATHER)["city"] == "Paris"
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0, max_tokens=60, stream=True,
            )
        )  # fmt: skip
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert check_call(calls[0], WEATHER)["city"] == "Paris"
        call = r.choices[0].message.tool_calls[0]
        follow = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})},
        ]
        prompt = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": follow}).json()["tokens"]
        text = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": prompt}).json()["prompt"]
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
        assert '<tool_response>\n{"temperature": 18, "sky": "cloudy"}\n</tool_response>' in text
        r = client.chat.completions.create(
            model=MODEL, messages=follow, tools=[WEATHER, ADD], tool_choice="none", temperature=0, max_tokens=40
        )
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    finally:
        stop_server(proc)


def test_echo_scores_the_prompt(smol):
    base, client = smol
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The capital of France is") and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.prompt_tokens + 1
    assert all(lp.token_logprobs[k] <= max(lp.top_logprobs[k].values()) + 1e-6 for k in range(1, len(lp.tokens)))
    assert lp.text_offset[1] == len(lp.tokens[0])
    r = client.completions.create(model=MODEL, prompt=[[504, 3575, 282]], max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].logprobs.tokens == ["The", " capital", " of"] and r.usage.completion_tokens == 0
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, echo=True).choices[0].text.startswith("Hi")
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and "0 only with echo" in r.json()["error"]["message"]
    # streamed: the prompt and its scores in the first chunk, then the completion; the same as not streamed
    whole = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, echo=True, logprobs=2, temperature=0)
    chunks = [
        c.choices[0]
        for c in client.completions.create(
            model=MODEL, prompt="The sky is", max_tokens=5, echo=True, logprobs=2, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs] == whole.choices[0].logprobs.token_logprobs


# Minimal templates in the Llama 3.x JSON and Mistral [TOOL_CALLS] styles (SmolLM2's own renders no tools).
LLAMA3_TEMPLATE = """{%- if tools %}<|im_start|>system
To call a function, answer with JSON {"name": <name>, "parameters": <arguments>}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MISTRAL_TEMPLATE = LLAMA3_TEMPLATE.replace(
    'answer with JSON {"name": <name>, "parameters": <arguments>}', 'answer [TOOL_CALLS][{"name": <name>, "arguments": <arguments>}]'
)


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, MISTRAL_TEMPLATE], ids=["llama3", "mistral"])
def test_llama3_and_mistral_tool_formats(smollm2_bf16_engine, tmp_path, template):
    path = tmp_path / "template.jinja"
    path.write_text(template)
    proc, base = start_server(smollm2_bf16_engine, "--chat-template", str(path))
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60)
        for stream in (False, True):
            r = client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0, max_tokens=60, stream=stream,
            )  # fmt: skip
            if stream:
                chunks = [c for c in r if c.choices]
                calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
            else:
                calls = r.choices[0].message.tool_calls
                assert r.choices[0].finish_reason == "tool_calls"
            assert len(calls) == 1
            check_call(calls[0], WEATHER)
    finally:
        stop_server(proc)


def test_echo_of_a_one_token_prompt(smol):
    _, client = smol
    r = client.completions.create(model=MODEL, prompt=[[504]], max_tokens=1, echo=True, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.tokens[0] == "The" and lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs) == 2
