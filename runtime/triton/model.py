"""The Triton python-backend model: one precast LLM per model instance, fed by every Triton request.

Triton calls `execute` as a coroutine (the python backend's async execute), so concurrent
Triton requests are all in flight in one executor at once: in-flight batching, not
Triton's dynamic batcher. In decoupled mode each request streams its responses through
its response sender and `execute` returns at once; otherwise `execute` awaits its
requests and returns one response each. A request ends early when its client cancels it
(Triton marks it cancelled) or when a request carrying `stop=true` and the same request
id arrives.

Requests are translated by translate.py (inputs, outputs: tensorrtllm_backend's names) and
streamed here; metrics.py keeps the custom metrics.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

try:
    import triton_python_backend_utils as pb_utils  # provided by Triton's python backend stub
except ImportError:  # imported outside Triton (docs, tests of the helpers below)
    pb_utils = None

from precast.errors import PrecastError
from precast.runtime.llm import LLM
from precast.runtime.triton.metrics import TritonMetrics
from precast.runtime.triton.translate import get_input, output_tensors, parse_request, scalar

_CANCEL_POLL_S = 0.05


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
            speculative=p.get("speculative", "").strip() or None,
            num_draft_tokens=int(p["num_draft_tokens"]) if p.get("num_draft_tokens", "").strip() else None,
            backend=p.get("backend", "").strip() or "cpu",
        )
        self.by_triton_id: dict[str, int] = {}  # Triton request id -> precast request id, while in flight
        self.stopped: set[str] = set()  # Triton request ids ended by a `stop` request
        self._metrics = TritonMetrics(config["name"])
        self._metrics_task: asyncio.Task | None = None

    # ---- one request -----------------------------------------------------------------
    async def _serve_one(self, request: Any) -> Any | None:
        """Run one request. Decoupled: stream through its sender, return None. Else return its response."""
        sender = request.get_response_sender() if self.decoupled else None
        triton_id = request.request_id()
        try:
            if bool(scalar(get_input(request, "stop"))):
                # A stop request ends the in-flight request with the same id and answers empty.
                if triton_id in self.by_triton_id:
                    self.stopped.add(triton_id)
                    self.llm.cancel(self.by_triton_id[triton_id])
                return self._finish(sender, None)
            prompt, params, flags = parse_request(lambda n: get_input(request, n), self.llm.tokenizer)
            flags["stream"] = flags["stream"] and self.decoupled
            prompt_ids = self.llm.prompt_ids(prompt)
            if not flags["exclude_input"] and not flags["token_level"] and isinstance(prompt, str):
                prefix = prompt
            else:
                prefix = ""
            final, client_gone = await self._stream(request, sender, prompt_ids, params, flags, prefix)
            if final is not None and final.finish_reason == "error":
                raise PrecastError(final.error or "generation failed")
            stopped = triton_id in self.stopped
            self.stopped.discard(triton_id)
            if final is not None and final.finish_reason == "cancelled" and stopped:
                # Ended by the client's own `stop` request: a normal final response.
                return self._finish(
                    sender, pb_utils.InferenceResponse(output_tensors=output_tensors(final, flags, prompt_ids, prefix + final.text))
                )
            if final is None or (client_gone and not final.finished) or final.finish_reason == "cancelled":
                error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                return self._finish(sender, pb_utils.InferenceResponse(error=error))
            response = pb_utils.InferenceResponse(output_tensors=output_tensors(final, flags, prompt_ids, prefix + final.text))
            return self._finish(sender, response)
        except PrecastError as e:
            return self._finish(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        except Exception as e:  # never let one request take the model down
            return self._finish(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}")))

    async def _stream(
        self, request: Any, sender: Any, prompt_ids: list[int], params: Any, flags: dict[str, bool], prefix: str
    ) -> tuple[Any, bool]:
        """Generate, sending a response per new text when streaming; returns (last output, client gone)."""
        triton_id = request.request_id()
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
                    sender.send(pb_utils.InferenceResponse(output_tensors=output_tensors(out, flags, prompt_ids, prefix + out.text)))
        finally:
            cancel_watch.cancel()
            await agen.aclose()
            self.by_triton_id.pop(triton_id, None)
        return final, cancel_watch.done() or (sender is not None and sender.is_cancelled())

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
