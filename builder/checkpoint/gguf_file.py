"""GGUF files (llama.cpp's format) read as if they were Hugging Face checkpoints.

Three translations make a GGUF look like the HF checkpoint it came from:
- metadata keys (`llama.block_count`, ...) become an HF config dict;
- tensor names (`blk.3.attn_q.weight`) become HF names, through a table with a strict
  leftover check (the layout is read by gguf_layout.py), and each tensor is dequantized on request (the `gguf` package's numpy
  kernels: Q4_0, Q4_1, Q8_0, the K-quants, F16, BF16, F32 and more); a mixture of experts' stacked expert tensors
  (`blk.3.ffn_gate_exps.weight`, [experts, rows, cols]) become one HF tensor per expert, each read on its own;
- llama.cpp's converter reorders the rows of Q and K for the `llama` architecture (it
  interleaves the two halves of each head for its rotary kernel); that is undone here. For Gemma it
  stores RMSNorm weights as 1 + w (its norm multiplies by them directly); 1 is taken off again.
The tokenizer is rebuilt by `gguf_tokenizer.py`.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from precast.builder.checkpoint.base import Checkpoint, TokenizerFiles
from precast.builder.checkpoint.gguf_layout import GGUFTensor, read_gguf_layout
from precast.builder.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from precast.errors import PrecastError

# GGUF architecture name -> the HF model_type and class it corresponds to.
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
# llama.cpp exports Mixtral as `llama` with experts (llama.expert_count > 0).
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
# Whether llama.cpp renormalises the chosen experts' probabilities, per family (files may say, expert_weights_norm).
_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_GEMMA = {"gemma2", "gemma3"}

# Architectures whose GGUF conversion permuted the rows of Q and K (llama.cpp's `llama` rotary layout).
_PERMUTED_QK = {"llama", "mistral"}

# `{arch}.` metadata key -> HF config key.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}

# GGUF tensor name -> HF tensor name. `{i}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 2/3 have four norms per layer; llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Mixtures of experts: the router, llama.cpp's stacked experts ([experts, rows, cols], one HF tensor per expert:
# `{e}`), and Qwen2-MoE's shared expert with its gate (a vector in GGUF, [1, hidden] in HF).
_QWEN_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_MIXTRAL_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
}
# Phi-3 keeps q|k|v and gate|up fused, as its HF checkpoints do (ffn_up is the fused gate|up).
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Tensors that carry RoPE parameters, not weights: llama3's frequency divisors, Phi-3's LongRoPE factors.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _layer_names(arch: str, experts: bool) -> dict[str, str]:
    if arch in _GEMMA:
        return _GEMMA_LAYER_NAMES
    if arch == "phi3":
        return _PHI3_LAYER_NAMES
    if arch in ("qwen2moe", "qwen3moe"):
        return _QWEN_MOE_LAYER_NAMES
    return _MIXTRAL_LAYER_NAMES if experts else _LAYER_NAMES


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    """The HF name of a GGUF tensor (with `{e}` left in for a stack of experts), or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def _expert_slice(t: GGUFTensor, expert: int) -> GGUFTensor:
    """Expert `expert` of a stacked [experts, rows, cols] tensor: its rows of the raw data (quantized blocks run
    along a row, so an expert's rows are whole blocks)."""
    rows = t.data.shape[0] // t.shape[-1]
    return GGUFTensor(t.name, t.shape[:-1], t.tensor_type, t.data[expert * rows : (expert + 1) * rows])


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation.

    Per head, HF keeps rows as [first half | second half] of the rotary pairs; llama.cpp
    stores them interleaved. Viewing the rows as (head, 2, half) in HF order means the
    GGUF order is (head, half, 2); swapping those two axes back restores HF order.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    format = "gguf"

    def __init__(self, path: Path) -> None:
        self.path = path
        layout = read_gguf_layout(path)
        self.metadata: dict[str, Any] = layout.metadata
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise PrecastError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
        self.gguf_architecture: str = arch
        rope = {t.name: t for t in layout.tensors if t.name in _ROPE_TENSORS}
        rope_freqs = rope.get("rope_freqs.weight")
        tensors = [t for t in layout.tensors if t.name not in _ROPE_TENSORS]
        gguf_names = [t.name for t in tensors]
        self.has_experts = bool(self.metadata.get(f"{arch}.expert_count"))  # a mixture of experts
        names = _layer_names(arch, self.has_experts)
        unknown = [n for n in gguf_names if _hf_name(n, names) is None]
        if unknown:
            raise PrecastError(f"{path}: tensors precast does not know how to map: {', '.join(unknown[:10])}")
        self._tensors: dict[str, GGUFTensor] = {}
        for t in tensors:
            name = _hf_name(t.name, names)
            if "{e}" not in name:
                self._tensors[name] = t
                continue
            if len(t.shape) != 3:
                raise PrecastError(
                    f"{path}: {t.name} should stack the experts' matrices [experts, rows, cols], its shape is {list(reversed(t.shape))}"
                )
            for e in range(int(t.shape[-1])):  # a view per expert: read() dequantizes only that expert's blocks
                self._tensors[name.format(e=e)] = _expert_slice(t, e)
        self.config = self._hf_config(set(gguf_names), tensors)
        if rope_freqs is not None:
            self.config["rope_scaling"] = self._llama3_scaling(rope_freqs)
        if "rope_factors_long.weight" in rope or "rope_factors_short.weight" in rope:
            self.config["rope_scaling"] = self._longrope_scaling(rope)

    def _llama3_scaling(self, rope_freqs: GGUFTensor) -> dict[str, Any]:
        """llama.cpp writes llama3 RoPE scaling as per-frequency divisors (rope_freqs.weight); the llama3
        parameters that give exactly those divisors, or a clear refusal."""
        from gguf import GGMLQuantizationType

        from precast.engine.rope import llama3_from_divisors

        if rope_freqs.tensor_type != GGMLQuantizationType.F32:
            raise PrecastError(f"{self.path}: rope_freqs.weight is {rope_freqs.tensor_type.name}, expected F32")
        c = self.config
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        arch = self.gguf_architecture
        # Only the ratios of the parameters matter; the original context sets their scale (Llama 3.1: 8192).
        original = int(self.metadata.get(f"{arch}.rope.scaling.original_context_length") or 8192)
        divisors = np.array(rope_freqs.data.view("<f4")).reshape(-1)
        params = llama3_from_divisors(divisors, float(c.get("rope_theta", 10000.0)), head_dim, original)
        if params is None:
            raise PrecastError(
                f"{self.path}: rope_freqs.weight holds RoPE frequency divisors that follow no llama3 scaling rule "
                "(precast supports llama3 scaling in this form only); build from the HF checkpoint instead"
            )
        return {"rope_type": "llama3", **params, "original_max_position_embeddings": original}

    def _longrope_scaling(self, rope: dict[str, GGUFTensor]) -> dict[str, Any]:
        """Phi-3's LongRoPE as llama.cpp writes it: per-frequency factors for short and long contexts as tensors, the
        original context and the attention factor in the metadata."""
        from gguf import GGMLQuantizationType

        arch, factors = self.gguf_architecture, {}
        for kind in ("long", "short"):
            t = rope.get(f"rope_factors_{kind}.weight")
            if t is None or t.tensor_type != GGMLQuantizationType.F32:
                raise PrecastError(f"{self.path}: LongRoPE needs both rope_factors_long and rope_factors_short as F32 tensors")
            factors[f"{kind}_factor"] = [float(v) for v in np.asarray(t.data).view("<f4").reshape(-1)]
        original = self.metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise PrecastError(f"{self.path}: LongRoPE factors without {arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
        if self.metadata.get(f"{arch}.rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(self.metadata[f"{arch}.rope.scaling.attn_factor"])
        return scaling

    def _hf_config(self, gguf_names: set[str], tensors: list[GGUFTensor]) -> dict[str, Any]:
        arch = self.gguf_architecture
        model_type, class_name = _MIXTRAL if arch == "llama" and self.has_experts else GGUF_ARCHITECTURES[arch]
        config: dict[str, Any] = {"model_type": model_type, "architectures": [class_name], "hidden_act": "silu"}
        for key, hf_key in _CONFIG_KEYS.items():
            if f"{arch}.{key}" in self.metadata:
                config[hf_key] = self.metadata[f"{arch}.{key}"]
        if self.has_experts:
            config.update(self._moe_config(gguf_names, int(config["num_hidden_layers"])))
        for required in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if required not in config:
                raise PrecastError(f"{self.path}: GGUF metadata lacks {arch}.{required}; the file is incomplete")
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        if "vocab_size" not in config:
            embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
            if embedding is None:
                raise PrecastError(f"{self.path}: GGUF has neither {arch}.vocab_size nor token_embd.weight")
            config["vocab_size"] = int(embedding.shape[-1])
        if "head_dim" not in config and f"{arch}.rope.dimension_count" in self.metadata and arch in _PERMUTED_QK:
            config["head_dim"] = self.metadata[f"{arch}.rope.dimension_count"]
        rotated = self.metadata.get(f"{arch}.rope.dimension_count")
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        if arch == "phi3" and rotated and int(rotated) != head_dim:  # Phi-4-mini rotates 3/4 of each head
            config["partial_rotary_factor"] = int(rotated) / head_dim
        scaling = self.metadata.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            rope: dict[str, Any] = {"rope_type": scaling, "factor": self.metadata.get(f"{arch}.rope.scaling.factor")}
            if f"{arch}.rope.scaling.original_context_length" in self.metadata:
                rope["original_max_position_embeddings"] = self.metadata[f"{arch}.rope.scaling.original_context_length"]
            config["rope_scaling"] = rope
        if "sliding_window" in config and model_type in ("qwen2", "qwen3"):
            config["use_sliding_window"] = True
        if arch in _GEMMA:
            config.update(self._gemma_config(config))
        config["tie_word_embeddings"] = "output.weight" not in gguf_names
        config["bos_token_id"] = self.metadata.get("tokenizer.ggml.bos_token_id")
        config["eos_token_id"] = self.metadata.get("tokenizer.ggml.eos_token_id")
        return config

    def _moe_config(self, gguf_names: set[str], num_layers: int) -> dict[str, Any]:
        """Routing as llama.cpp runs the family (softmax over the experts, top-k, renormalised for Mixtral and
        Qwen3-MoE unless the file says otherwise), and which layers are dense: those without a router. Other routing
        rules (sigmoid gating, expert groups, scaled weights) are refused, not approximated."""
        arch, meta = self.gguf_architecture, self.metadata
        gating = meta.get(f"{arch}.expert_gating_func")
        if gating not in (None, 1):  # llama.cpp's enum: 1 softmax, 2 sigmoid
            raise PrecastError(
                f"{self.path}: expert gating function {gating} (not softmax) is not supported; precast routes by softmax top-k"
            )
        if (meta.get(f"{arch}.expert_group_count") or 1) > 1 or (meta.get(f"{arch}.expert_weights_scale") or 1.0) != 1.0:
            raise PrecastError(f"{self.path}: grouped or scaled expert routing is not supported; precast routes by softmax top-k")
        renormalize = bool(meta.get(f"{arch}.expert_weights_norm", _RENORMALIZE.get(arch, False)))
        if arch == "llama" and not renormalize:
            raise PrecastError(
                f"{self.path}: a Mixtral-style GGUF whose experts' weights are not renormalised; precast builds Mixtral's routing only"
            )
        dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf_names]
        if dense and arch == "llama":
            raise PrecastError(f"{self.path}: layers {dense} have no experts; a Mixtral-style model routes every layer")
        return {"norm_topk_prob": renormalize, "mlp_only_layers": dense}

    def _gemma_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp's Gemma exports leave out, as llama.cpp itself runs them: GELU-tanh; queries scaled by
        head_dim^-0.5, except the 27B models (46 layers for Gemma 2, 62 for Gemma 3), scaled by (hidden / heads)^-0.5;
        Gemma 3: every sixth layer global (unless the file says), the others sliding with RoPE base 10000."""
        arch, layers = self.gguf_architecture, int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        big = layers == (46 if arch == "gemma2" else 62)
        extra: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else head_dim,
        }
        if arch == "gemma3":  # Gemma 2: soft-capping values are in the metadata (absent: 50 and 30, as both assume)
            extra.update(rope_local_base_freq=10000.0, sliding_window_pattern=6)
            pattern = self.metadata.get(f"{arch}.attention.sliding_window_pattern")
            if isinstance(pattern, int):
                extra["sliding_window_pattern"] = pattern
            elif pattern is not None:  # one flag per layer: True slides
                extra["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        return extra

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims fastest first
        return (1, *shape) if name.endswith("shared_expert_gate.weight") else shape  # a vector in GGUF

    def tensor_dtype(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def read(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._tensors[name]
        shape = self.tensor_shape(name)
        try:
            if t.tensor_type == GGMLQuantizationType.F32:
                w = np.array(t.data.view("<f4"))
            elif t.tensor_type == GGMLQuantizationType.F16:
                w = np.array(t.data.view("<f2"))
            else:
                w = dequantize(np.asarray(t.data), t.tensor_type)
            w = w.reshape(shape)
        except NotImplementedError as e:
            raise PrecastError(f"{self.path}: tensor {t.name} uses {t.tensor_type.name}, which cannot be dequantized ({e})") from e
        except ValueError as e:
            raise PrecastError(f"{self.path}: tensor {t.name} data does not match its shape {list(shape)}; the file may be corrupt") from e
        if self.gguf_architecture in _GEMMA and name.endswith("norm.weight"):
            w = w.astype(np.float32) - np.float32(1.0)
        if self.gguf_architecture in _PERMUTED_QK:
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                w = _unpermute_rows(w, self.config["num_attention_heads"])
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                w = _unpermute_rows(w, self.config["num_key_value_heads"])
        return w

    def tokenizer(self) -> TokenizerFiles | None:
        if "tokenizer.ggml.model" not in self.metadata:
            return None
        return tokenizer_from_gguf(self.metadata, str(self.path))

    def digest(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()
