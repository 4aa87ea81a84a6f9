"""The server's life and death: a full waiting queue (429), the engine process killed (503, fast), and a
graceful SIGTERM (in-flight requests finish or are told they were cut; no process left behind)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.test_server_harness import ServerProcess, is_running
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def _args(tiny_dir, *extra: str) -> list[str]:
    return [str(tiny_dir), "--dtype", "float32", "--num-blocks", "2048", "--block-size", "4", *extra]


def _events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_engine_death_fails_fast_with_503(tiny_dir, tmp_path) -> None:
    """With --keep-alive-on-engine-death the server stays up answering 503 (without it the server exits
    with code 1: tests/test_chaos.py)."""
    with ServerProcess(*_args(tiny_dir, "--keep-alive-on-engine-death"), log_path=tmp_path / "server.log") as server:
        engine = server.engine_pid()
        body = {"prompt": [5, 6, 7], "max_tokens": 240, "n": 16, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # generation is under way
                os.kill(engine, signal.SIGKILL)
                t0 = time.monotonic()
                rest = _events(list(lines))
            assert time.monotonic() - t0 < 5
            assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == 503, rest[-3:]
            health = http.get("/health")
            assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
            t0 = time.monotonic()
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and time.monotonic() - t0 < 2
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            assert http.get("/metrics").status_code == 200  # the API process itself is fine
        assert server.stop() == 0
        assert not is_running(engine)


async def _stream(client: httpx.AsyncClient, body: dict, accepted: asyncio.Event) -> list:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        accepted.set()  # headers are sent once the engine has the request
        lines = [line async for line in r.aiter_lines()]
        return [r.status_code, _events(lines)]


def test_full_queue_is_429_and_sigterm_drains_then_cuts(tiny_dir, tmp_path) -> None:
    server = ServerProcess(*_args(tiny_dir, "--max-num-seqs", "1", "--max-waiting-requests", "8",
                                  "--shutdown-grace-period", "0.5"), log_path=tmp_path / "server.log")
    server.start()
    try:
        engine = server.engine_pid()
        long = {"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True}

        async def flood():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=long) for _ in range(20)))

        responses = asyncio.run(asyncio.wait_for(flood(), 120))
        codes = [r.status_code for r in responses]
        # 1 running + 8 waiting at most while the first runs; the rest are turned away
        assert set(codes) == {200, 429} and codes.count(429) >= 8, codes
        assert all(r.json()["usage"]["completion_tokens"] == 240 for r in responses if r.status_code == 200)
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.json()["error"]["type"] == "RateLimitError" and rejected.headers["Retry-After"]

        async def shutdown_while_streaming():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                accepted = [asyncio.Event(), asyncio.Event()]
                jobs = [asyncio.ensure_future(_stream(client, {**long, "n": 4}, e)) for e in accepted]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in accepted)), 30)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(httpx.ConnectError):  # no longer accepting
                    await client.get("/health")
                return await asyncio.wait_for(asyncio.gather(*jobs), 60)

        results = asyncio.run(shutdown_while_streaming())
        finishes = []
        for status, events in results:
            assert status == 200 and events[-1] == "[DONE]"
            chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
            finishes += [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
            if any(f == "abort" for c in chunks for f in [c["choices"][0]["finish_reason"]]):
                assert events[-2]["error"]["code"] == 503 and "shut down" in events[-2]["error"]["message"]
        assert len(finishes) == 8 and "abort" in finishes, finishes
        assert server.proc.wait(30) == 0
        assert not is_running(engine)
    finally:
        server.stop()
