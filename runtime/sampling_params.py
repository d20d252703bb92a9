"""SamplingParams: how one request is decoded, and the one schema every surface is made from.

Each field carries a `Knob` (its help, bounds and which surfaces expose it). From it come:
  - `SamplingParams.validate()`: the one bounds check, with one set of messages (the C++ `validate`
    stays as the last guard);
  - the OpenAI request bodies' sampling fields (runtime/server/protocol.py);
  - the Triton model's optional inputs and config.pbtxt rows (runtime/triton/);
  - `precast run`'s flags (precast/cli.py).
Adding a field is one entry here plus the C++ struct it travels in (cpp/request.h, `to_request` below).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from precast import _C
from precast.errors import PrecastError


@dataclass(frozen=True)
class Knob:
    help: str
    ge: float | None = None  # bounds; None: unbounded on that side
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    openai: bool = True  # accepted by name in OpenAI request bodies (standard fields and vLLM-style extensions)
    triton: str | None = None  # the Triton input's data type, None: not a Triton input
    triton_names: tuple[str, ...] = ()  # Triton input names, default: the field's own
    cli: bool = True  # a `precast run` flag


def knob(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    meta = {"knob": Knob(**kwargs)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SamplingParams:
    max_tokens: int = knob(16, help="most tokens to generate", ge=1, openai=False, triton="TYPE_INT32",
                           triton_names=("max_tokens", "request_output_len"))  # fmt: skip
    temperature: float = knob(1.0, help="0 is greedy", ge=0, triton="TYPE_FP32")
    top_p: float = knob(1.0, help="nucleus sampling: smallest set of tokens with this much probability", gt=0, le=1, triton="TYPE_FP32",
                        triton_names=("top_p", "runtime_top_p"))  # fmt: skip
    top_k: int = knob(0, help="sample among the k most likely tokens (0 disables it)", ge=0, triton="TYPE_INT32",
                      triton_names=("top_k", "runtime_top_k"))  # fmt: skip
    min_p: float = knob(0.0, help="drop tokens less likely than min_p x the most likely one", ge=0, le=1, triton="TYPE_FP32")
    repetition_penalty: float = knob(1.0, help="HF's rule, on prompt and output tokens (1: off)", gt=0, triton="TYPE_FP32")
    presence_penalty: float = knob(0.0, help="OpenAI's rule, on output tokens", ge=-2, le=2, triton="TYPE_FP32")
    frequency_penalty: float = knob(0.0, help="OpenAI's rule, on output tokens", ge=-2, le=2, triton="TYPE_FP32")
    seed: int | None = knob(None, help="same seed, same tokens, whatever shares the batch", ge=0, lt=2**64, triton="TYPE_UINT64",
                            triton_names=("seed", "random_seed"))  # fmt: skip
    stop: list[str] = knob(
        factory=list, help="stop string, never part of the output text", triton="TYPE_STRING", triton_names=("stop_words",)
    )
    stop_token_ids: list[int] = knob(factory=list, help="token id that ends generation, besides the engine's eos ids")
    bad_words: list[str] = knob(factory=list, help="word never generated", triton="TYPE_STRING")
    min_tokens: int = knob(0, help="tokens generated before eos or a stop token may end the output", ge=0, triton="TYPE_INT32",
                           triton_names=("min_tokens", "min_length"))  # fmt: skip
    ignore_eos: bool = knob(False, help="keep generating past the eos token")
    logprobs: int | None = knob(
        None, help="None: none; 0: the chosen token's; n: also the n most likely", ge=0, le=20, openai=False, cli=False
    )
    prompt_logprobs: int | None = knob(
        None, help="None: none; 0: each prompt token's log-probability; n: also the n most likely", ge=0, le=20, openai=False, cli=False
    )
    skip_special_tokens: bool = knob(True, help="leave special tokens out of the text", cli=False)
    priority: int = knob(0, help="higher first among waiting requests", cli=False)
    speculative: bool = knob(True, help="may use the server's speculative decoding (false: plain decoding)", cli=False, triton="TYPE_BOOL")
    logit_bias: dict[int, float] | None = knob(
        None, help="token id -> a number added to its logit before sampling (-100 bans it)", ge=-100, le=100, cli=False
    )
    # Structured outputs (runtime/guided.py): at most one of these; the output then follows it token by token.
    json_schema: dict | str | None = knob(
        None, help="the output is JSON valid against this schema (a dict, or its JSON text)", openai=False
    )
    json_object: bool = knob(False, help="the output is one JSON object", openai=False)
    regex: str | None = knob(None, help="the output matches this regular expression", openai=False)
    grammar: str | None = knob(None, help="the output follows this Lark (or GBNF) grammar", openai=False)
    choice: list[str] | None = knob(None, help="the output is exactly one of these strings", openai=False)

    def validate(self) -> None:
        for f, k in knobs().items():
            problem = _problem(f, getattr(self, f.name), k)
            if problem:
                raise PrecastError(f"invalid sampling parameter: {f.name} must be {problem}, got {getattr(self, f.name)!r}")
        if self.min_tokens > self.max_tokens:
            raise PrecastError(f"invalid sampling parameter: min_tokens must be between 0 and max_tokens, got {self.min_tokens!r}")
        guides = [name for name in GUIDE_FIELDS if getattr(self, name) not in (None, False)]
        if len(guides) > 1:
            raise PrecastError(f"invalid sampling parameter: give at most one output format, got {' and '.join(guides)}")
        if guides and self.ignore_eos:
            raise PrecastError("invalid sampling parameter: ignore_eos cannot be combined with an output format (it ends at eos)")

    def guide(self) -> tuple[str, Any] | None:
        """The output format as (field name, value), or None for free text."""
        return next(((name, getattr(self, name)) for name in GUIDE_FIELDS if getattr(self, name) not in (None, False)), None)

    def to_request(self, prompt_ids: list[int], streaming: bool, bad_word_ids: list[list[int]]) -> Any:
        """The C++ request (validated first); `bad_word_ids`: bad_words as token sequences."""
        self.validate()
        req = _C.Request()
        req.prompt = prompt_ids
        req.max_tokens = self.max_tokens
        req.min_tokens = self.min_tokens
        req.stop_token_ids = list(self.stop_token_ids)
        req.ignore_eos = self.ignore_eos
        req.streaming = streaming or bool(self.stop)  # stop strings are matched on streamed text
        req.priority = self.priority
        req.speculative = self.speculative
        req.bad_words = bad_word_ids
        s = _C.SamplingParams()
        s.temperature = self.temperature
        s.top_k = self.top_k
        s.top_p = self.top_p
        s.min_p = self.min_p
        s.repetition_penalty = self.repetition_penalty
        s.presence_penalty = self.presence_penalty
        s.frequency_penalty = self.frequency_penalty
        s.seed = self.seed
        s.top_logprobs = -1 if self.logprobs is None else self.logprobs
        req.prompt_logprobs = -1 if self.prompt_logprobs is None else self.prompt_logprobs
        s.logit_bias = sorted((self.logit_bias or {}).items())
        req.sampling = s
        return req


GUIDE_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice")

# generation_config.json's names for SamplingParams fields (the engine's `generation`, builder/build.py)
_HF_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


ENGINE_DEFAULTED_FIELDS = frozenset(_HF_NAMES.values())


def engine_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """An engine's sampling defaults as SamplingParams fields. They replace the schema's defaults for
    fields a request leaves unset (as vLLM does with generation_config.json); do_sample false is greedy."""
    values = {_HF_NAMES[k]: v for k, v in generation.items() if k in _HF_NAMES}
    if generation.get("do_sample") is False:
        values["temperature"] = 0.0
    return values


def knobs() -> dict[dataclasses.Field, Knob]:
    return {f: f.metadata["knob"] for f in dataclasses.fields(SamplingParams)}


def field_type(f: dataclasses.Field) -> str:
    """ "int" | "float" | "bool" | "str" | "list[str]" | "list[int]" | "dict[int, float]" | "dict | str",
    optional ones without "| None"."""
    return str(f.type).replace(" | None", "")


def _problem(f: dataclasses.Field, value: Any, k: Knob) -> str | None:
    kind = field_type(f)
    if value is None and f.default is None:
        return None
    if kind == "str":
        return None if isinstance(value, str) and value else "a non-empty string"
    if kind == "dict | str":
        return None if isinstance(value, dict | str) and value != "" else "a JSON object or its text"
    if kind == "dict[int, float]":
        ok = isinstance(value, dict) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ok = ok and all(_out_of_bounds(v, "float", k) is None for v in value.values())
        return None if ok else f"a map of token ids to numbers {bounds_text(k)}"
    if kind.startswith("list["):
        item = str if kind == "list[str]" else int
        ok = isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) and (item is int or v) for v in value)
        return None if ok else ("a list of non-empty strings" if item is str else "a list of integers")
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    return _out_of_bounds(value, kind, k)


def _out_of_bounds(value: Any, kind: str, k: Knob) -> str | None:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind == "float" or isinstance(value, int))
    inside = numeric and not (isinstance(value, float) and math.isnan(value))
    inside = inside and (k.ge is None or value >= k.ge) and (k.gt is None or value > k.gt)
    inside = inside and (k.le is None or value <= k.le) and (k.lt is None or value < k.lt)
    return None if inside else ("an integer " if kind == "int" else "") + bounds_text(k)


def _number(x: float) -> str:
    return "2**64" if x == 2**64 else f"{x:g}"


def bounds_text(k: Knob) -> str:
    lo = None if k.ge is None and k.gt is None else ("[" if k.ge is not None else "(", k.ge if k.ge is not None else k.gt)
    hi = None if k.le is None and k.lt is None else ("]" if k.le is not None else ")", k.le if k.le is not None else k.lt)
    if lo and hi:
        return f"in {lo[0]}{_number(lo[1])}, {_number(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_number(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_number(hi[1])}"
    return "a number"
