"""Async scheduling end to end on the default model (SmolLM2-135M-Instruct): greedy outputs equal
the synchronous engine's (chat prompts, EOS, max_tokens, stop strings, n > 1, a busy batch with
preemption), stop strings and aborts with a step in flight, no leaked KV blocks, a failing step
ending only its own requests, and the step trace showing the overlap.

One model load: the same engine switches between sync and async with reset_scheduler (the runner
moves into / out of its worker thread), which also makes the comparison exact (same weights)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tokenloom.config import SchedulerConfig
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

CHATS = [
    "What is the capital of France?",
    "What is 12 times 7? Answer with the number only.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    # The dequantized path: sync and async runs of one engine are compared token for token, the second
    # with the first's prompts in the prefix cache, which the default quantized kernels do not promise
    # to compute alike (docs/speculative.md, "Greedy outputs and the quantized default").
    llm = LLM(max_num_batched_tokens=512, num_blocks=512, trace_steps=str(trace), quantization="none",
              dtype="float32")
    llm.trace_path = trace
    yield llm
    llm.llm_engine.close()


def _mode(llm: LLM, async_scheduling: bool, **knobs) -> None:
    engine = llm.llm_engine
    base = SchedulerConfig(max_model_len=engine.scheduler_config.max_model_len)
    engine.reset_scheduler(replace(base, async_scheduling=async_scheduling, **knobs))
    assert (engine.executor.max_concurrent_batches == 2) == async_scheduling


def _both(llm: LLM, prompts, params, **knobs):
    """(sync outputs, async outputs), each checked for leaked blocks."""
    results = []
    for async_scheduling in (False, True):
        _mode(llm, async_scheduling, **knobs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        engine.engine_core.drain()
        kv = engine.scheduler.kv_cache_manager
        assert kv.block_pool.get_num_free_blocks() == kv.num_blocks, "KV blocks leaked"
        results.append(outs)
    return results


def _chats(llm: LLM, chats=CHATS):
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": c}],
                                                         add_generation_prompt=True, tokenize=True)}
            for c in chats]  # fmt: skip


def _key(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_greedy_chat_outputs_identical_with_eos_and_max_tokens(llm) -> None:
    sync, asy = _both(llm, _chats(llm), GREEDY)
    assert _key(asy) == _key(sync)
    reasons = {o.outputs[0].finish_reason for o in sync}
    assert reasons == {"stop", "length"}  # some end by EOS, some by max_tokens


def test_stop_string_with_the_next_step_in_flight_returns_the_sync_text(llm) -> None:
    prompts = _chats(llm, CHATS[:3])
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    stops = [o.outputs[0].text[8:11] for o in base]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[s]) for s in stops]
    sync, asy = _both(llm, prompts, params)
    assert _key(asy) == _key(sync)
    assert all(o.outputs[0].finish_reason == "stop" for o in asy)


def test_n_greater_than_one_and_max_tokens_one(llm) -> None:
    prompts = _chats(llm, CHATS[:2])
    # n > 1 samples (vLLM refuses n > 1 with greedy sampling): seeded, so both modes draw the same tokens.
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=5, n=2)
    sync, asy = _both(llm, prompts, params)
    assert _key(asy) == _key(sync)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    sync, asy = _both(llm, prompts, one)
    assert _key(asy) == _key(sync) and all(len(o.outputs[0].token_ids) == 1 for o in asy)


def test_busy_batch_with_chunking_and_preemption(llm) -> None:
    prompts = _chats(llm) + [{"prompt_token_ids": list(range(1000, 1000 + 40 + 7 * i))} for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    knobs = {"max_num_batched_tokens": 48, "max_num_seqs": 8}
    engine = llm.llm_engine
    # 14 blocks of 16 tokens: four requests are admitted, then their growth forces preemptions.
    small = replace(engine.cache_config, num_blocks=14)
    engine.reset_scheduler(cache_config=small)
    try:
        sync, asy = _both(llm, prompts, params, **knobs)
    finally:
        _mode(llm, False)
        engine.reset_scheduler(cache_config=replace(small, num_blocks=512))
    assert _key(asy) == _key(sync)
    assert sum(o.metrics.num_preemptions for o in asy) > 0


def test_abort_with_a_step_in_flight_frees_blocks_and_the_engine_goes_on(llm) -> None:
    _mode(llm, True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rid = engine.add_request(None, "Tell me a long story.", params)
    other = engine.add_request(None, "Count to twenty:", SamplingParams(temperature=0.0, max_tokens=8))
    produced = 0
    while produced < 3:
        for out in engine.step():
            if out.request_id == rid:
                produced = len(out.outputs[0].token_ids)
    assert engine.engine_core.batch_queue  # a step is in flight
    engine.abort_request(rid)
    kv = engine.scheduler.kv_cache_manager
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != rid  # its late tokens never reach the client
            if out.finished:
                done[out.request_id] = out
    assert done[other].outputs[0].finish_reason == "length"
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    _mode(llm, False)


def test_a_failing_step_ends_only_its_own_requests(llm, monkeypatch) -> None:
    _mode(llm, True)
    engine = llm.llm_engine
    runner = engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(so, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step of the first request
            raise RuntimeError("planted failure")
        return real(so, **kw)

    monkeypatch.setattr(runner, "execute_model", flaky)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = engine.add_request(None, "One two three", params)
    finals = {}
    while engine.has_unfinished_requests():
        if calls["n"] >= 3 and "late" not in finals and len(finals) < 2:
            finals["late"] = engine.add_request(None, "Four five six", params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[first].outputs[0].finish_reason == "error"
    assert finals[finals["late"]].outputs[0].finish_reason == "length"
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    monkeypatch.undo()
    _mode(llm, False)


def test_step_trace_shows_scheduling_overlapping_execution(llm) -> None:
    _mode(llm, True)
    engine = llm.llm_engine
    start = engine.tracer.num_steps
    llm.generate(_chats(llm, CHATS[:2]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    engine.engine_core.drain()
    engine.tracer._file.flush()
    records = [json.loads(line) for line in llm.trace_path.read_text().splitlines()][start:]
    decodes = [r for r in records if r["budget_used"] and not r["prefill"]]
    assert len(decodes) >= 8
    for r in records:
        assert r["t_start"] <= r["t_scheduled"] <= r["t_wait"] <= r["t_update"] <= r["t_end"]
    # Step N+1 was scheduled while step N executed: its schedule ends before N's execution does.
    overlapped = sum(1 for a, b in zip(records, records[1:]) if b["t_scheduled"] < a["t_exec_end"])
    assert overlapped >= len(decodes) // 2
    # The timeline draws each step's execute and host time, with the overlapped share hatched.
    from tokenloom.bench.plot_common import step_intervals
    from tokenloom.bench.timeline_svg import timeline_html

    rows = step_intervals(records)
    assert rows is not None and sum(hidden for _, _, hidden in rows) > 0
    assert "exec / host (ms)" in timeline_html(records)
    _mode(llm, False)


def test_an_engine_built_for_async_loads_and_steps_its_model_on_one_thread(monkeypatch) -> None:
    """One OpenMP team: the weights are loaded, the runner built and every step run (async and, after
    reset_scheduler, sync) on the engine's model thread, never on the engine thread."""
    import threading

    import tokenloom.model.loader as loader

    load_idents: list[int] = []
    real_load = loader.load_model

    def recording_load(*args, **kwargs):
        load_idents.append(threading.get_ident())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", recording_load)
    llm = LLM(async_scheduling=True, max_num_batched_tokens=256, num_blocks=128)
    engine = llm.llm_engine
    try:
        owner = engine._model_thread.call(threading.get_ident)
        assert load_idents == [owner] and owner != threading.get_ident()
        step_idents: set[int] = set()
        real_execute = engine.runner.execute_model

        def recording_execute(so, **kw):
            step_idents.add(threading.get_ident())
            return real_execute(so, **kw)

        monkeypatch.setattr(engine.runner, "execute_model", recording_execute)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async_out = llm.generate(["One two three"], params, use_tqdm=False)
        _mode(llm, False)
        sync_out = llm.generate(["One two three"], params, use_tqdm=False)
        assert step_idents == {owner}
        assert _key(async_out) == _key(sync_out)
    finally:
        engine.close()
