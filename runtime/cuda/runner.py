"""The CUDA runner: one forward pass of the engine's decoder over the executor's packed batch, on precast's
Triton kernels (plugins/triton), with the same engine directory, executor, scheduler and KV manager as the CPU.

Weights are uploaded once (weights.py). The KV pools live in device memory: per layer one K and one V array
[num_blocks, num_kv_heads, tokens_per_block, head_dim] of E4M3 (`--kv-cache-dtype fp8`), of the engine's
bf16 / fp16 (precision "weights"), or float32. A step
is `prepare` (the batch's metadata as device tensors: one host-to-device copy per step) then `compute` (every
kernel, no host synchronisation except a mixture of experts' routing), then the logits rows go to the host,
where the executor's sampler takes them (the documented split: sampling stays on the CPU).

Decode-only steps on a GPU replay CUDA graphs captured per batch-size bucket (graphs.py), taking kernel launch
overhead off the decode path. Under TRITON_INTERPRET=1 (the tests) the same code runs on CPU tensors through
Triton's interpreter, graphs excepted: their padded static batches run eagerly instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from precast import _C
from precast.engine.directory import Engine
from precast.engine.rope import has_local_rope, rope_tables
from precast.engine.tensors import head_name
from precast.errors import PrecastError
from precast.runtime.precision import check_matmul_precision

NO_GPU = (
    "backend 'cuda' runs precast's Triton kernels on an NVIDIA GPU, and torch sees none here; use backend='cpu' "
    "(or set TRITON_INTERPRET=1 to run the same kernels on the CPU through Triton's interpreter: very slow, for checking)"
)


def make_cuda_runner(engine: Engine, precision: str = "weights", cuda_graphs: bool = True) -> Any:
    """backend 'cuda'. precision: "weights" multiplies dense and int4 layers on the engine dtype's tensor cores
    (bf16 / fp16 inputs), "float32" in IEEE float32 like the CPU runner. cuda_graphs: decode steps replay
    graphs (graphs.py). Refused at once without a GPU, unless TRITON_INTERPRET=1."""
    check_matmul_precision(precision)
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        raise PrecastError("backend 'cuda' needs torch and triton: pip install 'precast[gpu]'") from None
    from precast.plugins.triton import interpreting

    if interpreting():
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise PrecastError(NO_GPU)
    return CudaRunner(engine, device, precision, cuda_graphs=cuda_graphs)


@dataclass
class StepInputs:
    """One step's batch on the device."""

    token_ids: Any  # int32 [T]
    positions: Any  # int32 [T]
    slot_blocks: Any  # int32 [T]: the block each token's K/V go to
    slot_offsets: Any  # int32 [T]: and the row in it
    attention: Any  # plugins/triton/attention.py AttentionBatch
    logit_rows: Any  # int64 [R]: the rows of the step whose logits are returned


