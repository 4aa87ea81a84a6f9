"""Reading a request body: size limit (413), strict JSON (400), then a pydantic model (400)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tokenloom.server.errors import APIError

M = TypeVar("M", bound=BaseModel)


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity, which are not JSON and would poison sampling.
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
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
    try:
        obj = json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(obj).__name__}")
    return obj


def parse_model(cls: type[M], obj: dict) -> M:
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        seen: dict[str, str] = {}
        for err in errors:  # one line per top-level field (unions report every alternative)
            field = str(err["loc"][0]) if err["loc"] else "body"
            if field not in seen:
                loc = ".".join(str(p) for p in err["loc"]) or "body"
                seen[field] = f"{loc}: {err['msg']}"
        message = "invalid request: " + "; ".join(list(seen.values())[:5])
        raise APIError(400, message, param=next(iter(seen), None)) from None
