"""The documented rule for default build limits."""

from __future__ import annotations

import dataclasses

from precast.engine.limits import resolve_limits
from precast.engine.spec import ModelSpec

SPEC = ModelSpec(
    architecture="llama",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    norm_eps=1e-5,
    activation="silu",
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=8192,
    qkv_bias=False,
    qk_norm=False,
    sliding_window=None,
    sliding_window_layers=(),
    tie_word_embeddings=True,
)


def test_defaults_follow_the_rule():
    limits = resolve_limits(SPEC)
    assert (limits.max_seq_len, limits.max_batch_size, limits.max_num_tokens, limits.tokens_per_block) == (4096, 64, 2048, 32)


def test_short_context_model():
    limits = resolve_limits(dataclasses.replace(SPEC, max_position_embeddings=1024))
    assert limits.max_seq_len == 1024 and limits.max_num_tokens == 1024


def test_max_num_tokens_never_below_batch():
    limits = resolve_limits(dataclasses.replace(SPEC, max_position_embeddings=32), max_batch_size=256)
    assert limits.max_seq_len == 32 and limits.max_num_tokens == 256


def test_explicit_values_are_kept():
    limits = resolve_limits(SPEC, max_batch_size=8, max_seq_len=512, max_num_tokens=100, tokens_per_block=16)
    assert (limits.max_batch_size, limits.max_seq_len, limits.max_num_tokens, limits.tokens_per_block) == (8, 512, 100, 16)


def test_num_parameters_counts_tied_head_once():
    untied = dataclasses.replace(SPEC, tie_word_embeddings=False)
    assert untied.num_parameters() - SPEC.num_parameters() == SPEC.vocab_size * SPEC.hidden_size
