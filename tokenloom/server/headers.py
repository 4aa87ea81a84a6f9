"""Response headers of the generation endpoints: the server-side queue time and ORCA load reports on
request; and the request id they take from X-Request-Id (the response header itself is
--enable-request-id-headers' middleware, tokenloom/server/request_id.py, as in vLLM)."""

from __future__ import annotations

import json
import uuid

from fastapi import Request

from tokenloom.engine.outputs import RequestOutput
from tokenloom.server.errors import APIError
from tokenloom.server.state import ServerState

ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
PRIORITY_HEADER = "x-vllm-priority"
_INT64 = 1 << 63


def base_request_id(raw: Request, body_request_id: str | None) -> str:
    """The client's X-Request-Id header, else the body's request_id (a vLLM field), else a fresh id."""
    return raw.headers.get("x-request-id") or body_request_id or uuid.uuid4().hex


def request_priority(raw: Request, body_priority: int) -> int:
    """vLLM 0.32's `X-Vllm-Priority` header: an integer there overrides the body's `priority` (for the
    completions and chat endpoints, not beam search or the batch endpoint, as in vLLM); one that is not an
    integer is ignored, as vLLM ignores it. Outside 64 bits it is a 400 (the body's field is bounded the same)."""
    text = raw.headers.get(PRIORITY_HEADER)
    if text is None:
        return body_priority
    try:
        value = int(text)
    except ValueError:
        return body_priority
    if not -_INT64 <= value < _INT64:
        raise APIError(400, f"X-Vllm-Priority header must fit in 64 bits, got {text}", param="X-Vllm-Priority")
    return value


def response_headers(state: ServerState, raw: Request, out: RequestOutput | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if out is not None and (queued := out.metrics.queue_time) is not None:
        headers["X-Queue-Time-Ms"] = f"{queued * 1000:.3f}"
    headers.update(orca_header(state, raw.headers.get(ORCA_FORMAT_HEADER)))
    return headers


def orca_header(state: ServerState, fmt: str | None) -> dict[str, str]:
    """vLLM's `endpoint-load-metrics` header (ORCA load report) when the request asks for TEXT or JSON."""
    if not fmt or fmt.lower() not in ("text", "json"):
        return {}
    named = {"kv_cache_usage_perc": float(state.metrics.last_kv_usage),
             "num_requests_waiting": float(state.metrics.last_num_waiting)}
    if fmt.lower() == "text":
        return {"endpoint-load-metrics": "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())}
    return {"endpoint-load-metrics": "JSON " + json.dumps({"named_metrics": named})}
