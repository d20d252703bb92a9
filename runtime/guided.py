"""Structured outputs: the grammar that decides which tokens may come next, through llguidance.

A request whose SamplingParams name an output format (json_schema, json_object, regex, grammar, choice)
gets a guide: one llguidance matcher, registered here under a guide id that travels in the C++ request.
The executor (cpp/guided_decoder.h) asks this object for all of a step's masks in one call and reports all
sampled tokens in one call; requests without a format never reach it. The mask is applied in the sampler
before bad words, logit bias, penalties and top-k/top-p/min-p.

Compiled grammars are cached: the first request with a given format builds its matcher (a JSON schema takes
milliseconds, a large one more), later ones deep-copy it. llguidance drops the GIL while it compiles and
computes masks, so the server's event loop keeps running.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from precast import _C
from precast.errors import PrecastError

# JSON is written with ", " and ": " and no other whitespace: free whitespace lets small models loop on
# newlines inside an object, and these separators are what models write anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 256


def grammar_text(kind: str, value: Any) -> str:
    """An output format as llguidance's grammar text; PrecastError when the value is not that kind of thing."""
    import llguidance

    try:
        if kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise PrecastError("json_schema must be a JSON object (a schema), got " + type(schema).__name__)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "grammar":  # Lark as llguidance reads it, or GBNF as llama.cpp writes it
            return llguidance.grammar_from("grammar", value)
        if kind == "choice":
            if not value:
                raise PrecastError("choice needs at least one string")
            return llguidance.grammar_from("choice", value)
    except (ValueError, json.JSONDecodeError) as e:
        raise PrecastError(f"the {kind} cannot be used: {e}") from e
    raise PrecastError(f"unknown output format {kind!r}")


class GuidedDecoding(_C.GuidedDecoder):
    """The executor's GuidedDecoder: guide id -> llguidance matcher. Thread-safe: clients add and remove
    guides while the executor's loop thread fills masks and advances them."""

    def __init__(self, tokenizer_file: Path | None, vocab_size: int, eos_token_ids: list[int]):
        super().__init__()
        self._tokenizer_file, self._vocab_size, self._eos = tokenizer_file, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use (a second for a large vocabulary)
        self._parallel: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # grammar text -> pristine matcher
        self._matchers: dict[int, Any] = {}
        self._ids = itertools.count(1)
        # Time the executor's loop thread spends here (only it writes these): benchmarks/structured_cpu.py.
        self.mask_rows, self.mask_seconds, self.advance_seconds = 0, 0.0, 0.0

    # ---- clients ----------------------------------------------------------------------
    def prepare(self, kind: str, value: Any) -> None:
        """Compile a format into the cache now (PrecastError if it cannot be), so that add() later only copies it:
        a server prepares formats in a worker thread, never on its event loop."""
        self._compile(kind, value)

    def add(self, kind: str, value: Any) -> int:
        """A new guide for one request; PrecastError naming the problem when the format cannot be compiled."""
        matcher = self._compile(kind, value).deep_copy()
        guide_id = next(self._ids)
        with self._lock:
            self._matchers[guide_id] = matcher
        return guide_id

    def remove(self, guide_id: int) -> None:
        with self._lock:
            self._matchers.pop(guide_id, None)

    def grammar_literal(self, text: str) -> str:
        """`text` as a Lark literal for grammars given here: `<[token id]>` when it is one special token (such
        as Qwen's <tool_call>; a quoted string would never match it), else a quoted string."""
        tokenizer = self._llg_tokenizer()
        ids = tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    @property
    def num_guides(self) -> int:
        with self._lock:
            return len(self._matchers)

    def _compile(self, kind: str, value: Any) -> Any:
        import llguidance

        text = grammar_text(kind, value)
        key = (kind, text)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached
        limits = llguidance.LLParserLimits(verbose_errors=False)  # messages go to clients: no grammar dumps
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0, limits=limits)
        if matcher.is_error():
            raise PrecastError(f"the {kind} cannot be used: {matcher.get_error()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def _llg_tokenizer(self) -> Any:
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                if self._tokenizer_file is None:
                    raise PrecastError("structured outputs need the engine's tokenizer (tokenizer.json); this engine has none")
                if not self._eos:
                    raise PrecastError("structured outputs need an end-of-text token; this engine's tokenizer names none")
                text = self._tokenizer_file.read_text(encoding="utf-8")
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self._vocab_size, eos_token=self._eos)
                self._parallel = llguidance.LLExecutor()
            return self._tokenizer

    # ---- the executor's loop thread (cpp/guided_decoder.h) -----------------------------
    def fill_masks(self, guide_ids: list[int], masks: np.ndarray) -> list[str]:
        from llguidance.numpy import fill_next_token_bitmask_par

        start = time.perf_counter()
        with self._lock:
            matchers = [self._matchers.get(g) for g in guide_ids]
        errors = ["" if m is not None else "the request's grammar is gone" for m in matchers]
        work = []
        for row, m in enumerate(matchers):
            if m is not None and m.is_error():
                errors[row] = m.get_error()
            elif m is not None:
                work.append((m, row))
        if len(work) == 1:
            m, row = work[0]
            m.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks.shape[1] * 4)
        elif work:
            fill_next_token_bitmask_par(self._parallel, work, masks)
        for m, row in work:
            if m.is_error():
                errors[row] = m.get_error()
        self.mask_rows += len(guide_ids)
        self.mask_seconds += time.perf_counter() - start
        return errors

    def advance(self, guide_ids: list[int], tokens: list[int]) -> None:
        start = time.perf_counter()
        with self._lock:
            pairs = [(self._matchers.get(g), t) for g, t in zip(guide_ids, tokens)]
        for m, token in pairs:
            if m is not None:
                m.consume_token(token)  # a refused token leaves the matcher in its error state: reported at the next mask
        self.advance_seconds += time.perf_counter() - start
