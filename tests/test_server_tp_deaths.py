"""A tensor-parallel rank killed under the HTTP server (issue 37, faults): `tokenloom serve
--tensor-parallel-size 2`, a worker process killed while a stream runs: the stream ends with an
error event (never a hang), the engine-core process exits, /health answers 503 and a new request 503,
and no worker process is left behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server_dp_deaths import _stream, _wait
from tests.test_server_harness import ServerProcess, children, is_running
from tests.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5, hidden_size=256,
                              intermediate_size=1024, num_hidden_layers=6, max_position_embeddings=2048)


def _workers(server: ServerProcess) -> list[int]:
    """The ranks: children of the engine's ranks' forkserver (tokenloom/engine/worker_forkserver.py)."""
    assert server.proc is not None
    found = []
    for engine in children(server.proc.pid):
        for p in children(engine):
            if b"tokenloom.engine.worker_forkserver" in Path(f"/proc/{p}/cmdline").read_bytes():
                found += children(p)
    return found


def test_a_killed_rank_fails_the_server_engine_cleanly(tiny_dir, tmp_path):
    args = [str(tiny_dir), "--dtype", "float32", "--num-blocks", "1100", "--block-size", "4",
            "--tensor-parallel-size", "2", "--keep-alive-on-engine-death"]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        workers = _workers(server)
        assert len(workers) == 2
        result: dict = {}
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(server.url, [5, 17, 33, 61, 90], result, started))
        t.start()
        assert started.wait(120), "the stream never started"
        os.kill(workers[1], signal.SIGKILL)
        t.join(120)
        assert not t.is_alive(), "the stream hung after a rank died"
        assert result["error"] is not None and result["finish"] != "length", result
        _wait(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 503)
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 30
        _wait(lambda: not any(is_running(p) for p in workers))  # the other rank is gone too
