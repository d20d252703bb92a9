"""`precast inspect`: what an engine is, without loading its weights."""

from __future__ import annotations

from collections import Counter

from precast.engine.directory import Engine

_READABLE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3", "U8": "uint8"}


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError


def _block_extras(m: dict) -> str:
    """What a family adds to the plain block: a mixture of experts, Gemma's norms, scales and caps."""
    extras = []
    if m.get("num_experts"):
        shared = f", shared expert of {m['shared_expert_intermediate_size']}" if m.get("shared_expert_intermediate_size") else ""
        renorm = " renormalised" if m.get("moe_renormalize") else ""
        extras.append(
            f"mixture of {m['num_experts']} experts of {m['moe_intermediate_size']} in {len(m['moe_layers'])} layers, "
            f"top {m['experts_per_token']}{renorm}{shared}"
        )
    if m.get("sandwich_norms"):
        extras.append("sandwich norms")
    if m.get("embedding_multiplier", 1.0) != 1.0:
        extras.append(f"embeddings x {m['embedding_multiplier']:g}")
    if m.get("query_scale"):
        extras.append(f"scores x {m['query_scale']:g}")
    for key, what in (("attn_logit_softcap", "scores"), ("final_logit_softcap", "logits")):
        if m.get(key):
            extras.append(f"{what} soft-capped at {m[key]:g}")
    return "; " + ", ".join(extras) if extras else ""


def engine_summary(engine: Engine) -> dict[str, object]:
    """The facts `inspect` prints, as data (also used by tests and `--json`)."""
    cfg = engine.config
    spec = cfg.model
    params = spec.num_parameters()  # the model's, whatever the storage (4-bit formats pack two per byte)
    by_dtype: Counter[str] = Counter()
    for t in engine.weights.tensors.values():
        by_dtype[_READABLE.get(t.dtype, t.dtype)] += t.nbytes
    return {
        "path": str(engine.path),
        "architecture": spec.architecture,
        "parameters": params,
        "active_parameters": spec.num_parameters(active=True),  # per token: a mixture's routed experts only
        "bytes_by_dtype": dict(by_dtype),
        "model": spec.to_dict(),
        "dtype": cfg.dtype,
        "quant": cfg.quant.to_dict(),
        "limits": cfg.limits.to_dict(),
        "targets": sorted(cfg.targets),
        "tensorrt": cfg.targets.get("tensorrt") or None,
        "tokenizer": None
        if cfg.tokenizer is None
        else {k: v for k, v in cfg.tokenizer.items() if k != "chat_template"}
        | {"chat_template": cfg.tokenizer.get("chat_template") is not None},
        "generation": cfg.generation,
        "provenance": cfg.provenance,
    }


def _layer_format(entry: dict) -> str:
    if entry.get("input_scales") == "dynamic":
        return f"{entry['format']} (per-token inputs)"
    if entry["format"] == "int4":
        return f"int4 ({'asymmetric' if entry.get('asymmetric') else 'symmetric'}, groups of {entry['group_size']})"
    return entry["format"]


def _quant_line(quant: dict, limits: dict) -> str:
    kv = f"KV cache {limits['kv_cache_dtype']}"
    if quant["recipe"] == "none":
        return f"none, {kv}"
    # fp8 layers with per-token activation scales show as "fp8 (per-token inputs)", int4 layers with offsets as
    # "int4 (asymmetric, groups of 128)"
    formats = Counter(_layer_format(entry) for entry in quant.get("layers", {}).values())
    parts = [
        quant["recipe"],
        ", ".join(f"{n} layers {f}" for f, n in sorted(formats.items())),
        f"LM head {'quantized' if quant.get('lm_head') else 'not quantized'}",
        kv,
    ]
    if quant.get("exclude"):
        parts.append(f"excluded {', '.join(quant['exclude'])}")
    calib = quant.get("calibration")
    if calib:
        parts.append(f"calibrated on {calib['tokens']} tokens ({calib['source']})")
    return "; ".join(parts)


def format_summary(s: dict[str, object]) -> str:
    m = s["model"]
    assert isinstance(m, dict)
    rope = m["rope_scaling"]["rope_type"] if m["rope_scaling"] else "default"
    window = f"{m['sliding_window']} tokens on {len(m['sliding_window_layers'])} layers" if m["sliding_window"] else "none"
    lines = [
        f"engine         {s['path']}",
        f"architecture   {s['architecture']}",
        f"parameters     {s['parameters']:,}"
        + (f" ({s['active_parameters']:,} active per token)" if s["active_parameters"] != s["parameters"] else ""),
        f"shape          {m['num_layers']} layers, hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, "
        f"vocab {m['vocab_size']}",
        f"attention      {m['num_heads']} heads, {m['num_kv_heads']} kv heads, head_dim {m['head_dim']}, "
        f"qkv bias {m['qkv_bias']}, qk-norm {m['qk_norm']}, sliding window {window}",
        f"mlp            gated {m['activation']}" + _block_extras(m),
        f"rope           theta {m['rope_theta']:g}, scaling {rope}, context {m['max_position_embeddings']}"
        + (f"; sliding layers theta {m['local_rope_theta']:g}" if m.get("local_rope_theta") else ""),
        f"tied embedding {m['tie_word_embeddings']}",
        f"dtype          {s['dtype']} (layers not quantized)",
        f"quant          {_quant_line(s['quant'], s['limits'])}",  # type: ignore[arg-type]
        "weights        " + ", ".join(f"{dt}: {_size(b)}" for dt, b in sorted(s["bytes_by_dtype"].items())),  # type: ignore[union-attr]
        "limits         " + ", ".join(f"{k} {v}" for k, v in s["limits"].items()),  # type: ignore[union-attr]
        f"targets        {', '.join(s['targets'])}",  # type: ignore[arg-type]
    ]
    trt = s.get("tensorrt")
    if isinstance(trt, dict):
        ccs = trt["compute_capabilities"]
        lines.append(
            f"tensorrt plan  {trt['plan']}, {_size(trt['plan_bytes'])}, by {trt['builder']} {trt['builder_version']} for "
            f"{', '.join(ccs) if isinstance(ccs, list) else ccs}; activations {trt['activation_dtype']} (GPU-only)"
        )
    tok = s["tokenizer"]
    if tok is None:
        lines.append("tokenizer      none (token ids in and out)")
    else:
        assert isinstance(tok, dict)
        lines.append(
            f"tokenizer      {', '.join(tok['files'])}; bos {tok['bos_token_id']}, eos {tok['eos_token_ids']}, "
            f"chat template {'yes' if tok['chat_template'] else 'no'}"
        )
    gen = s["generation"]
    assert isinstance(gen, dict)
    shown = ", ".join(f"{k} {v}" for k, v in gen.items()) or "none"
    lines.append(f"sampling       defaults for unset fields: {shown}")
    prov = s["provenance"]
    assert isinstance(prov, dict)
    lines.append(f"source         {prov['source']} ({prov['source_format']}, sha256 {prov['source_sha256'][:16]}...)")
    lines.append(f"built          {prov['built_at']} by precast {prov['precast_version']}")
    return "\n".join(lines)
