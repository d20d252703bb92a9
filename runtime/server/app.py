"""The OpenAI-compatible HTTP app: routes for /v1/models, /v1/completions, /v1/chat/completions, /tokenize,
/detokenize (vLLM's), /health (liveness), /ready (readiness), /metrics.

Each route reads its body under the size limit and parses and tokenizes it in a worker thread
(intake.py, translate.py), then runs the jobs (streaming.py) and builds the responses (responses.py). Every choice of every request is one
request in the shared LLM (in-flight batching across HTTP clients). Streaming responses are
server-sent events; a client that goes away, streaming or not, cancels its requests.

Open without the API key: /health, /ready and /metrics (probes and Prometheus scrapes carry no key);
everything else, /openapi.json included, needs it when one is set.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.server.defaults import DEFAULT_MAX_REQUEST_BYTES
from precast.runtime.server.intake import parse_body, read_body, validation_error
from precast.runtime.server.metrics import ServerMetrics
from precast.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from precast.runtime.server.responses import Responses, ToolCalls
from precast.runtime.server.streaming import Generation
from precast.runtime.server.translate import Job, OpenAIError, Translator

OPEN_PATHS = ("/health", "/ready", "/metrics")


class ApiKeyCheck:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the routes)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                error = OpenAIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _schema(model: type) -> dict[str, Any]:
    """The request body's schema for /openapi.json (routes read the body themselves, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def make_app(
    llm: LLM,
    model_name: str,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    app = FastAPI(title="precast", docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    metrics = ServerMetrics(llm, model_name)
    translate = Translator(llm, model_name)
    respond = Responses(llm)
    generation = Generation(llm, metrics, max_concurrency)
    app.state.generation = generation  # serve.py drains it on SIGTERM
    app.state.metrics = metrics  # replicas/app.py serves the registry on its own port too
    created = int(time.time())

    # JSON parsing and validation hold the GIL inside single C calls (~50 ms for 4 MiB), so they run one
    # at a time in their own thread: the event loop waits for at most one of them. Tokenization releases
    # the GIL and runs in the default pool, in parallel.
    parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="precast-parse")

    async def intake(request: Request, model: type, to_jobs: Any) -> tuple[Any, list[Job]]:
        """Body -> (parsed body, jobs): read under the limit, then parsed and tokenized in worker threads."""
        generation.check_admitting()
        raw = await read_body(request, max_request_bytes)
        loop = asyncio.get_running_loop()

        def parse() -> Any:
            body = parse_body(model, raw, translate.precheck)
            translate.check_model(body.model)
            return body

        body = await loop.run_in_executor(parser, parse)
        return body, await asyncio.to_thread(to_jobs, body)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(list(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the process serves (also while it drains: restarting it then would cut what it finishes)."""
        return JSONResponse({"status": "draining" if generation.draining else "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: new requests are admitted (503 while draining, so a load balancer stops sending them)."""
        if generation.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    model_card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "precast",
        "max_model_len": llm.max_seq_len,
        "vocab_size": llm.engine.config.model.vocab_size,
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        translate.check_model(model_id)
        return model_card

    @app.post("/tokenize", openapi_extra=_schema(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        _, tokens = await intake(request, TokenizeRequest, translate.tokenize)
        return {"count": len(tokens), "max_model_len": llm.max_seq_len, "tokens": tokens}

    @app.post("/detokenize", openapi_extra=_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        _, text = await intake(request, DetokenizeRequest, translate.detokenize)
        return {"prompt": text}

    @app.post("/v1/completions", openapi_extra=_schema(CompletionRequest))
    async def completions(request: Request) -> Any:
        arrival = time.perf_counter()
        body, jobs = await intake(request, CompletionRequest, translate.completion_jobs)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name}
        if not body.stream:
            outs = await generation.collect_all(request, jobs, arrival)
            choices = [respond.completion_choice(body, i, o, 0, streaming=False) for i, o in enumerate(outs)]
            return base | {"choices": choices, "usage": respond.usage(outs, jobs, generated=body.max_tokens != 0)}

        def choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            return respond.completion_choice(body, i, out, start, streaming=True)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = generation.events(jobs, arrival, base, choice, include_usage, preamble=[])
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/chat/completions", openapi_extra=_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        arrival = time.perf_counter()
        body, jobs = await intake(request, ChatCompletionRequest, translate.chat_jobs)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if not body.stream:
            outs = await generation.collect_all(request, jobs, arrival)
            fmt = translate.tool_format(body)
            choices = [
                respond.chat_choice(body, i, o, 0, False, ToolCalls(fmt, streaming=False) if fmt else None) for i, o in enumerate(outs)
            ]
            return base | {"object": "chat.completion", "choices": choices, "usage": respond.usage(outs, jobs)}

        chunk = base | {"object": "chat.completion.chunk"}

        fmt = translate.tool_format(body)
        calls = [ToolCalls(fmt, streaming=True) if fmt else None for _ in jobs]

        def choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            return respond.chat_choice(body, i, out, start, True, calls[i])

        first = [
            chunk | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(len(jobs))
        ]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = generation.events(jobs, arrival, chunk, choice, include_usage, preamble=first)
        return StreamingResponse(events, media_type="text/event-stream")

    return app
