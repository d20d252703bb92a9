"""Triton request translation: input tensors -> (prompt, SamplingParams, flags), outputs -> output tensors.

Names, data types and shapes follow tensorrtllm_backend's ensemble and tensorrt_llm models: text level
(`text_input` -> `text_output`) and token level (`input_ids` -> `output_ids`, `sequence_length`), with
`output_log_probs`, `cum_log_probs`, `batch_index`, `sequence_index`; the sampling inputs are SamplingParams'
schema (runtime/sampling_params.py), under tensorrtllm_backend's names too (`random_seed`, `min_length`, ...).
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils  # provided by Triton's python backend stub
except ImportError:  # imported outside Triton (config generation, tests)
    pb_utils = None

from precast.errors import PrecastError
from precast.runtime.sampling_params import SamplingParams, field_type, knobs

DEFAULT_MAX_TOKENS = 64


def sampling_inputs() -> list[tuple[Any, str, str]]:
    """(SamplingParams field, Triton input name, Triton data type) of every sampling input (the schema's)."""
    return [(f, name, k.triton) for f, k in knobs().items() if k.triton for name in (k.triton_names or (f.name,))]


# tensorrtllm_backend's ensemble / tensorrt_llm inputs besides the sampling ones, (name, data type, dims), so a client
# written for a TensorRT-LLM ensemble runs unchanged. How each is honoured: parse_request.
COMPAT_INPUTS = [
    ("pad_id", "TYPE_INT32", "[ 1 ]"),
    ("beam_width", "TYPE_INT32", "[ 1 ]"),
    ("num_return_sequences", "TYPE_INT32", "[ 1 ]"),
    ("length_penalty", "TYPE_FP32", "[ 1 ]"),
    ("return_context_logits", "TYPE_BOOL", "[ 1 ]"),
    ("return_generation_logits", "TYPE_BOOL", "[ 1 ]"),
    ("return_perf_metrics", "TYPE_BOOL", "[ 1 ]"),
    ("embedding_bias_words", "TYPE_STRING", "[ -1 ]"),
    ("embedding_bias_weights", "TYPE_FP32", "[ -1 ]"),
    ("guided_decoding_guide_type", "TYPE_STRING", "[ 1 ]"),
    ("guided_decoding_guide", "TYPE_STRING", "[ 1 ]"),
    ("prompt_embedding_table", "TYPE_FP16", "[ -1, -1 ]"),
    ("prompt_table_extra_id", "TYPE_UINT64", "[ 1 ]"),
    ("prompt_vocab_size", "TYPE_INT32", "[ 1 ]"),
    ("lora_task_id", "TYPE_UINT64", "[ 1 ]"),
    ("lora_weights", "TYPE_FP16", "[ -1, -1 ]"),
    ("lora_config", "TYPE_INT32", "[ -1, 3 ]"),
]
# Present at all, these are refused: precast has no prompt tables or LoRA adapters.
REFUSED_INPUTS = {
    "prompt_embedding_table": "prompt tables (p-tuning)",
    "prompt_table_extra_id": "prompt tables (p-tuning)",
    "prompt_vocab_size": "prompt tables (p-tuning)",
    "lora_task_id": "LoRA adapters",
    "lora_weights": "LoRA adapters",
    "lora_config": "LoRA adapters",
}
# True, these are refused: precast returns no logits tensors and no per-request performance metrics.
REFUSED_FLAGS = ("return_context_logits", "return_generation_logits", "return_perf_metrics")
# guided_decoding_guide_type -> SamplingParams output-format field (tensorrtllm_backend's four kinds)
GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "grammar"}


def get_input(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def one_request(get: Any) -> Any:
    """`get` without the batch dimension. The model declares max_batch_size > 0, as tensorrtllm_backend's do, so
    clients send [1, ...] tensors; each Triton request is one prompt (precast batches requests in flight itself)."""

    def unbatched(name: str) -> np.ndarray | None:
        array = get(name)
        if array is None:
            return None
        if array.ndim == 0 or array.shape[0] != 1:
            raise PrecastError(
                f"input {name} has shape {list(array.shape)}: send one prompt per request, batch dimension 1 "
                "(precast batches concurrent requests in flight)"
            )
        return array[0]

    return unbatched


def scalar(array: np.ndarray | None) -> Any:
    return None if array is None or array.size == 0 else array.reshape(-1)[0]


def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    values = (v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))
    return [s for s in values if s]


