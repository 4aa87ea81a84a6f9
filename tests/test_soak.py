"""The soak of benchmarks/serving/soak.py, short: ~100 mixed requests through a live server (streamed or not,
10 % dropped by the client mid-way, malformed ones interleaved, mixed priorities, a KV pool that cycles
and preempts), then: every completed request has the tokens it gets alone, no KV block leaked, no 5xx,
flat RSS. The long run (5,000 requests) and its figures: docs/reliability.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.tiny_models import TINY_VOCAB, make_tiny_hf_model

pytestmark = pytest.mark.slow


def _soak_module():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "serving" / "soak.py"
    spec = importlib.util.spec_from_file_location("tokenloom_soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_short_soak_through_the_server(tmp_path) -> None:
    soak = _soak_module()
    model = str(make_tiny_hf_model(tmp_path / "tiny", arch="llama", seed=3))
    server_args = ["--dtype", "float32", "--num-blocks", "48", "--block-size", "16",
                   "--scheduling-policy", "priority", "--max-waiting-requests", "0"]
    engine_kwargs = {"dtype": "float32", "num_blocks": 256, "block_size": 16, "scheduling_policy": "priority"}
    report = soak.run_soak(model, server_args, engine_kwargs, requests=100, concurrency=16, seed=1,
                           max_prompt=40, max_tokens=12, disconnect_frac=0.1, malformed_frac=0.08, rss_every=25,
                           log_path=tmp_path / "server.log", vocab=TINY_VOCAB)
    d = report.as_dict()
    assert not report.unexpected, d
    assert not report.token_mismatches, d
    assert report.leaked_blocks == 0 and report.malformed_4xx == report.malformed > 0, d
    assert report.disconnected > 0 and report.completed + report.disconnected == report.requests, d
    assert not any(k.startswith("5") for k in report.status_counts), d
    assert report.first_cycle_at_request is not None and report.rss_ok, d
    assert report.tokens_checked > 0
