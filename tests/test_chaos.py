"""Chaos: what production throws at the server, and what each request sees.

- the engine process SIGKILLed under load: every request in flight ends with a 503 (no hang), /health
  answers 503 from then on, and the server exits with code 1 (vLLM's behaviour; see server/launcher.py);
- the API process SIGKILLed, idle or busy: the engine process is gone within a second;
- a step that raises (TOKENLOOM_FAULT_INJECT, engine/fault_injection.py): only its request fails, the
  rest finish with the tokens they get alone;
- a tiny KV pool and many long requests (preemption storms, both policies): every request finishes
  with exactly the tokens it gets alone, and the pool is whole again.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from tests.test_server_harness import ServerProcess, is_running
from tests.tiny_models import make_tiny_hf_model
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
POISON = 317  # a prompt starting with this token fails its step when fault injection is on


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def _args(tiny_dir, *extra: str) -> list[str]:
    return [str(tiny_dir), "--dtype", "float32", "--num-blocks", "2048", "--block-size", "4", *extra]


def _wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until `pid` is no longer running, or None if it still runs after `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not is_running(pid):
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> tuple[int, list]:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events: list = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
        return r.status_code, events


def test_engine_sigkill_under_load_fails_every_request_then_the_server_exits_1(tiny_dir, tmp_path) -> None:
    server = ServerProcess(*_args(tiny_dir), log_path=tmp_path / "server.log")
    server.start()
    try:
        engine = server.engine_pid()
        long = {"max_tokens": 240, "ignore_eos": True}

        async def load_then_kill():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                started = asyncio.Event()
                streams = [asyncio.ensure_future(_stream(client, {**long, "prompt": [5 + i, 6, 7]}, started))
                           for i in range(6)]
                plain = [asyncio.ensure_future(client.post("/v1/completions", json={**long, "prompt": [9, 3 + i]}))
                         for i in range(6)]
                await asyncio.wait_for(started.wait(), 30)
                await asyncio.sleep(0.05)  # every request has reached the engine
                os.kill(engine, signal.SIGKILL)
                t_kill = time.monotonic()
                done = await asyncio.wait_for(asyncio.gather(*streams, *plain), 10)
                t_all = time.monotonic() - t_kill
                # The server marks itself unhealthy as it fails the requests in flight: once they have their
                # errors, /health answers 503 (for ENGINE_DEATH_LINGER_S, then the server exits: a client
                # starved on a loaded core may only find it gone). Ordered, not timed: a wall-clock bound on the
                # first 503 failed on a busy 2-core machine (1.02 s, the test's own processes on one core).
                try:
                    health = (await client.get("/health")).status_code
                except httpx.TransportError:
                    health = None
                return done[:6], done[6:], health, t_all

        streams, plain, health, t_all = asyncio.run(load_then_kill())
        assert t_all < 5, t_all
        assert health == 503 or (health is None and server.proc.wait(10) == 1), health
        for status, events in streams:  # headers were out: the stream ends with a 503 error event
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            assert events[-2]["error"]["code"] == 503 and "engine" in events[-2]["error"]["message"]
        for r in plain:
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", r.text
        # ... and the server goes, so that a supervisor restarts it whole.
        assert server.proc.wait(10) == 1, server.log()
        assert "exits with code 1" in server.log()
        assert not is_running(engine)
    finally:
        server.stop()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_api_process_sigkill_takes_the_engine_down_within_a_second(tiny_dir, tmp_path, busy) -> None:
    server = ServerProcess(*_args(tiny_dir), log_path=tmp_path / "server.log")
    server.start()
    try:
        engine = server.engine_pid()
        if busy:  # the engine is mid-load, stepping (not blocked on its inbox) when the API dies
            body = {"prompt": [5, 6, 7], "max_tokens": 240, "n": 16, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=server.url, timeout=30) as http, \
                    http.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
                server.proc.kill()
                gone_after = _wait_gone(engine, 5.0)
        else:
            server.proc.kill()
            gone_after = _wait_gone(engine, 5.0)
        assert gone_after is not None and gone_after < 1.0, f"engine still running {gone_after} s later"
    finally:
        server.stop()


def test_a_failing_step_ends_only_its_request_and_the_server_goes_on(tiny_dir, tmp_path) -> None:
    """--max-num-seqs 1 makes the poisoned request's step its own: it alone gets the 500."""
    server = ServerProcess(*_args(tiny_dir, "--max-num-seqs", "1"), log_path=tmp_path / "server.log",
                           env={"TOKENLOOM_FAULT_INJECT": f"first_token={POISON}"})
    server.start()
    try:
        def body(prompt: list[int], **kw) -> dict:
            return {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0, **kw}

        async def mixed():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                started = asyncio.Event()
                first = asyncio.ensure_future(_stream(client, body([5, 6, 7], max_tokens=120), started))
                await asyncio.wait_for(started.wait(), 30)  # running; the next three wait their turn
                poisoned = asyncio.ensure_future(client.post("/v1/completions", json=body([POISON, 8, 9])))
                poisoned_stream = asyncio.ensure_future(_stream(client, body([POISON, 4]), asyncio.Event()))
                after = asyncio.ensure_future(client.post("/v1/completions", json=body([11, 12, 13])))
                return await asyncio.wait_for(asyncio.gather(first, poisoned, poisoned_stream, after), 60)

        first, poisoned, poisoned_stream, after = asyncio.run(mixed())
        assert first[0] == 200 and first[1][-2]["choices"][0]["finish_reason"] == "length", first[1][-3:]
        assert poisoned.status_code == 500 and "injected fault" in poisoned.json()["error"]["message"]
        status, events = poisoned_stream
        assert status == 200 and events[-2]["error"]["code"] == 500 and events[-1] == "[DONE]"
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 24
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            alone = http.post("/v1/completions", json=body([11, 12, 13])).json()
        assert alone["choices"][0]["text"] == after.json()["choices"][0]["text"]
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_storms_in_a_tiny_pool_finish_every_request_exactly(tiny_dir, policy) -> None:
    """24 requests of up to 90 tokens each over a pool of 32 blocks x 4 tokens (one to three of them fit
    at a time): they preempt one another over and over, and each ends with the tokens it gets alone."""
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(8, 40))]} for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 50), ignore_eos=True) for _ in prompts]
    priorities = [rng.randint(0, 3) for _ in prompts]
    roomy = LLM(str(tiny_dir), dtype="float32", num_blocks=1024, block_size=4)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_dir), dtype="float32", num_blocks=32, block_size=4, max_num_batched_tokens=64,
                max_num_seqs=16, scheduling_policy=policy)
    outs = tight.generate(prompts, params, use_tqdm=False,
                          priority=priorities if policy == "priority" else None)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert sum(o.metrics.num_preemptions for o in outs) >= 24, "not a storm: too few preemptions"
    pool = tight.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
