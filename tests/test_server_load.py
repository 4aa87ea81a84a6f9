"""Many streams at once, some clients walking away: the rest complete exactly, /metrics agrees with what
was sent, and once all is done every KV block is free again."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.test_server_harness import ServerProcess, metric
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.slow
NUM_BLOCKS = 4096


@pytest.fixture(scope="module", params=["sync", "async", "async-spec"])
def server(request, tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)
    args = [str(model_dir), "--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), "--block-size", "4",
            "--served-model-name", "tiny"]
    if request.param.startswith("async"):  # the engine core's batch queue with disconnects midway
        args.append("--async-scheduling")
    if request.param == "async-spec":  # plus n-gram drafts the runner fills itself
        args += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}']
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        s.mode = request.param
        yield s


def _wait_idle(server, timeout_s: float = 20.0) -> dict[str, float]:
    """/metrics once nothing runs and the whole KV pool is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = (metric(m, "tokenloom:num_requests_running") == 0 and metric(m, "tokenloom:num_requests_waiting") == 0
                and metric(m, "tokenloom:kv_cache_usage_perc") == 0
                and metric(m, "tokenloom:kv_cache_free_blocks") == NUM_BLOCKS)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _delta(after: dict[str, float], before: dict[str, float], name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


async def _stream(client: httpx.AsyncClient, i: int, prompt: list[int], max_tokens: int, leave_after: int | None):
    """Stream one completion; return (finish_reason, usage) or ("left", chunks read)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8,
            "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    finish, usage, chunks = None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                chunks += 1
                finish = chunk["choices"][0]["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            if leave_after is not None and chunks >= leave_after:
                return "left", chunks  # leaving the block closes the connection mid-stream
    return finish, usage


def test_64_streams_with_disconnects_then_pool_is_free(server) -> None:
    n = 64
    prompts = [[3 + (7 * i + j) % 300 for j in range(8 + i % 9)] for i in range(n)]
    leavers = {i for i in range(n) if i % 11 == 5}
    # Leavers ask for many tokens, so that they are still running when their client goes away (a
    # short one can legitimately finish with "length" before the server notices the disconnect).
    max_tokens = [200 if i in leavers else 8 + i % 25 for i in range(n)]
    before = server.metrics()

    async def run():
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            jobs = [_stream(client, i, prompts[i], max_tokens[i], 2 if i in leavers else None) for i in range(n)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=240)

    results = asyncio.run(run())
    for i, (finish, usage) in enumerate(results):
        if i in leavers:
            assert finish == "left"
        else:
            assert finish == "length", (i, finish)
            assert usage["completion_tokens"] == max_tokens[i] and usage["prompt_tokens"] == len(prompts[i])
    after = _wait_idle(server)
    assert metric(after, "tokenloom:kv_cache_usage_perc") == 0
    assert metric(after, "tokenloom:kv_cache_free_blocks") == metric(after, "tokenloom:kv_cache_total_blocks")
    completed = [i for i in range(n) if i not in leavers]
    finished_length = _delta(after, before, "tokenloom:request_success_total", finished_reason="length")
    aborted = _delta(after, before, "tokenloom:request_success_total", finished_reason="abort")
    # Every request is counted exactly once; at most a rare leaver outruns its own disconnect.
    assert finished_length + aborted == n
    assert len(completed) <= finished_length <= len(completed) + 1
    generated = _delta(after, before, "tokenloom:generation_tokens_total")
    exact = sum(max_tokens[i] for i in completed)
    assert exact + 2 * len(leavers) <= generated <= exact + sum(max_tokens[i] for i in leavers)
    assert _delta(after, before, "tokenloom:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert _delta(after, before, "tokenloom:time_to_first_token_seconds_count") == n
    assert _delta(after, before, "tokenloom:e2e_request_latency_seconds_count") == n
    assert _delta(after, before, "tokenloom:request_queue_time_seconds_count") == n
    steps = _delta(after, before, "tokenloom:iteration_tokens_total_count")
    if server.mode != "async-spec":  # accepted drafts give several tokens per step
        assert steps >= max(max_tokens[i] for i in completed)
    else:  # the acceptance counters are still reported under async scheduling
        assert _delta(after, before, "tokenloom:spec_decode_num_drafts_total") > 0
        assert _delta(after, before, "tokenloom:spec_decode_num_draft_tokens_total") > 0
    assert _delta(after, before, "tokenloom:engine_step_duration_seconds_count") == steps


def test_non_streaming_client_that_leaves_is_aborted(server) -> None:
    before = server.metrics()
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 240, "n": 16, "ignore_eos": True}
    # The client gives up after 0.1 s: long enough for the server to have admitted the request, short
    # of the 240 steps the tiny model needs (~0.3 s even with the CPU kernels).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.1))
    after = _wait_idle(server)
    assert _delta(after, before, "tokenloom:request_success_total", finished_reason="abort") == 16
    assert _delta(after, before, "tokenloom:generation_tokens_total") < 16 * 240
    assert metric(after, "tokenloom:kv_cache_free_blocks") == NUM_BLOCKS
