"""A small OpenAI-compatible streaming server with known timings, for testing the bench client.

Runs aiohttp on 127.0.0.1 (ephemeral port) in a background thread with its own event loop. Tokens go
out on an absolute schedule measured from when the request arrived: token i is due at
ttft + i * itl, so client-side measurements can be checked against exact numbers. A chunk of k tokens
goes out when its last token is due.

    with FakeOpenAIServer(ttft_s=0.05, itl_s=0.01) as server:
        run_benchmark(server.base_url, "fake", requests)
        server.peak_concurrency, server.bodies, server.headers
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

MAX_HANG_S = 5.0  # a "hang" failure never holds a test longer than this


@dataclass
class FakeTiming:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    report_token_ids: bool = False  # list token_ids in chunks, so the client knows k per chunk
    queue_time_s: float | None = None  # reported in the final usage chunk's `metrics`
    natural_len: int | None = None  # without ignore_eos, stop after this many tokens (an "EOS")


# body -> None (serve normally), "http" (500 before streaming), "midstream" (error event after a few
# tokens) or "hang" (send headers, then nothing)
FailPolicy = Callable[[dict[str, Any]], str | None]
TimingPolicy = Callable[[dict[str, Any]], dict[str, Any] | None]


class FakeOpenAIServer:
    def __init__(
        self,
        *,
        model: str = "fake-model",
        timing_for: TimingPolicy | None = None,
        fail_if: FailPolicy | None = None,
        api_key: str | None = None,
        **timing: Any,
    ) -> None:
        self.model = model
        self.default_timing = FakeTiming(**timing)
        self.timing_for = timing_for
        self.fail_if = fail_if
        self.api_key = api_key
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.peak_concurrency = 0
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> FakeOpenAIServer:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        if self._loop is None or self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread:
            self._thread.join(10)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        # a short shutdown: a "hang" handler must not hold stop() for long
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        ready.set()
        loop.run_forever()
        loop.close()

    # -------------------------------------------------------------------------------------- handlers

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        with self._lock:
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            self.in_flight += 1
            self.peak_concurrency = max(self.peak_concurrency, self.in_flight)
        try:
            return await self._respond(request, body, arrived)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _respond(
        self, request: web.Request, body: dict[str, Any], arrived: float
    ) -> web.StreamResponse:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad api key"}}, status=401)
        failure = self.fail_if(body) if self.fail_if else None
        if failure == "http":
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        timing = replace(self.default_timing, **((self.timing_for(body) if self.timing_for else None) or {}))
        chat = request.path.endswith("chat/completions")
        n_tokens = int(body.get("max_tokens") or 16)
        if not body.get("ignore_eos") and timing.natural_len is not None:
            n_tokens = min(n_tokens, timing.natural_len)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if failure == "hang":
            until = time.perf_counter() + MAX_HANG_S
            while time.perf_counter() < until and request.transport and not request.transport.is_closing():
                await asyncio.sleep(0.02)
            return resp
        if chat:  # OpenAI opens chat streams with a role-only delta: no token, must not count as TTFT
            await _send(resp, _chat_chunk(self.model, {"role": "assistant", "content": ""}))
        sent = 0
        while sent < n_tokens:
            k = min(timing.tokens_per_chunk, n_tokens - sent)
            due = arrived + timing.ttft_s + (sent + k - 1) * timing.itl_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if failure == "midstream" and sent >= 2:
                await _send(resp, {"error": {"message": "injected mid-stream failure", "code": 500}})
                return resp
            text = "".join(f" t{sent + j}" for j in range(k))
            finish = "length" if sent + k == n_tokens else None
            ids = list(range(100 + sent, 100 + sent + k)) if timing.report_token_ids else None
            await _send(resp, self._token_chunk(chat, text, finish, ids))
            sent += k
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            prompt = body.get("prompt", "")
            n_prompt = (
                len(prompt) if isinstance(prompt, list) else len(str(prompt or body.get("messages")).split())
            )
            usage = {"prompt_tokens": n_prompt, "completion_tokens": sent, "total_tokens": n_prompt + sent}
            final: dict[str, Any] = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "choices": [],
                "usage": usage,
            }
            if timing.queue_time_s is not None:
                final["metrics"] = {"queue_time_s": timing.queue_time_s}
            await _send(resp, final)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _token_chunk(
        self, chat: bool, text: str, finish: str | None, ids: list[int] | None
    ) -> dict[str, Any]:
        if chat:
            return _chat_chunk(self.model, {"content": text}, finish)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        return {"id": "cmpl-fake", "object": "text_completion", "model": self.model, "choices": [choice]}


def _chat_chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model, "choices": [choice]}


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
