"""`precast serve`: load an engine once and serve it over HTTP with uvicorn."""

from __future__ import annotations

from pathlib import Path

from precast.runtime.llm import LLM
from precast.runtime.server.app import make_app


def serve(
    engine: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    kv_cache_memory: int | None = None,
    num_threads: int | None = None,
    log_level: str = "info",
    backend: str = "cpu",
) -> None:
    import uvicorn  # only `precast serve` needs it

    name = model_name or Path(engine).resolve().name
    with LLM(engine, backend=backend, kv_cache_memory=kv_cache_memory, num_threads=num_threads) as llm:
        app = make_app(llm, name, api_key=api_key, max_concurrency=max_concurrency)
        print(f"precast serve: {name} on http://{host}:{port}/v1 (metrics at /metrics)", flush=True)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
