"""Request intake: the body read under a size limit, then parsed and tokenized off the event loop.

The event loop serves every client (streams, /health), so no request may hold it for long:
- the body is read in chunks and refused with 413 as soon as it passes `max_request_bytes`
  (or at once, when Content-Length says so);
- JSON parsing, validation and tokenization run in a worker thread. Tokenization releases the GIL
  (runtime/tokenizer.py), and parsing a body under the limit holds it for milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from precast.runtime.server.protocol import IGNORED_FIELDS
from precast.runtime.server.translate import OpenAIError

Body = TypeVar("Body", bound=BaseModel)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is larger than this server's limit of {limit:,} bytes "
        "(set by `precast serve --max-request-bytes`); send a shorter prompt",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 once it is known to exceed `limit` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[Body], raw: bytes, precheck: Callable[[dict[str, Any]], None]) -> Body:
    """JSON -> the request model, with OpenAI-shaped 400s (run in a worker thread); `precheck` bounds the
    raw body first (Translator.precheck)."""
    try:
        # orjson holds the GIL (and with it the event loop) less than half as long as json on a 4 MB body; what it
        # refuses (a lone surrogate, an integer beyond 64 bits) json reads, for the precise message below.
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for key, value in data.items():
        check_text(value, key)
    precheck(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from e


def validation_error(errors: list[Any]) -> OpenAIError:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "extra_forbidden":
        return OpenAIError(
            400,
            f"unsupported field {where!r}: precast does not implement it, so it refuses the request rather than ignore it; "
            f"remove the field (accepted and ignored on purpose: {', '.join(IGNORED_FIELDS)})",
            param=where,
            code="unsupported_field",
        )
    return OpenAIError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)


def check_text(value: Any, param: str) -> None:
    """Text must be encodable as UTF-8: JSON allows a lone UTF-16 surrogate (\\ud800), which no tokenizer takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise OpenAIError(
                400,
                f"{param} holds an unpaired UTF-16 surrogate ({value[e.start]!r} at character {e.start}); send valid Unicode text",
                param=param,
            ) from e
    elif isinstance(value, list):
        for item in value:
            check_text(item, param)
    elif isinstance(value, dict):
        for item in value.values():
            check_text(item, param)
