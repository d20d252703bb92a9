"""Structured outputs through the executor (runtime/guided.py, llguidance) on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from precast.errors import PrecastError
from precast.runtime import LLM, SamplingParams
from tests.runtime.test_executor import wait_idle

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
# Objects, arrays, enums, required and optional fields, $defs and $ref, anyOf, nullable types, bounds and
# patterns. Strings and arrays are bounded so a 135M model's sampled output ends within max_tokens.
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "address": {"type": "object", "properties": {"street": NAME, "number": {"type": "integer"}}, "required": ["street", "number"]},
        },
        "required": ["city", "address"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["kind", "x", "y"],
    },
    {"type": "object", "properties": {"done": {"type": "boolean"}, "urgent": {"type": "boolean"}}, "required": ["done", "urgent"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {
        "$defs": {"person": {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False}},
        "type": "object",
        "properties": {"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}},
        "required": ["author", "editor"],
    },
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, NAME]}}, "required": ["id"]},
    {
        "type": "array",
        "items": {"type": "object", "properties": {"title": NAME, "year": {"type": "integer"}}, "required": ["title", "year"]},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {"first": NAME, "middle": NAME, "last": NAME},
        "required": ["first", "last"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 20}}, "required": ["nickname"]},
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {"status": {"enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["status", "count"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4},
    {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}}, "required": ["code"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}, "title": NAME},
        "required": ["title", "tags"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": {"type": ["string", "null"], "maxLength": 30}},
        "required": ["ok", "reason"],
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {"point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False}},
        "required": ["point"],
    },
]


def closed(schema):
    """Objects take no properties beyond those named (as OpenAI's strict mode asks): JSON Schema's default
    admits any extra key with an unbounded string, which a small sampled model may never end."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


SCHEMAS = [closed(s) for s in SCHEMAS]
PROMPT = "Reply with JSON only. Describe a book you like.\n"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_output_validates_against_its_schema(smollm2_llm, temperature):
    params = [
        SamplingParams(json_schema=s, temperature=temperature, max_tokens=200, seed=i, repetition_penalty=1.1)
        for i, s in enumerate(SCHEMAS)
    ]
    outs = smollm2_llm.generate([PROMPT] * len(SCHEMAS), params)  # all in flight together
    for schema, out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (schema, out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)
    assert smollm2_llm._guided.num_guides == 0  # every grammar freed with its request
    wait_idle(smollm2_llm)
    smollm2_llm.check_integrity()


def test_schema_as_text_json_object_regex_choice_and_grammars(smollm2_llm):
    lark = 'start: "ADD " num " TO " num\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "ADD " num " TO " num\nnum ::= [0-9] [0-9]? [0-9]?'
    cases = [
        (
            SamplingParams(json_schema=json.dumps(SCHEMAS[0]), temperature=0.0),
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0]) is None,
        ),
        (SamplingParams(json_object=True, temperature=0.7, seed=4, repetition_penalty=1.1), lambda t: isinstance(json.loads(t), dict)),
        (SamplingParams(regex=r"[0-9]{3}-[0-9]{4}", temperature=0.9, seed=1), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (SamplingParams(choice=["Paris", "London", "Rome"], temperature=0.0), lambda t: t in ("Paris", "London", "Rome")),
        (SamplingParams(choice=["yes", "no"], temperature=1.0, seed=2), lambda t: t in ("yes", "no")),
        (SamplingParams(grammar=lark, temperature=0.8, seed=3), lambda t: re.fullmatch(r"ADD [0-9]{1,3} TO [0-9]{1,3}", t)),
        (SamplingParams(grammar=gbnf, temperature=0.8, seed=3), lambda t: re.fullmatch(r"ADD [0-9]{1,3} TO [0-9]{1,3}", t)),
    ]
    prompts = [smollm2_llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])] * len(cases)
    for (p, _), out in zip(cases, smollm2_llm.generate(prompts, [dataclass_with(p, max_tokens=120) for p, _ in cases])):
        assert out.finish_reason == "stop" and _(out.text), (p.guide(), out.text, out.error)


def dataclass_with(p: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(p, **kw)


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "strng"}}}), "json_schema cannot be used"),
        (SamplingParams(json_schema="{not json"), "json_schema cannot be used"),
        (SamplingParams(json_schema={"type": "array", "uniqueItems": True}), "Unimplemented keys.*uniqueItems"),
        (SamplingParams(regex="(unclosed"), "regex cannot be used"),
        (SamplingParams(grammar="start: undefined_rule"), "grammar cannot be used"),
        (SamplingParams(choice=[]), "choice needs at least one string"),
        (SamplingParams(regex="a", choice=["b"]), "at most one output format"),
        (SamplingParams(json_object=True, ignore_eos=True), "ignore_eos cannot be combined"),
    ],
)
def test_bad_formats_are_refused_before_any_work(smollm2_llm, params, message):
    with pytest.raises(PrecastError, match=message):
        smollm2_llm.generate("x", params)
    assert smollm2_llm._guided.num_guides == 0
    assert smollm2_llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0)).finish_reason == "length"


def test_free_requests_beside_guided_ones_are_unchanged(smollm2_llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = smollm2_llm.generate(PROMPT, free).token_ids
    guided = [SamplingParams(json_schema=s, temperature=0.8, max_tokens=60, seed=i) for i, s in enumerate(SCHEMAS[:6])]
    outs = smollm2_llm.generate([PROMPT] * 7, [free, *guided])
    assert outs[0].token_ids == alone


def test_preemption_and_chunked_prefill_keep_the_grammar_state(smollm2_bf16_engine, smollm2_llm, smollm2_block_bytes):
    prompts = [f"{PROMPT}Item {i}: " + "words " * (40 + 10 * i) for i in range(6)]
    params = [SamplingParams(json_schema=SCHEMAS[9], temperature=0.0, max_tokens=90, repetition_penalty=1.1) for _ in prompts]
    reference = [o.text for o in smollm2_llm.generate(prompts, params)]
    with LLM(smollm2_bf16_engine, kv_cache_memory=10 * smollm2_block_bytes, max_num_tokens=48, prefix_reuse=False) as tight:
        outs = tight.generate(prompts, params)
        assert tight.stats().preemptions > 0
        assert [o.text for o in outs] == reference
        wait_idle(tight)
        tight.check_integrity()
        assert tight._guided.num_guides == 0


def test_cancelled_and_stopped_requests_free_their_grammar(smollm2_llm):
    stream = smollm2_llm.stream(PROMPT, SamplingParams(json_schema=SCHEMAS[9], temperature=0.8, max_tokens=150, seed=1))
    next(stream)
    stream.close()  # cancels
    out = smollm2_llm.generate(PROMPT, SamplingParams(json_object=True, temperature=0.8, max_tokens=150, seed=1, stop=['"']))
    assert out.finish_reason == "stop"
    wait_idle(smollm2_llm)
    assert smollm2_llm._guided.num_guides == 0


def test_min_tokens_that_the_grammar_cannot_meet_ends_with_an_error(smollm2_llm):
    out = smollm2_llm.generate(PROMPT, SamplingParams(choice=["yes", "no"], min_tokens=5, max_tokens=10, temperature=0))
    assert out.finish_reason == "error" and "no token may come next" in out.error
    assert smollm2_llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True)).finish_reason == "length"  # the LLM serves on


def test_logit_bias(smollm2_llm):
    greedy = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1)).token_ids[0]
    banned = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logit_bias={greedy: -100})).token_ids[0]
    assert banned != greedy
    forced = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.9, max_tokens=4, seed=3, logit_bias={42: 100}))
    assert forced.token_ids == [42] * 4
