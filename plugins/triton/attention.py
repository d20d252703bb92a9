"""Paged attention over a packed batch: prefill, chunked prefill and decode in one kernel.

The pools are [num_blocks, num_kv_heads, tokens_per_block, head_dim] (float32, or E4M3 with one K and one V
scale per layer); position p of a sequence lives in block block_table[p / tokens_per_block], row
p % tokens_per_block. Query token t of a sequence (position context_len + t) attends to positions
[lo, context_len + t], lo = context_len + t - window + 1 with a sliding window (else 0): the CPU kernel's rule.

One program takes one KV head and a tile of up to BT query tokens of one sequence, with every query head
sharing that KV head (GQA): its rows are (token, head) pairs, so a decode step's heads share each K/V load.
Keys go by one KV block at a time with an online softmax; scores are q.k * scale, soft-capped
(cap * tanh(score / cap)) where the model says. Tiles are listed by the host (tile -> sequence, first token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attention_kernel(
    q_ptr, q_stride, out_ptr, out_stride, k_cache, v_cache, block_tables, max_blocks,
    tile_seq_ptr, tile_first_ptr, ctx_ptr, ntok_ptr, offset_ptr,
    scale, k_scale, v_scale, softcap, window,
    GROUP: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, B: tl.constexpr,
    BT: tl.constexpr, ROWS: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    ctx = tl.load(ctx_ptr + s)
    ntok = tl.load(ntok_ptr + s)
    offset = tl.load(offset_ptr + s)

    r = tl.arange(0, ROWS)
    t_local = r // GROUP
    head = kvh * GROUP + r % GROUP
    valid = (r < BT * GROUP) & (first + t_local < ntok)
    token = (offset + first + t_local).to(tl.int64)
    d = tl.arange(0, BD)
    d_mask = d < D
    q = tl.load(q_ptr + token[:, None] * q_stride + head[:, None] * D + d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
    pos = ctx + first + t_local

    last = ctx + tl.minimum(first + BT, ntok) - 1  # the tile's last position
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx + first - window + 1, 0)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BD), tl.float32)
    kv_rows = tl.arange(0, B)
    for kb in range(lo // B, last // B + 1):
        block = tl.load(block_tables + s.to(tl.int64) * max_blocks + kb).to(tl.int64)
        at = ((block * KVH + kvh) * B + kv_rows)[:, None] * D + d[None, :]
        key = kb * B + kv_rows
        k = tl.load(k_cache + at, mask=(key <= last)[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * (scale * k_scale)
        if SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        mask = (key[None, :] <= pos[:, None]) & valid[:, None]
        if WINDOW:
            mask = mask & (key[None, :] > pos[:, None] - window)
        scores = tl.where(mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Rows past the tile's last position were never written (a pool is uninitialized memory: NaN bits
        # times a zero weight would still be NaN), so they are not read.
        v = tl.load(v_cache + at, mask=(key <= last)[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    tl.store(out_ptr + token[:, None] * out_stride + head[:, None] * D + d[None, :], out, mask=valid[:, None] & d_mask[None, :])


@dataclass
class AttentionBatch:
    """The packed batch as the kernel reads it (device tensors), made once per step and shared by every layer."""

    block_tables: torch.Tensor  # int32 [sequences, max_blocks]
    context_lens: torch.Tensor  # int32 [sequences]
    num_tokens: torch.Tensor  # int32 [sequences]
    token_offsets: torch.Tensor  # int32 [sequences]
    tile_seq: torch.Tensor  # int32 [tiles]
    tile_first: torch.Tensor  # int32 [tiles]
    tokens_per_tile: int

    @classmethod
    def make(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        num_tokens: list[int],
        token_offsets: list[int],
        group: int,
        device: torch.device | str,
        tokens_per_tile: int | None = None,
    ) -> AttentionBatch:
        """Tiles of up to `tokens_per_tile` tokens (default: 1 for a decode-only batch, else enough tokens for
        about 64 rows of (token, head) pairs)."""
        if tokens_per_tile is None:
            tokens_per_tile = 1 if max(num_tokens, default=1) <= 1 else max(1, 64 // group)
        tile_seq, tile_first = [], []
        for s, n in enumerate(num_tokens):
            for first in range(0, n, tokens_per_tile):
                tile_seq.append(s)
                tile_first.append(first)
        width = max((len(b) for b in block_tables), default=1) or 1
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for s, blocks in enumerate(block_tables):
            table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            table.to(device),
            ints(context_lens),
            ints(num_tokens),
            ints(token_offsets),
            ints(tile_seq),
            ints(tile_first),
            tokens_per_tile,
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    num_heads: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: float32 rows [T, >= num_heads * head_dim] (stride q.stride(0): q may be the leading columns of qkv);
    out: float32 [T, num_heads * head_dim]. The new tokens' K/V must already be in the pools."""
    _, kv_heads, tokens_per_block, head_dim = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {kv_heads} KV heads evenly")
    if tokens_per_block < 16 or tokens_per_block & (tokens_per_block - 1):
        raise ValueError(f"the GPU attention kernel needs tokens_per_block a power of two >= 16, got {tokens_per_block}")
    group = num_heads // kv_heads
    tiles = batch.tile_seq.shape[0]
    if tiles == 0:
        return out
    bt = batch.tokens_per_tile
    _attention_kernel[(tiles, kv_heads)](
        q, q.stride(0), out, out.stride(0), k_cache, v_cache, batch.block_tables, batch.block_tables.shape[1],
        batch.tile_seq, batch.tile_first, batch.context_lens, batch.num_tokens, batch.token_offsets,
        scale, k_scale, v_scale, softcap, window,
        GROUP=group, KVH=kv_heads, D=head_dim, BD=max(16, triton.next_power_of_2(head_dim)), B=tokens_per_block,
        BT=bt, ROWS=max(16, triton.next_power_of_2(bt * group)), SOFTCAP=softcap > 0, WINDOW=window > 0,
    )  # fmt: skip
    return out
