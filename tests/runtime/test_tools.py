"""Tool-call formats (runtime/server/tools.py): detection from chat templates and parsing generated text."""

from __future__ import annotations

import json

import pytest

from precast.errors import PrecastError
from precast.runtime.server.tools import FORMATS, detect_format, template_messages


def names_and_arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_with_content_and_malformed_ones():
    fmt = FORMATS["hermes"]
    text = 'Let me check.\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    content, calls = fmt.parse(text)
    assert content == "Let me check." and names_and_arguments(calls) == [("get", {"city": "Paris"}), ("b", {})]
    assert len({c["id"] for c in calls}) == 2
    for broken in (
        "no call here",
        '<tool_call>\n{"name": "get", "arguments": {"city": "Pa\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
    ):
        assert fmt.parse(broken) == (broken, [])


def test_llama3_and_mistral_calls():
    content, calls = FORMATS["llama3"].parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content is None and names_and_arguments(calls) == [("a", {"x": 1}), ("b", {})]
    assert FORMATS["llama3"].parse("Paris is sunny.") == ("Paris is sunny.", [])
    content, calls = FORMATS["mistral"].parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "c", "arguments": {}}]')
    assert content is None and names_and_arguments(calls) == [("a", {"x": 1}), ("c", {})]
    assert FORMATS["mistral"].parse("[TOOL_CALLS][{oops") == ("[TOOL_CALLS][{oops", [])


def test_streamed_text_is_held_back_where_a_call_may_begin():
    hermes, llama3 = FORMATS["hermes"], FORMATS["llama3"]
    assert not hermes.starts_call("The weather is")
    assert hermes.starts_call("Sure <tool") and hermes.starts_call("Sure <tool_call>\n{")
    assert llama3.starts_call(' {"name"') and not llama3.starts_call("Hello")


def test_formats_are_read_off_chat_templates():
    assert detect_format("{% if tools %}...<tool_call>...{% endif %}").name == "hermes"
    assert detect_format("{% for t in tools %}[TOOL_CALLS]{% endfor %}").name == "mistral"
    assert detect_format('{% if tools %}{"name": ..., "parameters": ...}<|eom_id|>{% endif %}').name == "llama3"
    assert detect_format("{{ messages }}") is None and detect_format(None) is None


def test_grammar_makes_one_or_several_calls():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    one = FORMATS["hermes"].grammar([tool], lambda t: json.dumps(t), parallel=False)
    many = FORMATS["hermes"].grammar([tool], lambda t: json.dumps(t), parallel=True)
    assert "*" not in one.splitlines()[0] and many.splitlines()[0].endswith("*")
    assert '"const": "f"' in one and '"whitespace_flexible": false' in one


def test_template_messages_parse_argument_text():
    msgs = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        }
    ]
    assert template_messages(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    msgs[0]["tool_calls"][0]["function"]["arguments"] = "{bad"
    with pytest.raises(PrecastError, match="not valid JSON"):
        template_messages(msgs)