class CudaRunner(_C.ModelRunner):
    def __init__(self, engine: Engine, device: Any, precision: str = "weights", cuda_graphs: bool = False, weights: Any = None):
        """`weights`: DeviceWeights made elsewhere (benchmarks/gpu_check.py builds 8B-shaped layers in GPU memory);
        by default the engine's, uploaded."""
        super().__init__()
        import torch

        from precast.runtime.cuda.weights import torch_dtype, upload

        self.torch = torch
        self.engine = engine
        self.spec = spec = engine.config.model
        self.device = device
        self.precision = precision
        self.compute_dtype = torch_dtype(engine.config.dtype)
        self.weights = weights if weights is not None else upload(engine, device)
        self.kv_fp8 = engine.config.quant.kv_cache is not None
        # The pools' element: E4M3 when built so; the engine's 16-bit dtype with precision "weights"; else float32
        # (the CPU runner's pools, for precision "float32" and float32 engines).
        if self.kv_fp8:
            self.kv_dtype = torch.float8_e4m3fn
        elif precision == "weights" and self.compute_dtype in (torch.bfloat16, torch.float16):
            self.kv_dtype = self.compute_dtype
        else:
            self.kv_dtype = torch.float32
        self.k_scales = list(engine.config.quant.kv_cache.k_scales) if self.kv_fp8 else [1.0] * spec.num_layers
        self.v_scales = list(engine.config.quant.kv_cache.v_scales) if self.kv_fp8 else [1.0] * spec.num_layers
        self.max_positions = engine.config.limits.max_seq_len
        self.rope = {False: self._rope_tables(local=False)}
        if has_local_rope(spec):
            self.rope[True] = self._rope_tables(local=True)
        self.attention_scale = spec.attention_scale or 1.0 / math.sqrt(spec.head_dim)
        self.k_pools: list[Any] = []
        self.v_pools: list[Any] = []
        self.tokens_per_block = 0
        self.graphs = None
        self.want_graphs = cuda_graphs and not spec.num_experts  # routing syncs with the host: no graph
        self.scratch_block = 0

    # --- the seam -------------------------------------------------------------------------------
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def supports_all_logits(self) -> bool:
        return True

    def kv_block_bytes(self, tokens_per_block: int) -> int:
        s = self.spec
        return s.num_layers * 2 * s.num_kv_heads * tokens_per_block * s.head_dim * self.kv_dtype.itemsize

    def kv_memory_cap(self) -> int | None:
        """The default KV pool's ceiling on a GPU: 90% of the device memory free once the weights are in (the
        interpreter's pools are host memory, capped like the CPU runner's)."""
        if self.device.type != "cuda":
            return None
        free, _ = self.torch.cuda.mem_get_info(self.device)
        return int(free * 0.9)

    def configure_kv(self, num_blocks: int, tokens_per_block: int) -> None:
        if tokens_per_block < 16 or tokens_per_block & (tokens_per_block - 1):
            raise ValueError(
                f"the CUDA runner's attention kernel needs tokens_per_block a power of two >= 16; this engine has "
                f"{tokens_per_block}: rebuild it with --tokens-per-block 32"
            )
        torch, s, dtype = self.torch, self.spec, self.kv_dtype
        # One block more than the executor hands out: the padded rows of a graph's batch write there.
        shape = (num_blocks + 1, s.num_kv_heads, tokens_per_block, s.head_dim)
        self.k_pools = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(s.num_layers)]
        self.v_pools = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(s.num_layers)]
        self.tokens_per_block = tokens_per_block
        self.scratch_block = num_blocks
        if self.want_graphs:
            from precast.runtime.cuda.graphs import DecodeGraphs

            # Captured on a GPU; under the interpreter the padded static batches run eagerly.
            self.graphs = DecodeGraphs(self, self.engine.config.limits.max_batch_size, capture=self.device.type == "cuda")

    def forward(self, batch: Any) -> np.ndarray:
        if not self.k_pools:
            raise ValueError("configure_kv() was not called")
        seqs = list(batch.sequences)
        if self.graphs is not None and self.graphs.takes(seqs):
            logits = self.graphs.run(batch)
        else:
            logits = self.compute(self.prepare(batch))
        return logits.cpu().numpy()

    # --- a step -----------------------------------------------------------------------------------
    def prepare(self, batch: Any) -> StepInputs:
        """The executor's batch as device tensors (one copy each)."""
        from precast.plugins.triton.attention import AttentionBatch

        torch, B = self.torch, self.tokens_per_block
        seqs = list(batch.sequences)
        token_ids = np.asarray(batch.token_ids, np.int32)
        positions = np.asarray(batch.positions, np.int32)
        self.check_batch(token_ids, positions)
        slot_blocks = np.empty_like(positions)
        rows: list[int] = []
        for s in seqs:
            span = slice(s.token_offset, s.token_offset + s.num_tokens)
            table = np.asarray(s.block_table, np.int32)
            slot_blocks[span] = table[positions[span] // B]
            if s.all_logits:
                rows.extend(range(span.start, span.stop))
            elif s.sample:
                rows.append(span.stop - 1)
        group = self.spec.num_heads // self.spec.num_kv_heads
        attention = AttentionBatch.make(
            [list(s.block_table) for s in seqs],
            [s.context_len for s in seqs],
            [s.num_tokens for s in seqs],
            [s.token_offset for s in seqs],
            group,
            self.device,
        )

        def put(a: np.ndarray, dtype: Any = torch.int32) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)

        return StepInputs(
            put(token_ids), put(positions), put(slot_blocks), put(positions % B), attention, put(np.asarray(rows, np.int64), torch.int64)
        )

    def compute(self, step: StepInputs) -> Any:
        """The decoder on the device: logits [rows, vocab] float32 (a device tensor)."""
        from precast.plugins import triton as k

        torch, spec, w = self.torch, self.spec, self.weights
        x = k.embedding_gather(step.token_ids, w.linear("embed"), self.engine.config.embedding_scale)
        T, eps = x.shape[0], spec.norm_eps
        tmp = None  # the previous block's output, added to x by the next norm
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            h = k.rms_norm(x, w.vector(p + "attn_norm.weight"), eps, residual=tmp, fp8_scale=self.fp8_input(p + "attn.qkv"))
            qkv = self.linear(h, p + "attn.qkv", bias=w.vectors.get(p + "attn.qkv.bias"))
            sliding = i in spec.sliding_window_layers and bool(spec.sliding_window)
            cos, sin = self.rope[sliding and has_local_rope(spec)]
            q_norm = w.vector(p + "attn.q_norm.weight") if spec.qk_norm else None
            k_norm = w.vector(p + "attn.k_norm.weight") if spec.qk_norm else None
            k.rope_and_cache(
                qkv, step.positions, step.slot_blocks, step.slot_offsets, cos, sin, self.k_pools[i], self.v_pools[i],
                spec.num_heads, spec.num_kv_heads, q_norm, k_norm, eps, self.k_scales[i], self.v_scales[i],
            )  # fmt: skip
            attn = torch.empty((T, spec.q_size), dtype=torch.float32, device=self.device)
            k.paged_attention(
                qkv, self.k_pools[i], self.v_pools[i], step.attention, spec.num_heads, self.attention_scale, attn,
                window=spec.sliding_window if sliding else 0, softcap=spec.attn_logit_softcap or 0.0,
                k_scale=self.k_scales[i], v_scale=self.v_scales[i],
            )  # fmt: skip
            tmp = self.linear(attn, p + "attn.o")
            if spec.sandwich_norms:
                k.rms_norm(tmp, w.vector(p + "post_attn_norm.weight"), eps, out=tmp)
            if spec.is_moe_layer(i):
                tmp = self.mixture(k.rms_norm(x, w.vector(p + "mlp_norm.weight"), eps, residual=tmp), p)
            else:
                h = k.rms_norm(x, w.vector(p + "mlp_norm.weight"), eps, residual=tmp, fp8_scale=self.fp8_input(p + "mlp.gate_up"))
                act = k.gated_activation(self.linear(h, p + "mlp.gate_up"), spec.activation, fp8_scale=self.fp8_input(p + "mlp.down"))
                tmp = self.linear(act, p + "mlp.down")
            if spec.sandwich_norms:
                k.rms_norm(tmp, w.vector(p + "post_mlp_norm.weight"), eps, out=tmp)
        x += tmp
        last = k.rms_norm(x.index_select(0, step.logit_rows), w.vector("final_norm.weight"), eps)
        logits = self.linear(last, head_name(spec))
        if spec.final_logit_softcap is not None:
            cap = spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fp8_input(self, layer: str) -> float | None:
        """The input scale of a layer that takes fp8 inputs: the kernel before it quantizes its output."""
        weight = self.weights.linear(layer)
        return weight.input_scale if weight.input_quant == "fp8" else None

    def linear(self, x: Any, layer: str, bias: Any = None) -> Any:
        from precast.plugins.triton import linear

        return linear(x, self.weights.linear(layer), bias=bias, precision=self.precision, compute_dtype=self.compute_dtype)

    def mixture(self, h: Any, p: str) -> Any:
        """A mixture-of-experts block: softmax routing in float32, the top experts (renormalised where the family
        does), each routed expert run once over its tokens, summed per token in expert order; the shared expert
        gated by sigmoid(shared_gate . h)."""
        from precast.plugins.triton import gated_activation

        torch, spec = self.torch, self.spec
        probs = torch.softmax(self.linear(h, p + "moe.router"), dim=-1)
        weights, experts = torch.topk(probs, spec.experts_per_token, dim=-1)
        if spec.moe_renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in torch.unique(experts).tolist():  # a host sync: which experts this step routes to
            tokens, slots = (experts == e).nonzero(as_tuple=True)
            x = self.linear(h.index_select(0, tokens), f"{p}moe.experts.{e}.gate_up")
            y = self.linear(gated_activation(x, spec.activation), f"{p}moe.experts.{e}.down")
            out.index_add_(0, tokens, y * weights[tokens, slots][:, None])
        if spec.shared_expert_intermediate_size:
            y = self.linear(gated_activation(self.linear(h, p + "moe.shared.gate_up"), spec.activation), p + "moe.shared.down")
            out += torch.sigmoid(self.linear(h, p + "moe.shared_gate")) * y
        return out

    def _rope_tables(self, local: bool) -> tuple[Any, Any]:
        """cos and sin [max_seq_len, head_dim / 2] on the device (precast/engine/rope.py's tables)."""
        cos, sin = rope_tables(self.spec, self.max_positions, self.max_positions, local=local)
        return self.torch.from_numpy(cos).to(self.device), self.torch.from_numpy(sin).to(self.device)

    def check_batch(self, token_ids: np.ndarray, positions: np.ndarray) -> None:
        """Token ids within the vocabulary, positions within the RoPE tables (max_seq_len)."""
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.spec.vocab_size):
            raise ValueError("token id out of range")
        if positions.size and positions.max() >= self.max_positions:
            raise ValueError(f"position {positions.max()} is past the engine's max_seq_len {self.max_positions}")