def parse_request(get: Any, tokenizer: Any) -> tuple[list[int] | str, SamplingParams, dict[str, bool]]:
    """Turn a request's input tensors (via `get(name) -> array | None`, batch dimension included) into a prompt
    and SamplingParams; inputs precast cannot honour are refused with a message naming them."""
    get = one_request(get)
    text = get("text_input")
    ids = get("input_ids")
    if text is None and ids is None:
        raise PrecastError("the request needs text_input (text) or input_ids (token ids)")
    for name, what in REFUSED_INPUTS.items():
        if get(name) is not None:
            raise PrecastError(f"input {name} is not supported: precast has no {what}")
    for name in REFUSED_FLAGS:
        if bool(scalar(get(name))):
            raise PrecastError(f"{name}=true is not supported by precast's Triton model; leave it false")
    for name in ("beam_width", "num_return_sequences"):
        value = scalar(get(name))
        if value is not None and int(value) != 1:
            raise PrecastError(f"{name}={int(value)} is not supported: precast returns one sequence per request (send several requests)")
    if ids is not None:
        flat = ids.reshape(-1).astype(np.int64)
        length = scalar(get("input_lengths"))
        prompt: list[int] | str = flat[: int(length)].tolist() if length is not None else flat.tolist()
    else:
        value = scalar(text)
        prompt = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0)
    for f, name, _ in sampling_inputs():
        if field_type(f) == "list[str]":
            if get(name) is not None:
                setattr(params, f.name, _strings(get(name)))
            continue
        value = scalar(get(name))
        if value is not None:
            setattr(params, f.name, {"int": int, "float": float, "bool": bool}[field_type(f)](value))
    end_id = scalar(get("end_id"))
    if end_id is not None:
        params.stop_token_ids = [int(end_id)]
    params.logit_bias = _embedding_bias(get("embedding_bias_words"), get("embedding_bias_weights"), tokenizer)
    guide_type, guide = scalar(get("guided_decoding_guide_type")), scalar(get("guided_decoding_guide"))
    if guide_type is not None:
        kind = guide_type.decode() if isinstance(guide_type, bytes) else str(guide_type)
        if kind not in GUIDE_TYPES:
            raise PrecastError(f"guided_decoding_guide_type {kind!r} is not one of {', '.join(GUIDE_TYPES)}")
        text_guide = guide.decode() if isinstance(guide, bytes) else guide
        if kind != "json" and not text_guide:
            raise PrecastError(f"guided_decoding_guide_type {kind!r} needs guided_decoding_guide")
        setattr(params, GUIDE_TYPES[kind], True if kind == "json" else text_guide)
    flags = {
        "stream": bool(scalar(get("stream")) or scalar(get("streaming")) or False),
        "exclude_input": bool(scalar(get("exclude_input_in_output")) if get("exclude_input_in_output") is not None else True),
        "log_probs": bool(scalar(get("return_log_probs")) or False),
        "token_level": ids is not None,
    }
    if flags["log_probs"]:
        params.logprobs = 0
    if not isinstance(prompt, str) and tokenizer is None and params.stop:
        raise PrecastError("stop_words need a tokenizer")
    return prompt, params, flags


def _embedding_bias(words: np.ndarray | None, weights: np.ndarray | None, tokenizer: Any) -> dict[int, float] | None:
    """tensorrtllm_backend's embedding bias: each word's weight added to every token of the word."""
    if words is None and weights is None:
        return None
    words_list = [w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in (words.reshape(-1) if words is not None else [])]
    weight_list = [float(w) for w in (weights.reshape(-1) if weights is not None else [])]
    if len(words_list) != len(weight_list):
        raise PrecastError(f"embedding_bias_words has {len(words_list)} words but embedding_bias_weights {len(weight_list)} weights")
    if tokenizer is None and words_list:
        raise PrecastError("embedding_bias_words need the engine's tokenizer")
    bias: dict[int, float] = {}
    for word, weight in zip(words_list, weight_list):
        for token in tokenizer.encode(word, add_special_tokens=False) if word else []:
            bias[token] = bias.get(token, 0.0) + weight
    return bias or None


def output_tensors(out: Any, flags: dict[str, bool], prompt_ids: list[int], cumulative_text: str) -> list[Any]:
    """The response's tensors in tensorrtllm_backend's shapes: [batch 1, ...] with beam / sequence 1 where it has one."""
    tensors = []
    if flags["token_level"]:
        ids = out.delta_token_ids if flags["stream"] else out.token_ids
        if not flags["exclude_input"] and not flags["stream"]:
            ids = prompt_ids + ids
        tensors.append(pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)))
        tensors.append(pb_utils.Tensor("sequence_length", np.asarray([[len(ids)]], dtype=np.int32)))
    else:
        text = out.delta if flags["stream"] else cumulative_text
        tensors.append(pb_utils.Tensor("text_output", np.asarray([[text.encode("utf-8")]], dtype=np.object_)))
    # Streaming: the log-probs of this response's new tokens; otherwise all of them. cum_log_probs sums all so far.
    new = len(out.delta_token_ids)
    lps = ((out.logprobs[-new:] if new else []) if flags["stream"] else out.logprobs) if flags["log_probs"] else []
    tensors.append(pb_utils.Tensor("output_log_probs", np.asarray(lps, dtype=np.float32).reshape(1, 1, -1)))
    total = float(np.sum(out.logprobs, dtype=np.float64)) if flags["log_probs"] else 0.0
    tensors.append(pb_utils.Tensor("cum_log_probs", np.asarray([[total]], dtype=np.float32)))
    tensors.append(pb_utils.Tensor("batch_index", np.zeros((1, 1), dtype=np.int32)))
    tensors.append(pb_utils.Tensor("sequence_index", np.zeros((1, 1), dtype=np.int32)))
    rate = out.num_accepted_draft_tokens / out.num_draft_tokens if out.num_draft_tokens else 0.0
    tensors.append(pb_utils.Tensor("acceptance_rate", np.asarray([[rate]], dtype=np.float32)))
    tensors.append(pb_utils.Tensor("total_accepted_draft_tokens", np.asarray([[out.num_accepted_draft_tokens]], dtype=np.int32)))
    tensors.append(pb_utils.Tensor("total_draft_tokens", np.asarray([[out.num_draft_tokens]], dtype=np.int32)))
    return tensors
