"""Embedding rows gathered from the table in its stored format (a tied, quantized LM head quantizes the
embedding too), widened to float32 and multiplied by the engine's embedding scale (Gemma: sqrt(hidden))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from precast.plugins.triton.linear import FORMATS, LinearWeight
from precast.plugins.triton.numerics import decode_e2m1, decode_int4, nibble


@triton.jit
def _gather_kernel(
    ids_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr, H, weight_scale, embedding_scale,
    W_FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    row = tl.load(ids_ptr + t).to(tl.int64)
    if W_FORMAT == 0 or W_FORMAT == 1:
        v = tl.load(w_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        code = nibble(tl.load(w_ptr + row * (H // 2) + cols // 2, mask=mask, other=0), cols)
        scale = tl.load(scale_ptr + row * (H // GROUP) + cols // GROUP, mask=mask, other=0.0).to(tl.float32)
        if W_FORMAT == 2:
            v = decode_int4(code) * scale
            if HAS_OFFSET:
                v += tl.load(offset_ptr + row * (H // GROUP) + cols // GROUP, mask=mask, other=0.0)
        else:
            v = decode_e2m1(code) * scale
    tl.store(out_ptr + t * H + cols, (v * weight_scale) * embedding_scale, mask=mask)


def embedding_gather(
    token_ids: torch.Tensor, table: LinearWeight, embedding_scale: float = 1.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int32/int64 ids [T] -> float32 rows [T, hidden] (row x the format's per-tensor scale x embedding_scale)."""
    (T,) = token_ids.shape
    H = table.cols
    out = torch.empty((T, H), dtype=torch.float32, device=token_ids.device) if out is None else out
    if T:
        block = min(1024, triton.next_power_of_2(H))
        scales = table.scales if table.scales is not None else table.values
        _gather_kernel[(T, triton.cdiv(H, block))](
            token_ids, table.values, scales, table.offsets if table.offsets is not None else scales, out, H,
            table.weight_scale, embedding_scale,
            W_FORMAT=FORMATS[table.format], GROUP=max(table.group_size, 1), HAS_OFFSET=table.offsets is not None, BLOCK=block,
        )  # fmt: skip
    return out
