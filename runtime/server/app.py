"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Every choice of every request is one request in the shared LLM (in-flight batching across
HTTP clients). Streaming responses are server-sent events; a client that goes away cancels
its requests, so their KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from precast.errors import PrecastError
from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.server.metrics import ServerMetrics
from precast.runtime.server.protocol import DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def make_app(llm: LLM, model_name: str, api_key: str | None = None, max_concurrency: int | None = None) -> FastAPI:
    app = FastAPI(title="precast", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(llm, model_name)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return OpenAIError(400, f"the request body is not valid JSON: {first.get('msg')}").response()
        return OpenAIError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error").response()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return OpenAIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "precast",
                    "max_model_len": llm.max_seq_len,
                    "vocab_size": llm.engine.config.model.vocab_size,
                }
            ],
        }

    def check_model(name: str) -> None:
        if name != model_name:
            raise OpenAIError(
                404, f"The model `{name}` does not exist; this server serves `{model_name}`.", param="model", code="model_not_found"
            )

    def check_length(prompt_ids: list[int], max_tokens: int, param: str) -> None:
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", param=param)
        if len(prompt_ids) + max_tokens > llm.max_seq_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {llm.max_seq_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )

    async def run_choice(prompt_ids: list[int], params: Any, arrival: float) -> AsyncIterator[RequestOutput]:
        """One request's outputs, with latency metrics; cancelled with its consumer."""
        last: float | None = None
        agen = llm.generate_async(prompt_ids, params)
        while True:
            try:
                out = await agen.__anext__()
            except StopAsyncIteration:
                return
            except PrecastError as e:  # rejected by the executor (e.g. more KV than the whole cache)
                raise OpenAIError(400, str(e)) from e
            now = time.perf_counter()
            if out.delta_token_ids:
                metrics.observe_token(arrival, last, now, len(out.delta_token_ids))
                last = now
            if out.finished:
                metrics.observe_finished(arrival, now)
                if out.finish_reason == "error":
                    raise OpenAIError(500, f"generation failed: {out.error}", "server_error")
            yield out

    async def guarded(coro: Any) -> Any:
        if limit is None:
            return await coro
        async with limit:
            return await coro

    async def collect(prompt_ids: list[int], params: Any, arrival: float) -> RequestOutput:
        final = None
        async for out in run_choice(prompt_ids, params, arrival):
            final = out
        assert final is not None
        return final

    async def until_disconnect(request: Request, task: asyncio.Task) -> Any:
        """Await `task`, cancelling it if the client goes away first."""
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
        return task.result()

    def sse(data: Any) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several choices' outputs as they come; cancels all if the consumer stops."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in s:
                    await queue.put((i, out))
                await queue.put((i, None))
            except Exception as e:  # surfaced to the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def usage(outs: list[RequestOutput], prompts: list[list[int]]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    def token_text(token: int) -> str:
        return llm.tokenizer.decode([token], skip_special_tokens=False) if llm.tokenizer else str(token)

    def completion_logprobs(out: RequestOutput, start: int = 0) -> dict[str, Any]:
        tokens = [token_text(t) for t in out.token_ids[start:]]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": out.logprobs[start:],
            "top_logprobs": [{token_text(t): lp for t, lp in top} for top in out.top_logprobs[start:]],
            "text_offset": offsets,
        }

    def chat_logprobs(out: RequestOutput, start: int = 0) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            text = token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
                for t, lp, top in zip(out.token_ids[start:], out.logprobs[start:], out.top_logprobs[start:])
            ]
        }

    def finish_reason(out: RequestOutput) -> str | None:
        return None if out.finish_reason is None else ("length" if out.finish_reason == "length" else "stop")

    async def stream_events(
        jobs: list[tuple[list[int], Any]], arrival: float, base: dict[str, Any], choice: Any, options: Any, preamble: list[dict[str, Any]]
    ) -> AsyncIterator[str]:
        """Server-sent events for all choices: `choice(i, output, first_new_token)` builds each chunk's choice."""
        for event in preamble:
            yield sse(event)
        finals: dict[int, RequestOutput] = {}
        seen = [0] * len(jobs)
        try:
            async for i, out in merged([run_choice(p, sp, arrival) for p, sp in jobs]):
                c = choice(i, out, seen[i])
                seen[i] = len(out.token_ids)
                if out.delta or out.finished or c.get("logprobs"):
                    yield sse(base | {"choices": [c]})
                if out.finished:
                    finals[i] = out
        except OpenAIError as e:
            yield sse({"error": {"message": e.message, "type": e.type}})
            return
        if options and options.include_usage:
            yield sse(base | {"choices": [], "usage": usage(list(finals.values()), [p for p, _ in jobs])})
        yield "data: [DONE]\n\n"

    def check_params(jobs: list[tuple[list[int], Any]]) -> None:
        for _, params in jobs:
            try:
                params.validate()
            except PrecastError as e:
                raise OpenAIError(400, str(e)) from e

    async def collect_all(request: Request, jobs: list[tuple[list[int], Any]], arrival: float) -> list[RequestOutput]:
        task = asyncio.ensure_future(guarded(asyncio.gather(*(collect(p, sp, arrival) for p, sp in jobs))))
        return await until_disconnect(request, task)

    # ---- /v1/completions ------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        arrival = time.perf_counter()
        check_model(body.model)
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        raw = body.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        try:
            prompts = [llm.prompt_ids(p) for p in raw]
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="prompt") from e
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
        for p in prompts:
            check_length(p, max_tokens, "prompt")
        jobs = [(p, body.sampling(max_tokens, body.logprobs, i)) for p in prompts for i in range(body.n)]
        check_params(jobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        if not body.stream:
            outs = await collect_all(request, jobs, arrival)
            choices = [
                {
                    "index": i,
                    "text": o.text,
                    "finish_reason": finish_reason(o),
                    "logprobs": completion_logprobs(o) if body.logprobs is not None else None,
                }
                for i, o in enumerate(outs)
            ]
            return base | {"choices": choices, "usage": usage(outs, [p for p, _ in jobs])}

        def choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            lp = completion_logprobs(out, start) if body.logprobs is not None else None
            return {"index": i, "text": out.delta, "logprobs": lp, "finish_reason": finish_reason(out)}

        events = stream_events(jobs, arrival, base, choice, body.stream_options, preamble=[])
        return StreamingResponse(guarded_stream(events), media_type="text/event-stream")

    async def guarded_stream(gen: AsyncIterator[str]) -> AsyncIterator[str]:
        if limit is None:
            async for x in gen:
                yield x
            return
        async with limit:
            async for x in gen:
                yield x

    # ---- /v1/chat/completions -------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        arrival = time.perf_counter()
        check_model(body.model)
        try:
            prompt = llm.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except PrecastError as e:
            raise OpenAIError(400, str(e), param="messages") from e
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, llm.max_seq_len - len(prompt))
        check_length(prompt, max_tokens, "messages")
        top = body.top_logprobs if body.top_logprobs is not None else (0 if body.logprobs else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        jobs = [(prompt, body.sampling(max_tokens, top, i)) for i in range(body.n)]
        check_params(jobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "created": int(time.time()), "model": model_name}

        if not body.stream:
            outs = await collect_all(request, jobs, arrival)
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": o.text},
                    "finish_reason": finish_reason(o),
                    "logprobs": chat_logprobs(o) if body.logprobs else None,
                }
                for i, o in enumerate(outs)
            ]
            return base | {"object": "chat.completion", "choices": choices, "usage": usage(outs, [p for p, _ in jobs])}

        chunk = base | {"object": "chat.completion.chunk"}

        def choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            lp = chat_logprobs(out, start) if body.logprobs else None
            delta = {"content": out.delta} if out.delta else {}
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason(out)}

        first = [
            chunk | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(len(jobs))
        ]
        events = stream_events(jobs, arrival, chunk, choice, body.stream_options, preamble=first)
        return StreamingResponse(guarded_stream(events), media_type="text/event-stream")

    return app
