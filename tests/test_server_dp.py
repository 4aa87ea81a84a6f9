"""`tokenloom serve --data-parallel-size 2`: one API server over two engine processes — completions,
/health naming each engine, and per-engine metrics next to the summed ones."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.test_server_harness import ServerProcess, children, metric
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def test_serve_with_two_engines(tiny_dir, tmp_path):
    args = [str(tiny_dir), "--dtype", "float32", "--num-blocks", "256", "--block-size", "4", "--quantization", "none",
            "--data-parallel-size", "2", "--routing-policy", "round_robin"]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        engines = [p for p in children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(engines) == 2
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "data_parallel_size": 2,
                                 "engines": [{"engine": 0, "alive": True, "requests_in_flight": 0},
                                             {"engine": 1, "alive": True, "requests_in_flight": 0}]}
        prompts = [[5 + i, 17, 33, 61, 90, 120] for i in range(4)]
        got = []
        for p in prompts:
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            got.append((choice["token_ids"], choice["text"]))
        m = server.metrics()
        assert metric(m, "tokenloom:kv_cache_total_blocks") == 512  # 2 engines x 256
        for e in ("0", "1"):  # round robin: each engine served two of the four
            assert metric(m, "tokenloom:engine_prefix_cache_queries_total", engine=e) > 0, sorted(m)
        assert metric(m, "tokenloom:request_success_total", finished_reason="length") == 4
        for e in ("0", "1"):  # the router saw each request finish: nothing left in its load view
            assert any(k.startswith("tokenloom:engine_router_requests_in_flight{") and f'engine="{e}"' in k for k in m)
            assert metric(m, "tokenloom:engine_router_requests_in_flight", engine=e) == 0
    # Each engine serves what one engine serves: the same greedy tokens and text as an in-process engine
    # (float path: the same GEMM shapes decide near-ties the same way on either side).
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4, quantization="none")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    want = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    assert got == want and all(len(ids) == 6 for ids, _ in got)
