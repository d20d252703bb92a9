"""OpenAI request bodies (the fields precast honours) and their translation to SamplingParams."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from precast.runtime.sampling_params import SamplingParams, field_type, knobs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def _sampling_fields() -> dict[str, Any]:
    """The SamplingParams fields OpenAI bodies carry, with their types and defaults (bounds are checked once,
    by SamplingParams.validate: a violation is a 400 with its message)."""
    fields: dict[str, Any] = {}
    for f, k in knobs().items():
        if not k.openai:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        annotation = {
            "int": int,
            "float": float,
            "bool": bool,
            "list[int]": list[int],
            "list[str]": list[str],
            "dict[int, float]": dict[str, float],  # JSON object keys are strings: token ids as text (OpenAI's logit_bias)
        }[field_type(f)]
        if f.default is None:
            annotation = annotation | None
        if f.name == "stop":  # OpenAI: one string or a list
            annotation, default = str | list[str] | None, None
        fields[f.name] = (annotation, Field(default=default, description=k.help))
    return fields


# Fields accepted and ignored on purpose (docs/serving.md): they change nothing precast computes. Any other
# field precast does not implement is a 400 naming it, never silently dropped.
IGNORED_FIELDS = ("user", "service_tier", "store", "metadata")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly (constrained decoding)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: one output format."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Body(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (completions): the prompt scored, nothing generated
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    parallel_tool_calls: bool | None = None  # false: a `required` tool choice makes exactly one call
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None


class _Common(create_model("_Sampling", __base__=_Body, **_sampling_fields())):  # type: ignore[misc]
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(t): float(b) for t, b in self.logit_bias.items()}
        except ValueError as e:
            raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:3]}") from e

    def output_format(self) -> dict[str, Any]:
        """The SamplingParams output-format field response_format or structured_outputs names ({} for text)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if rf is not None and rf.type == "json_object":
            return {"json_object": True}
        if rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema else None
            return {"json_schema": schema} if schema is not None else {"json_object": True}
        if so is not None:
            given = {"json_schema": so.json_, "json_object": so.json_object, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
            given = {k: v for k, v in given.items() if v not in (None, False)}
            if len(given) != 1:
                raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; got {len(given)}")
            return given
        return {}

    def sampling(self, max_tokens: int, logprobs: int | None, index: int, defaults: dict[str, Any]) -> SamplingParams:
        """This choice's SamplingParams; `defaults` (the engine's, SamplingParams.engine_defaults) fill the
        fields the body leaves out."""
        values = {f.name: getattr(self, f.name) for f, k in knobs().items() if k.openai}
        values.update({k: v for k, v in defaults.items() if k in values and k not in self.model_fields_set})
        values.update(max_tokens=max_tokens, logprobs=logprobs, stop=self.stop_list(), logit_bias=self.token_bias())
        values.update(self.output_format())
        if self.seed is not None:  # n > 1 with a seed: choice i uses seed + i, so choices differ yet repeat run to run
            values["seed"] = self.seed + index
        return SamplingParams(**values)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `refusal`, `audio` on replayed assistant messages
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are understood
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """This message as chat templates read it (content text; tool calls and ids where present)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            m["content"] = self.text() or None
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]
