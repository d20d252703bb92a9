"""OpenAI request bodies (the fields precast honours) and their translation to SamplingParams."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from precast.runtime.sampling_params import SamplingParams, field_type, knobs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class StreamOptions(BaseModel):
    include_usage: bool = False


def _sampling_fields() -> dict[str, Any]:
    """The SamplingParams fields OpenAI bodies carry, with their types and defaults (bounds are checked once,
    by SamplingParams.validate: a violation is a 400 with its message)."""
    fields: dict[str, Any] = {}
    for f, k in knobs().items():
        if not k.openai:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        annotation = {"int": int, "float": float, "bool": bool, "list[int]": list[int], "list[str]": list[str]}[field_type(f)]
        if f.default is None:
            annotation = annotation | None
        if f.name == "stop":  # OpenAI: one string or a list
            annotation, default = str | list[str] | None, None
        fields[f.name] = (annotation, Field(default=default, description=k.help))
    return fields


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are accepted and ignored

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class _Common(create_model("_Sampling", __base__=_Body, **_sampling_fields())):  # type: ignore[misc]
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_tokens: int, logprobs: int | None, index: int, defaults: dict[str, Any]) -> SamplingParams:
        """This choice's SamplingParams; `defaults` (the engine's, SamplingParams.engine_defaults) fill the
        fields the body leaves out."""
        values = {f.name: getattr(self, f.name) for f, k in knobs().items() if k.openai}
        values.update({k: v for k, v in defaults.items() if k in values and k not in self.model_fields_set})
        values.update(max_tokens=max_tokens, logprobs=logprobs, stop=self.stop_list())
        if self.seed is not None:  # n > 1 with a seed: choice i uses seed + i, so choices differ yet repeat run to run
            values["seed"] = self.seed + index
        return SamplingParams(**values)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are understood
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
