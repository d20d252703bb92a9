"""The OpenAI-compatible HTTP app: routes for /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Each route translates its body into jobs (translate.py) and runs them (streaming.py). Every choice of
every request is one request in the shared LLM (in-flight batching across HTTP clients). Streaming
responses are server-sent events; a client that goes away cancels its requests.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.server.metrics import ServerMetrics
from precast.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from precast.runtime.server.streaming import Generation
from precast.runtime.server.translate import OpenAIError, Translator


def make_app(llm: LLM, model_name: str, api_key: str | None = None, max_concurrency: int | None = None) -> FastAPI:
    app = FastAPI(title="precast", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(llm, model_name)
    translate = Translator(llm, model_name)
    generation = Generation(llm, metrics, max_concurrency)
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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        arrival = time.perf_counter()
        translate.check_model(body.model)
        jobs = translate.completion_jobs(body)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name}
        if not body.stream:
            outs = await generation.collect_all(request, jobs, arrival)
            choices = [translate.completion_choice(body, i, o, 0, streaming=False) for i, o in enumerate(outs)]
            return base | {"choices": choices, "usage": translate.usage(outs, jobs)}

        def choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            return translate.completion_choice(body, i, out, start, streaming=True)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = generation.events(jobs, arrival, base, choice, include_usage, preamble=[])
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        arrival = time.perf_counter()
        translate.check_model(body.model)
        jobs = translate.chat_jobs(body)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if not body.stream:
            outs = await generation.collect_all(request, jobs, arrival)
            choices = [translate.chat_choice(body, i, o, 0, streaming=False) for i, o in enumerate(outs)]
            return base | {"object": "chat.completion", "choices": choices, "usage": translate.usage(outs, jobs)}

        chunk = base | {"object": "chat.completion.chunk"}

        def choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            return translate.chat_choice(body, i, out, start, streaming=True)

        first = [
            chunk | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(len(jobs))
        ]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = generation.events(jobs, arrival, chunk, choice, include_usage, preamble=first)
        return StreamingResponse(events, media_type="text/event-stream")

    return app
