"""Data-parallel engines under one AsyncLLM: the same greedy tokens as one engine (bad_words applied in
both engines), aborts that reach the engine owning the request, and an engine killed mid-run failing only
its own requests.

Real engine processes on a tiny random model (fp32, so the two engines' threads cannot change a
greedy choice); each test starts its engines once and stops them.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom.engine.async_llm import AsyncLLM, EngineDeadError
from tokenloom.engine.core_client import MPClient
from tokenloom.engine.dp_client import DPEngineCoreClient, split_cpus
from tokenloom.engine.llm_engine import engine_config_from_kwargs
from tokenloom.router import RouterConfig
from tokenloom.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(420)  # engine start-up on a loaded 2-core machine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def _config(tiny_dir, **kw):
    return engine_config_from_kwargs(model=str(tiny_dir), dtype="float32", device="cpu", num_blocks=256,
                                     block_size=4, **kw)


def _engine(tiny_dir, dp: int, policy: str = "round_robin") -> AsyncLLM:
    config = _config(tiny_dir)
    if dp == 1:
        client = MPClient(config, "warning")
    else:
        client = DPEngineCoreClient(config, dp, RouterConfig(policy=policy), "warning")
    # 300 s: a first build of the CPU kernels on a loaded machine is slow.
    return AsyncLLM.from_client(client, str(tiny_dir), ready_timeout_s=300)


PROMPTS = [[1 + (7 * i + 3 * j) % 300 for j in range(5 + 3 * i)] for i in range(8)]


async def _generate(engine: AsyncLLM, prompts, params) -> dict[str, list[int] | BaseException]:
    engine.attach()

    async def one(i: int, prompt: list[int]):
        stream = engine.open_stream()
        engine.add_request(f"r{i}", prompt, params, stream)
        tokens: list[int] = []
        try:
            async for out in stream:
                tokens = list(out.outputs[0].token_ids)
        except EngineDeadError as exc:
            return exc
        return tokens

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {f"r{i}": r for i, r in enumerate(results)}


def test_split_cpus_gives_each_engine_its_own_cores():
    assert split_cpus(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert split_cpus(3, [0, 1, 2, 3]) == [[0], [1], [2]]
    assert split_cpus(3, [4, 5]) == [[4], [5], [4]]  # oversubscribed: shared, with a warning


@pytest.mark.slow
def test_greedy_tokens_dp2_equal_dp1(tiny_dir):
    """LLM(data_parallel_size=2): two engine processes behind the router give one engine's tokens."""
    from tokenloom import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = dict(dtype="float32", device="cpu", num_blocks=256, block_size=4)
    one = [list(o.outputs[0].token_ids) for o in LLM(str(tiny_dir), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_dir), data_parallel_size=2, routing_policy="round_robin", **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        router = llm.llm_engine.client.client.router
        assert router.num_routed == [4, 4]  # both engines served
        assert llm.llm_engine.client.scheduler_stats.prefix_cache_queries > 0  # the engines' reports, summed
        again = llm.generate(prompts[:2], params, use_tqdm=False)  # a second call on the same engines
        # bad_words reach both engine processes as token ids: with " on" and " the" left and " on" biased to
        # win, "on on" bans " on" right after " on" only, so the two alternate whatever the weights.
        tok = llm.get_tokenizer()
        (on,), (the,) = tok.encode(" on", add_special_tokens=False), tok.encode(" the", add_special_tokens=False)
        steered = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, allowed_token_ids=[on, the],
                                 logit_bias={on: 100.0}, bad_words=["on on"])
        banned = llm.generate(prompts[:4], steered, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == one
    assert [list(o.outputs[0].token_ids) for o in again] == one[:2]
    assert [list(o.outputs[0].token_ids) for o in banned] == [[on, the, on, the, on]] * 4
    assert all(len(t) == 12 for t in one)


@pytest.mark.slow
def test_aborts_reach_the_owner_and_a_killed_engine_fails_only_its_requests(tiny_dir):
    """One DP=2 deployment: an abort frees the request in the engine that owns it (the other keeps
    running its own); then engine 0 is killed mid-run: its requests fail with its error, engine 1's
    finish, health names engine 0, and new requests go to engine 1."""
    engine = _engine(tiny_dir, 2)

    async def run():
        engine.attach()
        router = engine.client.router
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        streams = {}
        for rid in ("a", "b"):
            streams[rid] = engine.open_stream()
            engine.add_request(rid, PROMPTS[0], long, streams[rid])
        ea, eb = router.owner["a"], router.owner["b"]
        assert {ea, eb} == {0, 1}
        stats = engine._engine_stats
        await _until(lambda: all(stats.get(e) and stats[e].num_running_reqs == 1 for e in (ea, eb)))
        streams["a"].close()
        assert "a" not in router.owner
        await _until(lambda: stats[ea].num_running_reqs == 0)
        assert stats[eb].num_running_reqs == 1
        assert stats[ea].num_free_blocks == 256  # its blocks are back in the pool
        streams["b"].close()
        await _until(lambda: stats[eb].num_running_reqs == 0)

        # Kill engine 0 mid-run.
        outcomes: dict[str, object] = {}

        async def one(rid: str):
            stream = engine.open_stream()
            engine.add_request(rid, PROMPTS[1], long, stream)
            try:
                async for out in stream:
                    outcomes[rid] = out
            except EngineDeadError as exc:
                outcomes[rid] = exc

        tasks = [asyncio.ensure_future(one(f"r{i}")) for i in range(4)]
        await asyncio.sleep(0)
        owner = {rid: router.owner[rid] for rid in outcomes.keys() | {f"r{i}" for i in range(4)}}
        await _until(lambda: stats[0].num_running_reqs > 0)
        os.kill(engine.client.clients[0].process.pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert sorted(owner.values()) == [0, 0, 1, 1]
        for rid, e in owner.items():
            if e == 0:
                assert isinstance(outcomes[rid], EngineDeadError), rid
                assert "data-parallel engine 0 failed" in str(outcomes[rid])
            else:
                assert outcomes[rid].finished and len(outcomes[rid].outputs[0].token_ids) == 200, rid
        # Still serving on engine 1, and health names engine 0.
        assert engine.dead_reason is None and engine.accepting
        health = engine.engine_health()
        assert [h["alive"] for h in health] == [False, True] and "died" in health[0]["error"]
        before = router.num_routed[1]
        assert len(await _generate_more(engine)) == 4
        assert router.num_routed[1] == before + 1

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


async def _generate_more(engine: AsyncLLM) -> list[int]:
    stream = engine.open_stream()
    engine.add_request("after", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), stream)
    tokens: list[int] = []
    async for out in stream:
        tokens = list(out.outputs[0].token_ids)
    return tokens


async def _until(cond, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.mark.slow
def test_llm_engine_over_one_engine_process_gives_the_in_process_engines_outputs(tiny_dir):
    """LLMEngine(multiprocess_mode=True): the same front end over SyncMPClient and one engine-core process.
    Greedy tokens, a stop string's abort and the metrics (written into the mirrors from the engine's reports)
    equal the in-process engine's; a killed engine process fails the next step with EngineDeadError."""
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.engine.sync_mp_client import SyncMPClient

    here = LLMEngine(_config(tiny_dir))
    there = LLMEngine(_config(tiny_dir), multiprocess_mode=True)

    def run(engine: LLMEngine, stop: list[str] | None = None) -> dict:
        ids = [engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop)) for p in PROMPTS[:4]]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return {i: done[i] for i in ids}

    try:
        assert isinstance(there.client, SyncMPClient)
        want, got = run(here), run(there)
        assert [list(o.outputs[0].token_ids) for o in got.values()] == \
            [list(o.outputs[0].token_ids) for o in want.values()]
        for out in got.values():  # the engine's timestamps reached the mirrors
            m = out.metrics
            assert m.first_scheduled_time and m.first_token_time and m.finished_time
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        text = want[next(iter(want))].outputs[0].text
        assert len(text) > 4, text
        stop = [text[len(text) // 2:len(text) // 2 + 2]]  # a stop string ends it here; the abort frees it there
        cut = run(there, stop)
        assert [o.outputs[0].text for o in cut.values()] == [o.outputs[0].text for o in run(here, stop).values()]
        assert any(o.outputs[0].finish_reason == "stop" for o in cut.values())
        assert not there.has_unfinished_requests()
        with pytest.raises(RuntimeError, match="needs the engine core in this process"):
            there.scheduler  # noqa: B018
        for call in (there.list_loras, lambda: there.remove_lora(1)):  # adapters load per request there
            with pytest.raises(ValueError, match="needs the engine core in this process"):
                call()
        there.add_request(None, {"prompt_token_ids": PROMPTS[5]}, SamplingParams(max_tokens=400, ignore_eos=True))
        os.kill(there.client.client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            for _ in range(1000):
                there.step()
    finally:
        here.close()
        there.close()
