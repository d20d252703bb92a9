"""Tool calling for the chat route: which format a model writes its calls in, the grammar that makes a
`required` or named call always parse, and turning the generated text back into `message.tool_calls`.

The format is read off the engine's chat template (the tools are rendered by the template itself):
- hermes: Qwen2.5 / Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call;
- llama3: Llama 3.x JSON, `{"name": ..., "parameters": {...}}` (calls separated by `;`);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from precast.errors import PrecastError
from precast.runtime.guided import JSON_OPTIONS


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str  # "arguments", or "parameters" for Llama 3.x

    def call_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """One call to any of `tools`, as a JSON schema: the name fixed, the arguments by that tool's schema."""
        variants = []
        for tool in tools:
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            variants.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, self.arguments_key: params},
                    "required": ["name", self.arguments_key],
                    "additionalProperties": False,
                }
            )
        return variants[0] if len(variants) == 1 else {"anyOf": variants}

    def grammar(self, tools: list[dict[str, Any]], literal: Callable[[str], str], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with inline JSON schemas) for one call to `tools`, or one or more
        when `parallel`; `literal` writes a marker as the tokenizer has it (a special token or text)."""
        call = "%json " + json.dumps({"x-guidance": JSON_OPTIONS} | self.call_schema(tools))

        def calls(one: str, separator: str) -> str:
            return f'{one} ("{separator}" {one})*' if parallel else one

        if self.name == "hermes":
            open_, close = literal("<tool_call>"), literal("</tool_call>")
            newline = "\\n"  # the two characters backslash-n: Lark's escape
            return f'start: {calls("call", newline)}\ncall: {open_} "{newline}" body "{newline}" {close}\nbody: {call}\n'
        if self.name == "mistral":
            return f'start: {literal("[TOOL_CALLS]")} "[" {calls("body", ", ")} "]"\nbody: {call}\n'
        return f"start: {calls('body', '; ')}\nbody: {call}\n"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) from a generated message; all plain text unless every call is well formed."""
        if self.name == "hermes":
            bodies = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL)
            content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL).strip() or None
            objects = [_json_objects(b) for b in bodies]
            items = [o[0] for o in objects if o and len(o) == 1]
            valid = len(items) == len(bodies)
        elif self.name == "mistral":
            head, marker, tail = text.partition("[TOOL_CALLS]")
            parsed = _json_objects(tail) if marker else None
            items = (parsed[0] if len(parsed) == 1 and isinstance(parsed[0], list) else parsed) if parsed else []
            content, valid = head.strip() or None, bool(marker)
        else:  # llama3: the whole message is the calls, `;`-separated
            items = _json_objects(text.strip().removeprefix("<|python_tag|>"), separator=";") or []
            content, valid = None, True
        calls = [c for c in (_call(i, self.arguments_key) for i in items) if c]
        if not valid or not calls or len(calls) != len(items):
            return text, []
        return content, calls

    def starts_call(self, text: str) -> bool:
        """Whether a streamed message so far may be (the start of) a tool call, so its text is held back."""
        marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(self.name)
        probe = text.lstrip()
        if marker is None:
            return probe.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(probe)
        return marker in text or any(probe.endswith(marker[:k]) for k in range(1, len(marker)))


FORMATS = {
    "hermes": ToolFormat("hermes", "arguments"),
    "llama3": ToolFormat("llama3", "parameters"),
    "mistral": ToolFormat("mistral", "arguments"),
}


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format the chat template renders, or None when it renders no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in chat_template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in chat_template or "<|eom_id|>" in chat_template or '"parameters"' in chat_template:
        return FORMATS["llama3"]
    return None


def _json_objects(text: str, separator: str = ",") -> list[Any] | None:
    """The JSON values one after another in `text` (separated by `separator` and white space), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (values and text[i] == separator)):
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _call(data: Any, arguments_key: str) -> dict[str, Any] | None:
    """One OpenAI tool call from a parsed call object, or None when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": data["name"], "arguments": json.dumps(arguments)},
    }


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as HF chat templates expect them: tool call arguments as objects, not JSON text."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"] else {}
                    except json.JSONDecodeError as e:
                        raise PrecastError(f"a tool call's arguments are not valid JSON: {e}") from e
                calls.append(dict(c, function=fn))
            m["tool_calls"] = calls
        out.append(m)
    return out
