"""Writing small GGUF files with chosen quantization types, for reader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# f16 scale fields inside each block (byte offsets), per type; the rest of a block is
# quantized payload, where any byte pattern is valid.
_SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_quantized(qtype_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid raw blocks of `qtype_name` for a [rows, cols] matrix, as uint8 [rows, bytes]."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block_elems == 0
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype_name]:
        scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block_elems)).astype(np.float16)
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_llama_gguf(
    path: Path,
    types: dict[str, str],
    seed: int = 0,
    tied: bool = False,
    rope_freqs: np.ndarray | None = None,
    sentencepiece: tuple[list[str], list[float], list[int]] | None = None,
) -> None:
    """A 2-layer llama GGUF (hidden 256, 4 heads, 2 kv heads, head_dim 64, vocab 256, ffn 512)
    whose tensors use the given types (by GGUF name suffix; default F32), with a byte-level
    tokenizer of 256 single-character tokens; `rope_freqs`: llama.cpp's RoPE divisors tensor (32 values);
    `sentencepiece`: (tokens, scores, token types) of a SentencePiece ("llama") vocabulary instead, no merges
    (as llama.cpp writes them; the vocabulary size follows it)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, ffn, vocab, layers = 256, 4, 2, 512, 256, 2
    if sentencepiece is not None:
        vocab = len(sentencepiece[0])
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    if sentencepiece is not None:
        tokens, scores, token_types = sentencepiece
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        from precast.builder.checkpoint.gguf_tokenizer import _bytes_to_unicode

        letters = list(_bytes_to_unicode().values())
        w.add_token_list(letters)
        w.add_token_types([1] * vocab)
        w.add_token_merges([])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)

    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (hidden,),
                f"blk.{i}.ffn_norm.weight": (hidden,),
                f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
                f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                f"blk.{i}.attn_output.weight": (hidden, hidden),
                f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                f"blk.{i}.ffn_up.weight": (ffn, hidden),
                f"blk.{i}.ffn_down.weight": (hidden, ffn),
            }
        )
    for name, shape in shapes.items():
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        qtype = types.get(suffix, "F32") if len(shape) == 2 else "F32"
        if qtype == "F32":
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
        elif qtype == "BF16":
            bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            w.add_tensor(name, bits.view(np.uint8).reshape(shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            raw = random_quantized(qtype, *shape, rng)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_float32_tensors(writer, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` as F32 and write the file out (header, metadata, tensors), closing the writer."""
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gemma_gguf(path: Path, arch: str, vocabulary: tuple[list[str], list[float], list[int]], seed: int = 0) -> None:
    """A Gemma 2 (2 layers) or Gemma 3 (6 layers: the sixth global) GGUF as llama.cpp exports one: hidden 64, 2 heads,
    1 KV head of head_dim 256 (so llama.cpp's and transformers' default query scale agree), ffn 128, tied
    embeddings, four norms per layer stored as 1 + w, no Q/K row permutation, a SentencePiece vocabulary."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, scores, token_types = vocabulary
    hidden, heads, kv_heads, head_dim, ffn, vocab = 64, 2, 1, 256, 128, len(tokens)
    layers = 2 if arch == "gemma2" else 6
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(8)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    else:
        w.add_rope_freq_base(1000000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    tensors = {"token_embd.weight": rng.standard_normal((vocab, hidden)), "output_norm.weight": 1 + 0.5 * rng.standard_normal(hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensors[p + norm + ".weight"] = 1 + 0.5 * rng.standard_normal(hidden)
        if arch == "gemma3":
            tensors[p + "attn_q_norm.weight"] = 1 + 0.5 * rng.standard_normal(head_dim)
            tensors[p + "attn_k_norm.weight"] = 1 + 0.5 * rng.standard_normal(head_dim)
        tensors[p + "attn_q.weight"] = rng.standard_normal((heads * head_dim, hidden)) * 0.2
        tensors[p + "attn_k.weight"] = rng.standard_normal((kv_heads * head_dim, hidden)) * 0.2
        tensors[p + "attn_v.weight"] = rng.standard_normal((kv_heads * head_dim, hidden)) * 0.2
        tensors[p + "attn_output.weight"] = rng.standard_normal((hidden, heads * head_dim)) * 0.2
        tensors[p + "ffn_gate.weight"] = rng.standard_normal((ffn, hidden)) * 0.2
        tensors[p + "ffn_up.weight"] = rng.standard_normal((ffn, hidden)) * 0.2
        tensors[p + "ffn_down.weight"] = rng.standard_normal((hidden, ffn)) * 0.2
    write_float32_tensors(w, tensors)


def write_moe_gguf_from_hf(hf_dir: Path, path: Path, expert_type: str = "F32") -> None:
    """A tiny HF mixture-of-experts checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE) rewritten in llama.cpp's GGUF layout:
    Mixtral as `llama` with experts and Q/K rows permuted, the Qwens as qwen2moe / qwen3moe; each layer's experts
    stacked into ffn_{gate,up,down}_exps [experts, rows, cols] (stored as `expert_type`), the router as ffn_gate_inp,
    Qwen2-MoE's shared expert as ffn_*_shexp with its gate a vector; no tokenizer."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(hf_dir / "model.safetensors")
    model_type = config["model_type"]
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[model_type]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    experts = config.get("num_local_experts") or config["num_experts"]
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(config["num_experts_per_tok"])
    if model_type != "mixtral":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])

    def permute(rows: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's Q/K row order for the `llama` architecture
        return rows.reshape(n, 2, rows.shape[0] // n // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    block, (gate, up, down) = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if model_type == "mixtral" else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    for i in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        out[b + "attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[b + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        for kind, n in (("q", heads), ("k", kv_heads)):
            rows = hf[f"{a}{kind}_proj.weight"]
            out[f"{b}attn_{kind}.weight"] = permute(rows, n) if arch == "llama" else rows
            if f"{a}{kind}_proj.bias" in hf:
                out[f"{b}attn_{kind}.bias"] = hf[f"{a}{kind}_proj.bias"]
            if f"{a}{kind}_norm.weight" in hf:
                out[f"{b}attn_{kind}_norm.weight"] = hf[f"{a}{kind}_norm.weight"]
        out[b + "attn_v.weight"] = hf[a + "v_proj.weight"]
        if a + "v_proj.bias" in hf:
            out[b + "attn_v.bias"] = hf[a + "v_proj.bias"]
        out[b + "attn_output.weight"] = hf[a + "o_proj.weight"]
        if f"{p}{block}.gate.weight" not in hf:  # a dense layer (Qwen's mlp_only_layers / decoder_sparse_step)
            for kind in ("gate", "up", "down"):
                out[f"{b}ffn_{kind}.weight"] = hf[f"{p}mlp.{kind}_proj.weight"]
            continue
        out[b + "ffn_gate_inp.weight"] = hf[f"{p}{block}.gate.weight"]
        for gguf_name, hf_name in (("gate", gate), ("up", up), ("down", down)):
            out[f"{b}ffn_{gguf_name}_exps.weight"] = np.stack([hf[f"{p}{block}.experts.{e}.{hf_name}.weight"] for e in range(experts)])
        if model_type == "qwen2_moe":
            for kind in ("gate", "up", "down"):
                out[f"{b}ffn_{kind}_shexp.weight"] = hf[f"{p}mlp.shared_expert.{kind}_proj.weight"]
            out[b + "ffn_gate_inp_shexp.weight"] = hf[p + "mlp.shared_expert_gate.weight"].reshape(-1)
    rng = np.random.default_rng(0)
    for name in [n for n in out if "_exps" in n and expert_type != "F32"]:  # random blocks of that type instead
        array = out.pop(name)
        raw = random_quantized(expert_type, array.shape[0] * array.shape[1], array.shape[2], rng)
        w.add_tensor(name, raw.reshape(array.shape[0], array.shape[1], -1), raw_dtype=gguf.GGMLQuantizationType[expert_type])
    write_float32_tensors(w, out)


def write_phi3_gguf_from_hf(hf_dir: Path, path: Path) -> None:
    """A tiny HF Phi-3 / Phi-4-mini checkpoint in llama.cpp's `phi3` layout: attn_qkv and ffn_up (gate|up) fused,
    Q/K rows as HF keeps them, the rotated dimensions as rope.dimension_count (partial rotary), LongRoPE's factors as
    the rope_factors_long / rope_factors_short tensors with the original context in the metadata; no tokenizer."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(hf_dir / "model.safetensors")
    rope = config["rope_parameters"]
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    w = gguf.GGUFWriter(path, "phi3")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[b + "attn_qkv.weight"] = hf[p + "self_attn.qkv_proj.weight"]
        out[b + "attn_output.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[b + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[b + "ffn_up.weight"] = hf[p + "mlp.gate_up_proj.weight"]
        out[b + "ffn_down.weight"] = hf[p + "mlp.down_proj.weight"]
    write_float32_tensors(w, out)
