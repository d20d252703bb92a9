"""The Triton python-backend model: one precast LLM per model instance, fed by every Triton request.

Triton calls `execute` as a coroutine (the python backend's async execute), so concurrent
Triton requests are all in flight in one executor at once: in-flight batching, not
Triton's dynamic batcher. In decoupled mode each request streams its responses through
its response sender and `execute` returns at once; otherwise `execute` awaits its
requests and returns one response each. A request ends early when its client cancels it
(Triton marks it cancelled) or when a request carrying `stop=true` and the same request
id arrives.

Inputs and outputs follow tensorrtllm_backend's names: text level (`text_input` ->
`text_output`, `output_log_probs`) and token level (`input_ids` -> `output_ids`,
`sequence_length`). Every input except one of `text_input` / `input_ids` is optional.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils  # provided by Triton's python backend stub
except ImportError:  # imported outside Triton (docs, tests of the helpers below)
    pb_utils = None

from precast.errors import PrecastError
from precast.runtime.llm import LLM
from precast.runtime.sampling_params import SamplingParams, field_type, knobs

DEFAULT_MAX_TOKENS = 64
_CANCEL_POLL_S = 0.05


def sampling_inputs() -> list[tuple[Any, str, str]]:
    """(SamplingParams field, Triton input name, Triton data type) of every sampling input (the schema's)."""
    return [(f, name, k.triton) for f, k in knobs().items() if k.triton for name in (k.triton_names or (f.name,))]


def _get(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(array: np.ndarray | None) -> Any:
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
        length = _scalar(get("input_lengths"))
        prompt: list[int] | str = flat[: int(length)].tolist() if length is not None else flat.tolist()
    else:
        value = _scalar(text)
        prompt = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0)
    for f, name, _ in sampling_inputs():
        if field_type(f) == "list[str]":
            if get(name) is not None:
                setattr(params, f.name, _strings(get(name)))
            continue
        value = _scalar(get(name))
        if value is not None:
            setattr(params, f.name, {"int": int, "float": float}[field_type(f)](value))
    end_id = _scalar(get("end_id"))
    if end_id is not None:
        params.stop_token_ids = [int(end_id)]
    flags = {
        "stream": bool(_scalar(get("stream")) or _scalar(get("streaming")) or False),
        "exclude_input": bool(_scalar(get("exclude_input_in_output")) if get("exclude_input_in_output") is not None else True),
        "log_probs": bool(_scalar(get("return_log_probs")) or False),
        "token_level": ids is not None,
    }
    if flags["log_probs"]:
        params.logprobs = 0
    if not isinstance(prompt, str) and tokenizer is None and params.stop:
        raise PrecastError("stop_words need a tokenizer")
    return prompt, params, flags


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        kv = p.get("kv_cache_memory", "")
        self.llm = LLM(
            p["engine_dir"],
            kv_cache_memory=int(kv) if kv.strip() else None,
            chunked_prefill=p.get("enable_chunked_prefill", "true").lower() == "true",
            prefix_reuse=p.get("enable_kv_cache_reuse", "true").lower() == "true",
            num_threads=int(p["num_threads"]) if p.get("num_threads", "").strip() else None,
        )
        self.by_triton_id: dict[str, int] = {}  # Triton request id -> precast request id, while in flight
        self.stopped: set[str] = set()  # Triton request ids ended by a `stop` request
        self._metrics = _Metrics(config["name"])
        self._metrics_task: asyncio.Task | None = None

    # ---- one request -----------------------------------------------------------------
    def _outputs(self, out: Any, flags: dict[str, bool], prompt_ids: list[int], cumulative_text: str) -> list[Any]:
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

    async def _serve_one(self, request: Any) -> Any | None:
        """Run one request. Decoupled: stream through its sender, return None. Else return its response."""
        sender = request.get_response_sender() if self.decoupled else None
        triton_id = request.request_id()
        try:
            if bool(_scalar(_get(request, "stop"))):
                # A stop request ends the in-flight request with the same id and answers empty.
                if triton_id in self.by_triton_id:
                    self.stopped.add(triton_id)
                    self.llm.cancel(self.by_triton_id[triton_id])
                return self._finish(sender, None)
            prompt, params, flags = parse_request(lambda n: _get(request, n), self.llm.tokenizer)
            flags["stream"] = flags["stream"] and self.decoupled
            prompt_ids = self.llm.prompt_ids(prompt)
            if not flags["exclude_input"] and not flags["token_level"] and isinstance(prompt, str):
                prefix = prompt
            else:
                prefix = ""
            agen = self.llm.generate_async(prompt_ids, params)
            final = None
            cancel_watch = asyncio.ensure_future(self._watch_cancel(request, sender))
            try:
                async for out in agen:
                    if triton_id:
                        self.by_triton_id[triton_id] = out.request_id
                    final = out
                    # Checked before every send as well: sending on a stream whose client is gone can block the
                    # model's event loop (and with it the metrics task), not only fail.
                    if cancel_watch.done() or (sender is not None and sender.is_cancelled()):
                        break
                    if flags["stream"] and (out.delta or out.delta_token_ids) and not out.finished:
                        sender.send(pb_utils.InferenceResponse(output_tensors=self._outputs(out, flags, prompt_ids, prefix + out.text)))
            finally:
                cancel_watch.cancel()
                await agen.aclose()
                self.by_triton_id.pop(triton_id, None)
            if final is not None and final.finish_reason == "error":
                raise PrecastError(final.error or "generation failed")
            stopped = triton_id in self.stopped
            self.stopped.discard(triton_id)
            if final is not None and final.finish_reason == "cancelled" and stopped:
                # Ended by the client's own `stop` request: a normal final response.
                return self._finish(
                    sender, pb_utils.InferenceResponse(output_tensors=self._outputs(final, flags, prompt_ids, prefix + final.text))
                )
            client_gone = cancel_watch.done() or (sender is not None and sender.is_cancelled())
            if final is None or (client_gone and not final.finished) or final.finish_reason == "cancelled":
                error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                return self._finish(sender, pb_utils.InferenceResponse(error=error))
            response = pb_utils.InferenceResponse(output_tensors=self._outputs(final, flags, prompt_ids, prefix + final.text))
            return self._finish(sender, response)
        except PrecastError as e:
            return self._finish(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        except Exception as e:  # never let one request take the model down
            return self._finish(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}")))

    def _finish(self, sender: Any, response: Any | None) -> Any | None:
        if sender is None:
            return response if response is not None else pb_utils.InferenceResponse(output_tensors=[])
        if response is not None:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    async def _watch_cancel(self, request: Any, sender: Any) -> None:
        """Returns when Triton marks the request cancelled (client gone, gRPC stream closed)."""
        while not (request.is_cancelled() or (sender is not None and sender.is_cancelled())):
            await asyncio.sleep(_CANCEL_POLL_S)
        rid = self.by_triton_id.get(request.request_id())
        if rid is not None:
            self.llm.cancel(rid)

    # ---- Triton entry points -------------------------------------------------------
    async def execute(self, requests: list[Any]) -> list[Any] | None:
        if self._metrics_task is None:
            self._metrics_task = asyncio.ensure_future(self._metrics.run(self.llm))
        if self.decoupled:
            for r in requests:
                asyncio.ensure_future(self._serve_one(r))
            return None
        return list(await asyncio.gather(*(self._serve_one(r) for r in requests)))

    def finalize(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        self.llm.shutdown()


class _Metrics:
    """Custom metrics, named after tensorrtllm_backend's, refreshed from executor stats."""

    def __init__(self, model: str) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        self.requests = pb_utils.MetricFamily(name="precast_request_metrics", description="precast requests by state", kind=gauge)
        self.kv = pb_utils.MetricFamily(name="precast_kv_cache_block_metrics", description="precast KV cache blocks", kind=gauge)
        self.general = pb_utils.MetricFamily(name="precast_general_metrics", description="precast executor counters", kind=gauge)
        self.tokens = pb_utils.MetricFamily(name="precast_token_metrics", description="precast token counts", kind=gauge)
        self.values: dict[tuple[str, str], Any] = {}
        for family, label, names in (
            (self.requests, "request_type", ("active", "queued", "scheduled", "context", "decode", "max")),
            (self.kv, "kv_cache_block_type", ("max", "free", "used", "reused", "tokens_per")),
            (self.general, "general_type", ("iteration_counter", "preemptions")),
            (self.tokens, "token_type", ("input", "output")),
        ):
            for n in names:
                self.values[(label, n)] = family.Metric(labels={"model": model, label: n})

    def update(self, llm: Any) -> None:
        s = llm.stats()
        kv = s.kv
        values = {
            ("request_type", "active"): s.active_requests,
            ("request_type", "queued"): s.queued_requests,
            ("request_type", "scheduled"): s.scheduled_requests,
            ("request_type", "context"): s.context_requests,
            ("request_type", "decode"): s.decode_requests,
            ("request_type", "max"): llm.engine.config.limits.max_batch_size,
            ("kv_cache_block_type", "max"): kv.max_blocks,
            ("kv_cache_block_type", "free"): kv.free_blocks,
            ("kv_cache_block_type", "used"): kv.used_blocks,
            ("kv_cache_block_type", "reused"): kv.reused_blocks,
            ("kv_cache_block_type", "tokens_per"): kv.tokens_per_block,
            ("general_type", "iteration_counter"): s.iterations,
            ("general_type", "preemptions"): s.preemptions,
            ("token_type", "input"): s.prompt_tokens,
            ("token_type", "output"): s.generated_tokens,
        }
        for key, v in values.items():
            self.values[key].set(float(v))

    async def run(self, llm: Any) -> None:
        while True:
            self.update(llm)
            await asyncio.sleep(0.2)
