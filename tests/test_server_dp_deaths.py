"""Engine deaths behind the router, through the HTTP server (issue 32, item 5): `tokenloom serve
--data-parallel-size 2`, one engine process killed while four streams run (two on each engine, round
robin): the dead engine's streams end with an error, the other engine's finish, /health says degraded
and names the dead engine, the metrics say which, new requests go to the live engine; then the second
engine killed too: /health 503 and a new request a prompt 503, never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server_harness import ServerProcess, children, is_running, metric
from tests.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Wider, deeper and with a longer context than the other tests' tiny model, so that a request runs
    # long enough on a quiet machine (~1,000 tokens, seconds) for the kill to land while every stream runs.
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5, hidden_size=256,
                              intermediate_size=1024, num_hidden_layers=6, max_position_embeddings=2048)


def _stream(url: str, prompt: list[int], result: dict, started: threading.Event) -> None:
    """One streamed completion: the number of tokens, the finish reason and any error event; `started` is
    set at its first chunk."""
    tokens, finish, error = 0, None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                started.set()
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:  # the stream cut: recorded, and the test says it must not happen
        error = {"message": f"transport: {exc!r}"}
    result.update(tokens=tokens, finish=finish, error=error)


def _engine_pids(server: ServerProcess) -> list[int]:
    assert server.proc is not None
    return [p for p in children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_engine_deaths_behind_the_router(tiny_dir, tmp_path):
    # --keep-alive-on-engine-death: the server stays up with every engine dead, so the test reads its
    # answers (without it the server exits with code 1: tests/test_chaos.py).
    args = [str(tiny_dir), "--dtype", "float32", "--num-blocks", "1100", "--block-size", "4",
            "--data-parallel-size", "2", "--routing-policy", "round_robin", "--keep-alive-on-engine-death"]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        pids = _engine_pids(server)
        assert len(pids) == 2
        results = [{} for _ in range(4)]
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(server.url, [5 + i, 17, 33, 61, 90], results[i],
                                                          started[i])) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)  # arrival order = round-robin order
        for event in started:  # every stream has its first tokens: all four are running
            assert event.wait(120), "a stream never started"
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(180)
            assert not t.is_alive(), "a stream hung after an engine died"

        finished = [r for r in results if r.get("finish") == "length"]
        failed = [r for r in results if r.get("error") is not None]
        assert len(finished) == 2 and len(failed) == 2, results
        assert all(r["tokens"] == MAX_TOKENS for r in finished)
        assert all(r["status"] == 200 for r in results)  # streams had started: the error is an event
        assert all("engine" in r["error"]["message"] for r in failed), failed

        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded"
        dead = [e["engine"] for e in body["engines"] if not e["alive"]]
        assert len(dead) == 1 and "error" in body["engines"][dead[0]]
        live = 1 - dead[0]
        m = server.metrics()
        assert metric(m, "tokenloom:engine_alive", engine=str(dead[0])) == 0
        assert metric(m, "tokenloom:engine_alive", engine=str(live)) == 1
        assert metric(m, "tokenloom:engine_num_requests_running", engine=str(dead[0])) == 0

        # New requests: every one served by the live engine.
        for i in range(3):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": [7 + i, 8, 9], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"

        # The second engine dies too: 503 at once, for health and for requests.
        os.kill(pids[1], signal.SIGKILL)
        _wait(lambda: not is_running(pids[1]))
        _wait(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 503)
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 30
        assert "engine" in r.json()["error"]["message"]
        assert metric(server.metrics(), "tokenloom:engine_alive", engine=str(live)) == 0
    assert server.proc is not None and server.proc.returncode == 0
