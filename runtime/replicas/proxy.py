"""An HTTP request carried from the ingress to a replica, and the replica running it through precast's own app.

The replica runs the very app `precast serve` runs (server/app.py), in-process over ASGI, so routes, errors, API key
and streaming are the same; what it sends back is a stream of items: first (status, headers), then body chunks. When
the caller stops reading (the client hung up, Ray cancelled the call) the app sees `http.disconnect` and cancels the
request's generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

Headers = list[tuple[bytes, bytes]]


@dataclass
class ProxiedRequest:
    method: str
    path: str
    query_string: bytes
    headers: Headers
    body: bytes
    routing_text: str = field(default="")  # the prompt, for the router (router.py); "" when there is none


def routing_text(body: bytes) -> str:
    """The text the prompt starts with, from an OpenAI request body: the chat messages in order (tools first, as
    chat templates render them), or the completion prompt. Malformed bodies give "" (the replica refuses them)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("messages"), list):
        parts = [orjson.dumps(data["tools"]).decode()] if data.get("tools") else []
        for message in data["messages"]:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):  # content parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"<{message.get('role')}>{content if isinstance(content, str) else ''}")
        return "\n".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # several prompts: route by the first
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt))
    return ""


async def run_app(app: Any, request: ProxiedRequest) -> AsyncIterator[Any]:
    """Runs `request` through the ASGI `app`; yields (status, headers) and then each body chunk (bytes)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": None,
        "server": None,
    }
    items: asyncio.Queue[Any] = asyncio.Queue()
    hung_up = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await hung_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await items.put((message["status"], list(message.get("headers", []))))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await items.put(bytes(message["body"]))
            if not message.get("more_body", False):
                await items.put(None)

    async def call() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await items.put(None)  # also when the app failed: the stream ends

    task = asyncio.create_task(call())
    try:
        while (item := await items.get()) is not None:
            yield item
        await task  # surfaces an exception the app raised
    finally:
        hung_up.set()  # the reader stopped early: the app cancels the generation
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=5)
