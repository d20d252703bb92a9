"""The step from q/k/v projections to the KV cache: q and k RMSNormed per head (qk-norm models), rotated by
RoPE, q written back in place, k and v stored into the paged pool at their token's slot. One kernel, launched
once per section of qkv (q, k, v), each program taking 16 (token, head) rows.

The k section is not written back: attention reads K from the pool.

RoPE pairs element j with j + head_dim / 2 (j < head_dim / 2); cos and sin come from tables
[positions, head_dim / 2] the host makes from the engine's RoPE parameters (every scaling kind precast knows
reduces to inverse frequencies and an attention factor), 1 and 0 past the rotary pairs (partial rotary).
Pools are [num_blocks, num_kv_heads, tokens_per_block, head_dim]: float32, bfloat16 or float16 (values rounded
to nearest even), or E4M3 (value / per-layer scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from precast.plugins.triton.numerics import round_to_bf16, round_to_e4m3

POOL_KINDS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2, torch.float16: 3}


@triton.jit
def _rope_rows_kernel(
    qkv_ptr, qkv_stride, col0, num_rows, pos_ptr, block_ptr, offset_ptr, cos_ptr, sin_ptr, norm_ptr, cache_ptr, scale, eps,
    HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, B: tl.constexpr,
    BR: tl.constexpr, ROTATE: tl.constexpr, QK_NORM: tl.constexpr, WRITE_BACK: tl.constexpr, TO_CACHE: tl.constexpr,
    POOL: tl.constexpr,
):  # fmt: skip
    """BR rows of (token, head) pairs of one section of qkv (q, k or v, starting at column col0)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    row_mask = r < num_rows
    token = (r // HEADS).to(tl.int64)
    head = r % HEADS
    j = tl.arange(0, BH)
    mask = row_mask[:, None] & (j < HALF)[None, :]
    at = qkv_ptr + token[:, None] * qkv_stride + col0 + head[:, None] * D + j[None, :]
    x1 = tl.load(at, mask=mask, other=0.0)
    x2 = tl.load(at + HALF, mask=mask, other=0.0)
    if QK_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
        w1 = tl.load(norm_ptr + j, mask=j < HALF, other=0.0)
        w2 = tl.load(norm_ptr + HALF + j, mask=j < HALF, other=0.0)
        x1 = w1[None, :] * (x1 * inv[:, None])
        x2 = w2[None, :] * (x2 * inv[:, None])
    if ROTATE:
        pos = tl.load(pos_ptr + token, mask=row_mask, other=0).to(tl.int64)
        c = tl.load(cos_ptr + pos[:, None] * HALF + j[None, :], mask=mask, other=1.0)
        s = tl.load(sin_ptr + pos[:, None] * HALF + j[None, :], mask=mask, other=0.0)
        x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
    if WRITE_BACK:
        tl.store(at, x1, mask=mask)
        tl.store(at + HALF, x2, mask=mask)
    if TO_CACHE:
        block = tl.load(block_ptr + token, mask=row_mask, other=0).to(tl.int64)
        offset = tl.load(offset_ptr + token, mask=row_mask, other=0)
        slot = cache_ptr + ((block * KVH + head)[:, None] * B + offset[:, None]) * D + j[None, :]
        if POOL == 1:
            tl.store(slot, round_to_e4m3(x1 / scale).to(tl.float8e4nv), mask=mask)
            tl.store(slot + HALF, round_to_e4m3(x2 / scale).to(tl.float8e4nv), mask=mask)
        elif POOL == 2:  # rounded first: the interpreter's own conversion does not round to nearest even
            tl.store(slot, round_to_bf16(x1).to(tl.bfloat16), mask=mask)
            tl.store(slot + HALF, round_to_bf16(x2).to(tl.bfloat16), mask=mask)
        elif POOL == 3:
            tl.store(slot, x1.to(tl.float16), mask=mask)
            tl.store(slot + HALF, x2.to(tl.float16), mask=mask)
        else:
            tl.store(slot, x1, mask=mask)
            tl.store(slot + HALF, x2, mask=mask)


ROWS_PER_PROGRAM = 16


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """qkv float32 [T, (num_heads + 2 num_kv_heads) * head_dim] (q and k rotated in place); token t's K/V go to
    block slot_blocks[t], row slot_offsets[t] of the pools; cos/sin float32 [positions, head_dim / 2]."""
    T = qkv.shape[0]
    _, kv_heads, tokens_per_block, head_dim = k_cache.shape
    if kv_heads != num_kv_heads or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError("qkv and the KV pools disagree on heads or head_dim")
    if T == 0:
        return
    half = head_dim // 2
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    dummy = cos  # pointers a section does not read
    sections = (  # (first column, heads, rotate, norm, write back, cache, scale)
        (0, num_heads, True, q_norm, True, None, 1.0),
        (q_size, num_kv_heads, True, k_norm, False, k_cache, k_scale),
        (q_size + kv_size, num_kv_heads, False, None, False, v_cache, v_scale),
    )
    for col0, heads, rotate, norm, write_back, cache, scale in sections:
        rows = T * heads
        _rope_rows_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
            qkv, qkv.stride(0), col0, rows, positions, slot_blocks, slot_offsets, cos, sin,
            norm if norm is not None else dummy, cache if cache is not None else dummy, scale, eps,
            HEADS=heads, KVH=num_kv_heads, D=head_dim, HALF=half, BH=triton.next_power_of_2(half), B=tokens_per_block,
            BR=ROWS_PER_PROGRAM, ROTATE=rotate, QK_NORM=norm is not None, WRITE_BACK=write_back, TO_CACHE=cache is not None,
            POOL=POOL_KINDS[k_cache.dtype],
        )  # fmt: skip
