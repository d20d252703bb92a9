"""Build limits: the largest batch, sequence and step an engine is built for.

The rule for defaults (docs/cli.md repeats it):
- max_seq_len     = the model's context length (max_position_embeddings), capped at 4096;
- max_batch_size  = 64;
- max_num_tokens  = max_seq_len capped at 2048, and never below max_batch_size
                    (a step must fit one decode token of every running request);
- tokens_per_block = 32.
Any of them can be set; values are checked against each other and the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from precast.engine.spec import ModelSpec
from precast.errors import PrecastError

DEFAULT_MAX_SEQ_LEN_CAP = 4096
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_NUM_TOKENS_CAP = 2048
DEFAULT_TOKENS_PER_BLOCK = 32
KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": float32 on CPU; "fp8": E4M3 with calibrated per-layer scales


@dataclass(frozen=True)
class BuildLimits:
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_dtype: str = "auto"

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


def resolve_limits(
    spec: ModelSpec,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    max_num_tokens: int | None = None,
    tokens_per_block: int | None = None,
    kv_cache_dtype: str = "auto",
) -> BuildLimits:
    seq = max_seq_len if max_seq_len is not None else min(spec.max_position_embeddings, DEFAULT_MAX_SEQ_LEN_CAP)
    batch = max_batch_size if max_batch_size is not None else DEFAULT_MAX_BATCH_SIZE
    tokens = max_num_tokens if max_num_tokens is not None else max(min(seq, DEFAULT_MAX_NUM_TOKENS_CAP), batch)
    block = tokens_per_block if tokens_per_block is not None else DEFAULT_TOKENS_PER_BLOCK
    for flag, value in (("--max-batch-size", batch), ("--max-seq-len", seq), ("--max-num-tokens", tokens), ("--tokens-per-block", block)):
        if value < 1:
            raise PrecastError(f"{flag} must be at least 1, got {value}")
    if seq > spec.max_position_embeddings:
        raise PrecastError(
            f"--max-seq-len {seq} exceeds the model's context length ({spec.max_position_embeddings} tokens, "
            "max_position_embeddings); positions beyond it were never trained"
        )
    if tokens < batch:
        raise PrecastError(
            f"--max-num-tokens {tokens} is below --max-batch-size {batch}: a step must fit one token of every running request"
        )
    if block & (block - 1):
        raise PrecastError(f"--tokens-per-block must be a power of two, got {block}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PrecastError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; choose from {', '.join(KV_CACHE_DTYPES)}")
    return BuildLimits(batch, seq, tokens, block, kv_cache_dtype)
