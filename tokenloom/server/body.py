"""Reading a request body: size limit (413), strict JSON (400), then a pydantic model (400)."""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.server.errors import APIError

M = TypeVar("M", bound=BaseModel)


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity, which are not JSON and would poison sampling.
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    cached = getattr(request.state, "body", None)  # /invocations read it already
    if cached is not None:
        return cached
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":  # vLLM's validate_json_request, its message
        raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, f"invalid Content-Length header {length[:40]!r}")
        if int(length) > limit:
            raise APIError(413, f"the request body ({length} bytes) is larger than the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies have no Content-Length: count as they come
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:  # JSON between systems is UTF-8 (RFC 8259); json.loads would also guess UTF-16 and UTF-32 from bytes
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {body[exc.start]:#04x} at position "
                            f"{exc.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(obj).__name__}")
    _refuse_lone_surrogates(obj)
    return obj


def _refuse_lone_surrogates(obj: dict) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud800"), which is no Unicode character: the tokenizer and
    every UTF-8 encoder downstream would raise on it. One encode of the whole body finds any."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"the request body contains a lone UTF-16 surrogate "
                            f"({exc.object[exc.start:exc.end].encode('unicode_escape').decode()}), which is not "
                            "valid Unicode text") from None
    except RecursionError:  # nested deeper than json.dumps recurses; json.loads took it, so refuse it here
        raise APIError(400, "the request body is nested too deeply") from None


_MAX_REPORTED_ERRORS = 10  # vLLM's bounds on a validation error's size (a big bad body must not echo itself)
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _summarize_input(value: Any) -> Any:
    """vLLM's: a container described, a long value cut (pydantic repeats the whole input in every error)."""
    if isinstance(value, dict | list | tuple | set):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= _MAX_ERROR_INPUT_CHARS:
        return value
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"


# pydantic's names for the branches of a union and its validator wrappers, which a `loc` spells out but a client
# never sent (vLLM's _INTERNAL_LOC_MARKERS, and any bracketed segment).
_INTERNAL_LOC = frozenset({"function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
                           "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
                           "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
                           "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
                           "nonetype"})


def clean_loc(loc: tuple[Any, ...]) -> str:
    """vLLM's clean_loc_for_param: ('stop', 'list[str]', 0) -> 'stop.0'."""
    parts = [str(p) for p in loc if not any(c in str(p) for c in "[]{}()") and str(p).lower() not in _INTERNAL_LOC]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _format_error(err: dict[str, Any]) -> str:
    shown = {"type": err["type"], "loc": clean_loc(err["loc"]), "msg": err["msg"]}
    if "input" in err:
        shown["input"] = _summarize_input(err["input"])
    text = str(shown)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def validation_message(errors: list[dict[str, Any]]) -> str:
    """vLLM's words for a body that does not validate: the count, then each error (its pydantic type, where,
    what, the value sent), at most ten of them."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    shown = errors[:_MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in shown)
    if count > _MAX_REPORTED_ERRORS:
        message += f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}\n"
    return message.rstrip()


def parse_model(cls: type[M], obj: dict) -> M:
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = next((str(e["loc"][0]) for e in errors if e["loc"]), None)  # the top-level field to blame
        raise APIError(400, validation_message(errors), param=param) from None


class DrainBodyMiddleware:
    """A response sent before the request body was read (a 413, any early error) goes out at once, and
    then the rest of the body is read and dropped before the response is marked complete: a client that
    writes its whole body before reading (most do) then reads the error instead of a connection reset,
    and a client that reads while sending (or waits on Expect: 100-continue) has it before it finishes.
    Bounded by `max_bytes` and `max_seconds`; past them the connection is closed anyway."""

    def __init__(self, app: ASGIApp, max_bytes: int = 256 << 20, max_seconds: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        done = False
        started = False

        async def tracked() -> Message:
            nonlocal done, started
            started = True
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                done = True
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done \
                    and (started or _has_body(scope)):
                await send({**message, "more_body": True})  # the whole response is on the wire now
                drained, deadline = 0, time.monotonic() + self.max_seconds
                while not done and drained < self.max_bytes and time.monotonic() < deadline:
                    drained += len((await tracked()).get("body", b""))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send(message)

        await self.app(scope, tracked, sending)


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers") or [])
    if b"100-continue" in headers.get(b"expect", b"").lower():
        return False  # the client waits for our answer before sending: nothing to drain
    length = headers.get(b"content-length", b"0")
    return headers.get(b"transfer-encoding") is not None or (length.isdigit() and int(length) > 0)
