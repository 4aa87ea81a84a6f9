"""`tokenloom serve --data-parallel-size 2`: one API server over two engine processes — completions,
/health naming each engine, and per-engine metrics next to the summed ones."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.test_server_harness import ServerProcess, children, metric
from tests.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def test_serve_with_two_engines(tiny_dir, tmp_path):
    args = [str(tiny_dir), "--dtype", "float32", "--num-blocks", "256", "--block-size", "4",
            "--data-parallel-size", "2", "--routing-policy", "round_robin"]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        engines = [p for p in children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(engines) == 2
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "data_parallel_size": 2,
                                 "engines": [{"engine": 0, "alive": True}, {"engine": 1, "alive": True}]}
        texts = []
        for i in range(4):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": [5 + i, 17, 33, 61, 90, 120], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert len(texts) == 4
        m = server.metrics()
        assert metric(m, "tokenloom:kv_cache_total_blocks") == 512  # 2 engines x 256
        for e in ("0", "1"):  # round robin: each engine served two of the four
            assert metric(m, "tokenloom:engine_prefix_cache_queries_total", engine=e) > 0, sorted(m)
        assert metric(m, "tokenloom:request_success_total", finished_reason="length") == 4
