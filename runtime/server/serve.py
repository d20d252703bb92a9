"""`precast serve`: load an engine once and serve it over HTTP with uvicorn, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from precast.errors import PrecastError
from precast.runtime.llm import LLM
from precast.runtime.server.app import make_app
from precast.runtime.server.defaults import API_KEY_ENV, DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from precast.runtime.server.kv_events import KvEventPublisher
from precast.runtime.server.streaming import Generation


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """--api-key, else --api-key-file, else $PRECAST_API_KEY (the last two keep it out of the process list)."""
    if api_key_file:
        try:
            key = Path(api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise PrecastError(f"cannot read --api-key-file {api_key_file}: {e}") from e
        if not key:
            raise PrecastError(f"--api-key-file {api_key_file} is empty")
        return key
    return api_key or os.environ.get(API_KEY_ENV) or None


def read_chat_template(path: str | Path | None) -> str | None:
    """The Jinja source of --chat-template FILE, or None when none was given."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PrecastError(f"cannot read --chat-template {path}: {e}") from e


def serve(
    engine: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    kv_cache_memory: int | None = None,
    num_threads: int | None = None,
    log_level: str = "info",
    backend: str = "cpu",
    chat_template: str | Path | None = None,
    kv_events_endpoint: str | None = None,
    speculative: str | None = None,
    num_draft_tokens: int | None = None,
) -> None:
    name = model_name or Path(engine).resolve().name
    template = read_chat_template(chat_template)
    kv_events = kv_events_endpoint is not None
    with LLM(
        engine,
        backend=backend,
        kv_cache_memory=kv_cache_memory,
        num_threads=num_threads,
        chat_template=template,
        kv_events=kv_events,
        speculative=speculative,
        num_draft_tokens=num_draft_tokens,
    ) as llm:
        publisher = KvEventPublisher(llm, kv_events_endpoint) if kv_events_endpoint else None
        app = make_app(llm, name, api_key=api_key, max_concurrency=max_concurrency, max_request_bytes=max_request_bytes)
        print(f"precast serve: {name} on http://{host}:{port}/v1 (metrics at /metrics)", flush=True)
        print(f"precast serve: {llm.describe_resources()}", flush=True)
        if publisher is not None:
            print(f"precast serve: KV-cache events on {kv_events_endpoint} (vLLM's format)", flush=True)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(drain_timeout) + 5)
        try:
            DrainingServer(config, app.state.generation, drain_timeout).run()
        finally:
            if publisher is not None:
                publisher.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's Server that, on SIGTERM or SIGINT, also drains the app's requests (Generation.begin_drain)
    while uvicorn closes the listening socket and waits for open connections (drain timeout plus a margin)."""

    def __init__(self, config: uvicorn.Config, generation: Generation, drain_timeout: float):
        super().__init__(config)
        self.generation, self.drain_timeout = generation, drain_timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None and sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.call_soon_threadsafe(self.generation.begin_drain, self.drain_timeout)
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has stopped, which kills the process before the LLM
        # is shut down; the drain is the graceful exit, so the process ends normally (status 0) instead.
        self._captured_signals.clear()
