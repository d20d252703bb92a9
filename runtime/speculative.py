"""Speculative decoding's set-up: which proposer an LLM's executor gets (cpp/proposer.h).

    LLM(engine, speculative="ngram")                  prompt lookup: no model, pays off when output repeats context
    LLM(engine, speculative="draft=engines/small")    a smaller engine with the same tokenizer proposes its greedy tokens

The executor checks every proposal in the target's own forward pass and keeps what the target itself would
produce (greedy: identical tokens; sampling: the rejection rule, the same distribution); docs/speculative.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from precast import _C
from precast.engine.directory import WEIGHTS_FILE, Engine, load_engine
from precast.errors import PrecastError
from precast.runtime.cpu_backend import make_cpu_runner

METHODS = ("ngram", "draft=ENGINE_DIR")
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 5, "draft": 4}
NGRAM_SIZES = (1, 3)  # prompt lookup matches the last 3, then 2, then 1 token(s)


@dataclass(frozen=True)
class Speculation:
    method: str  # "ngram" | "draft" | "custom"
    num_draft_tokens: int
    draft_engine: Path | None = None
    proposer: Any = None  # custom: a precast._C.Proposer subclass written in Python


def parse_speculative(value: str | Any, num_draft_tokens: int | None = None) -> Speculation:
    """`--speculative` / LLM(speculative=...): "ngram", "draft=ENGINE_DIR", or (Python API) a precast._C.Proposer
    object, whose propose([(request id, tokens, max draft)]) returns one token list per request."""
    if isinstance(value, _C.Proposer):
        if num_draft_tokens is None:
            raise PrecastError("a custom proposer needs num_draft_tokens")
        return Speculation("custom", _checked_k(num_draft_tokens), proposer=value)
    if not isinstance(value, str):
        raise PrecastError(f"speculative must be a string ({', '.join(METHODS)}) or a precast._C.Proposer, got {value!r}")
    method, _, arg = value.partition("=")
    if method not in DEFAULT_NUM_DRAFT_TOKENS or (method == "draft") != bool(arg):
        raise PrecastError(f"speculative={value!r} is not a method; use one of: {', '.join(METHODS)}")
    k = DEFAULT_NUM_DRAFT_TOKENS[method] if num_draft_tokens is None else num_draft_tokens
    return Speculation(method, _checked_k(k), Path(arg) if arg else None)


def _checked_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise PrecastError(f"num_draft_tokens must be an integer in [1, 64], got {k!r}")
    return k


def make_proposer(spec: Speculation, target: Engine, num_threads: int, kv_cache_bytes: int) -> tuple[Any, Any]:
    """The proposer and the executor's SpeculativeConfig for `spec` serving `target` on the CPU backend."""
    config = _C.SpeculativeConfig()
    config.num_draft_tokens = spec.num_draft_tokens
    max_draft_batch = config.max_draft_batch
    if spec.method == "ngram":
        return _C.NgramProposer(*NGRAM_SIZES), config
    if spec.method == "custom":
        return spec.proposer, config
    assert spec.draft_engine is not None
    draft = load_engine(spec.draft_engine)
    check_same_tokenizer(target, draft)
    limits = target.config.limits
    runner = make_cpu_runner(draft, num_threads)
    # On top of checking a draft token (the config's default cost): decoding reads the weights once a step, so a draft
    # model's step costs about its weights' share of the target's.
    config.draft_token_cost += (draft.path / WEIGHTS_FILE).stat().st_size / (target.path / WEIGHTS_FILE).stat().st_size
    # The draft keeps K/V for every request that drafts: max_draft_batch full-length sequences, within the
    # target's own budget (the draft's K/V per token is smaller than the target's).
    draft_limits = draft.config.limits
    per_token = runner.kv_block_bytes(draft_limits.tokens_per_block) // draft_limits.tokens_per_block
    full = max_draft_batch * limits.max_seq_len * per_token
    try:
        proposer = _C.DraftModelProposer(
            runner, min(full, kv_cache_bytes), draft_limits.tokens_per_block, draft_limits.max_seq_len, draft_limits.max_num_tokens
        )
    except ValueError as e:
        raise PrecastError(f"draft engine {draft.path}: {e}") from e
    return proposer, config


def check_same_tokenizer(target: Engine, draft: Engine) -> None:
    """A draft proposes token ids, so both engines must map text to the same ids; PrecastError when not."""
    if target.tokenizer_path is None or draft.tokenizer_path is None:
        raise PrecastError("speculative decoding with a draft engine needs both engines' tokenizers to compare them")
    mine, theirs = _vocabulary(target), _vocabulary(draft)
    if mine != theirs:
        differing = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        shown = ", ".join(f"{t!r}={i}" for t, i in differing)
        raise PrecastError(
            f"the draft engine {draft.path} has a different tokenizer from {target.path} ({len(theirs):,} vs "
            f"{len(mine):,} tokens; first differences: {shown}); a draft must share the target's tokenizer"
        )


def _vocabulary(engine: Engine) -> dict[str, int]:
    try:
        return HFTokenizer.from_file(str(engine.tokenizer_path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises plain Exceptions
        raise PrecastError(f"cannot read {engine.tokenizer_path} ({e}); rebuild the engine") from e
