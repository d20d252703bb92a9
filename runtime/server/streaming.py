"""Running jobs for the HTTP app: latency metrics, the concurrency limit, disconnects, draining, server-sent events.

A job is one choice (runtime/server/translate.py). Every choice is one request in the shared LLM, so
choices of all clients batch together; a consumer that stops (a closed stream, a client gone, streaming
or not) cancels the requests it was waiting for, which frees their KV blocks at once.

Draining (SIGTERM, runtime/server/serve.py): new requests get 503 at once; requests in flight run on
until the drain timeout, then each is cancelled and ends with a final error event (streams) or a 503
(non-streaming), so no client takes a cut stream for a complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from precast.errors import PrecastError
from precast.runtime.llm import LLM, RequestOutput
from precast.runtime.server.metrics import ServerMetrics
from precast.runtime.server.responses import Responses
from precast.runtime.server.translate import Job, OpenAIError

ChoiceBuilder = Callable[[int, RequestOutput, int], dict[str, Any]]  # (index, output, first new token) -> choice


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def shutting_down() -> OpenAIError:
    return OpenAIError(
        503, "the server is shutting down; retry on another replica or after it restarts", "server_error", code="shutting_down"
    )


class Generation:
    def __init__(self, llm: LLM, metrics: ServerMetrics, max_concurrency: int | None):
        self.llm, self.metrics = llm, metrics
        self.limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.draining = False
        self._stop: asyncio.Event | None = None  # set when the drain timeout ends what still runs

    # ---- draining -------------------------------------------------------------------
    def check_admitting(self) -> None:
        if self.draining:
            raise shutting_down()

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests; after `timeout` seconds end every request still running (event-loop thread)."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(timeout, self._stopping().set)

    def _stopping(self) -> asyncio.Event:
        if self._stop is None:
            self._stop = asyncio.Event()
        return self._stop

    async def run_choice(self, job: Job, arrival: float) -> AsyncIterator[RequestOutput]:
        """One request's outputs, with latency metrics; cancelled with its consumer."""
        last: float | None = None
        agen = self.llm.generate_async(*job)
        while True:
            try:
                out = await agen.__anext__()
            except StopAsyncIteration:
                return
            except PrecastError as e:  # rejected by the executor (e.g. more KV than the whole cache)
                raise OpenAIError(400, str(e)) from e
            now = time.perf_counter()
            if out.delta_token_ids:
                self.metrics.observe_token(arrival, last, now, len(out.delta_token_ids))
                last = now
            if out.finished:
                self.metrics.observe_finished(arrival, now)
                if out.finish_reason == "error":
                    raise OpenAIError(500, f"generation failed: {out.error}", "server_error")
            yield out

    async def collect_all(self, request: Request, jobs: list[Job], arrival: float) -> list[RequestOutput]:
        """Every job's final output; all are cancelled if the client goes away first (or the drain ends)."""

        async def collect(job: Job) -> RequestOutput:
            final = None
            async for out in self.run_choice(job, arrival):
                final = out
            assert final is not None
            return final

        async def guarded() -> list[RequestOutput]:
            async with self.limit or contextlib.nullcontext():
                return await asyncio.gather(*(collect(j) for j in jobs))

        task = asyncio.ensure_future(guarded())
        gone = asyncio.ensure_future(_disconnected(request))
        stop = asyncio.ensure_future(self._stopping().wait())
        try:
            await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            stop.cancel()
            if not task.done():
                task.cancel()  # cancelling the consumers cancels their requests in the executor
        if not task.done() or task.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise shutting_down()  # the client, if it went away, reads nothing
        return task.result()

    async def events(
        self,
        jobs: list[Job],
        arrival: float,
        base: dict[str, Any],
        choice: ChoiceBuilder,
        include_usage: bool,
        preamble: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        """Server-sent events for all choices, under the concurrency limit; `choice` builds each chunk's choice."""
        async with self.limit or contextlib.nullcontext():
            for event in preamble:
                yield sse(event)
            finals: dict[int, RequestOutput] = {}
            seen = [0] * len(jobs)
            try:
                async for i, out in merged([self.run_choice(j, arrival) for j in jobs], self._stopping()):
                    c = choice(i, out, seen[i])
                    seen[i] = len(out.token_ids)
                    if c.get("text") or c.get("delta") or out.finished or c.get("logprobs"):  # text held back: no chunk
                        yield sse(base | {"choices": [c]})
                    if out.finished:
                        finals[i] = out
            except OpenAIError as e:
                yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
                return
            if include_usage:
                yield sse(base | {"choices": [], "usage": Responses.usage(list(finals.values()), jobs)})
            yield "data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up. The body has been read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(streams: list[AsyncIterator[RequestOutput]], stop: asyncio.Event) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several choices' outputs as they come; cancels all if the consumer stops, and ends with
    a 503 OpenAIError when `stop` is set (the drain timeout)."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:  # surfaced to the consumer
            await queue.put((i, e))

    async def stopper() -> None:
        await stop.wait()
        await queue.put((-1, shutting_down()))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    tasks.append(asyncio.create_task(stopper()))
    try:
        remaining = len(streams)
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
