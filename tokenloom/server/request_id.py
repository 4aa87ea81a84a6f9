"""--enable-request-id-headers: vLLM's XRequestIdMiddleware (vllm/entrypoints/serve/middleware/x_request_id.py).

Every HTTP response (health probes, errors and 401s included) gets an `X-Request-Id` header: the request's
own `X-Request-Id` when it sent one, else a fresh uuid4 hex. As in vLLM, that fresh id is the header's own:
it is not the id inside a completion (`cmpl-...`), which comes from the header, the body's `request_id` or
another fresh id (`headers.base_request_id`). Without the flag no response carries the header.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_headers = Headers(scope=scope)

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append(
                    "X-Request-Id", request_headers.get("X-Request-Id", uuid.uuid4().hex))
            await send(message)

        await self.app(scope, receive, send_with_request_id)
