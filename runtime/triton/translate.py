"""Triton request translation: input tensors -> (prompt, SamplingParams, flags), outputs -> output tensors.

Names follow tensorrtllm_backend's: text level (`text_input` -> `text_output`, `output_log_probs`) and
token level (`input_ids` -> `output_ids`, `sequence_length`); the sampling inputs are SamplingParams'
schema (runtime/sampling_params.py).
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


def get_input(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def scalar(array: np.ndarray | None) -> Any:
    return None if array is None or array.size == 0 else array.reshape(-1)[0]


def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    values = (v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))
    return [s for s in values if s]


def parse_request(get: Any, tokenizer: Any) -> tuple[list[int] | str, SamplingParams, dict[str, bool]]:
    """Turn a request's input tensors (via `get(name) -> array | None`) into a prompt and SamplingParams."""
    text = get("text_input")
    ids = get("input_ids")
    if text is None and ids is None:
        raise PrecastError("the request needs text_input (text) or input_ids (token ids)")
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
            setattr(params, f.name, {"int": int, "float": float}[field_type(f)](value))
    end_id = scalar(get("end_id"))
    if end_id is not None:
        params.stop_token_ids = [int(end_id)]
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


def output_tensors(out: Any, flags: dict[str, bool], prompt_ids: list[int], cumulative_text: str) -> list[Any]:
    tensors = []
    if flags["token_level"]:
        ids = out.delta_token_ids if flags["stream"] else out.token_ids
        if not flags["exclude_input"] and not flags["stream"]:
            ids = prompt_ids + ids
        tensors.append(pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32)))
        tensors.append(pb_utils.Tensor("sequence_length", np.asarray([len(ids)], dtype=np.int32)))
    else:
        text = out.delta if flags["stream"] else cumulative_text
        tensors.append(pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_)))
    if flags["log_probs"]:
        # Streaming: the log-probs of this response's new tokens; otherwise all of them.
        new = len(out.delta_token_ids)
        lps = (out.logprobs[-new:] if new else []) if flags["stream"] else out.logprobs
        tensors.append(pb_utils.Tensor("output_log_probs", np.asarray(lps, dtype=np.float32)))
    return tensors
