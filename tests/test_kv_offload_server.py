"""KV offloading through `tokenloom serve`: usage.prompt_tokens_details.cached_tokens and the connector's
Prometheus counters count the tokens loaded from the tiers, and a restarted server with the same
--kv-offloading-dir serves the prompt from disk (the disk tier survives the restart)."""

from __future__ import annotations

import httpx
import pytest

from tests.test_kv_offload import BS, EXPECTED_HIT, OTHER, PROMPT
from tests.test_server_harness import ServerProcess, metric
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def _serve(tiny_dir, disk, log_path) -> ServerProcess:
    return ServerProcess(str(tiny_dir), "--dtype", "float32", "--num-blocks", "32", "--block-size", str(BS),
                         "--kv-offloading-size", "0.01", "--kv-offloading-dir", str(disk),
                         "--enable-prompt-tokens-details", log_path=log_path)


def _complete(http: httpx.Client, prompt: list[int]) -> tuple[list, int]:
    model = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["logprobs"]["tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_and_metrics_count_tier_hits_across_a_restart(tiny_dir, tmp_path):
    disk = tmp_path / "kv"
    with _serve(tiny_dir, disk, tmp_path / "a.log") as server, httpx.Client(base_url=server.url, timeout=60) as http:
        cold, cached = _complete(http, PROMPT)
        assert cached == 0
        _complete(http, OTHER)  # pushes (most of) PROMPT out of the 32-block pool
        again, cached = _complete(http, PROMPT)
        assert (again, cached) == (cold, EXPECTED_HIT)
        values = server.metrics()
        # The pool's own hit and the tiers' together make the request's cached tokens.
        external = metric(values, "tokenloom:external_prefix_cache_hits_total")
        assert external > 0
        assert external + metric(values, "tokenloom:prefix_cache_hits_total") == EXPECTED_HIT
        # Queries: the tokens the pool did not have, of each of the three requests.
        assert metric(values, "tokenloom:external_prefix_cache_queries_total") == (
            len(PROMPT) + len(OTHER) + len(PROMPT) - metric(values, "tokenloom:prefix_cache_hits_total"))
    with _serve(tiny_dir, disk, tmp_path / "b.log") as server, httpx.Client(base_url=server.url, timeout=60) as http:
        restarted, cached = _complete(http, PROMPT)
        assert (restarted, cached) == (cold, EXPECTED_HIT)
        assert metric(server.metrics(), "tokenloom:external_prefix_cache_hits_total") == EXPECTED_HIT
