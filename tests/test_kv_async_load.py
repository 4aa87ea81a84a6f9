"""Asynchronous KV loads (vLLM's WAITING_FOR_REMOTE_KVS): with kv_connector_extra_config.load_async a hit
that needs files (the offloading connector's disk tier, the shared-storage P/D hand-off) is loaded on a
background thread while the request waits with its blocks allocated. Tokens equal the synchronous load's
(and a connector-less engine's); a request aborted while loading frees its blocks once the load is done;
a file that fails its check is recomputed (or fails the request with kv_load_failure_policy "fail"); no
block leaks (the autouse leak check, and explicit counts). Tiny random models, float32."""

from __future__ import annotations

import struct
import threading
import time
import zlib

import pytest

from tests.test_kv_offload import BS, EXPECTED_HIT, GREEDY, OTHER, PROMPT, _offload_config, _request, _run, _shared
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM
from tokenloom.config import ConfigError
from tokenloom.core.request import RequestStatus
from tokenloom.kv_transfer.offloading.disk import HEADER_BYTES, file_name
from tokenloom.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=BS)
    return {name: _run(llm, p)[0] for name, p in (("prompt", PROMPT), ("other", OTHER))}


def _disk_config(disk_dir, **extra) -> dict:
    config = _offload_config(disk_dir, host_blocks=1)  # a one-block host tier: hits come from the files
    config["kv_connector_extra_config"].update(load_async=True, **extra)
    return config


def _llm(tiny_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 32)
    return LLM(str(tiny_dir), dtype="float32", block_size=BS, **kwargs)


def _step_until_done(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int, set]:
    """Generate step by step: (tokens, cached tokens, the statuses the request went through)."""
    engine = llm.llm_engine
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    statuses: set[RequestStatus] = set()
    for _ in range(10_000):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.outputs[0].token_ids), out.num_cached_tokens, statuses
        for request in engine.scheduler.requests.values():
            statuses.add(request.status)
    raise AssertionError("the request never finished")


def _pool_in_use(llm: LLM) -> int:
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    return pool.num_blocks - pool.get_num_free_blocks()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_a_disk_hit_loads_in_the_background_with_the_same_tokens(tiny_dir, reference, tmp_path, async_scheduling):
    llm = _llm(tiny_dir, kv_transfer_config=_disk_config(tmp_path / "kv"), async_scheduling=async_scheduling)
    assert _run(llm, PROMPT) == (reference["prompt"], 0)
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    tokens, cached, statuses = _step_until_done(llm, PROMPT)
    assert (tokens, cached) == (reference["prompt"], EXPECTED_HIT)
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses  # it waited for its KV, not loaded in the step
    assert llm.llm_engine.kv_connector.stats.disk_hit_tokens == EXPECTED_HIT
    # The loaded blocks entered the prefix cache once the load was done: a repeat is a pool hit.
    assert _run(llm, PROMPT) == (reference["prompt"], EXPECTED_HIT)
    assert _pool_in_use(llm) == 0
    llm.llm_engine.close()


def test_other_requests_run_while_a_load_waits(tiny_dir, reference, tmp_path):
    """A request decoding keeps stepping while another one's KV loads (the point of loading asynchronously)."""
    llm = _llm(tiny_dir, kv_transfer_config=_disk_config(tmp_path / "kv"), num_blocks=64)
    _run(llm, PROMPT)
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": OTHER}, {"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference["other"], reference["prompt"]]
    assert outs[1].num_cached_tokens == EXPECTED_HIT
    llm.llm_engine.close()


def test_a_request_aborted_while_loading_frees_its_blocks_when_the_load_ends(tiny_dir, reference, tmp_path):
    llm = _llm(tiny_dir, kv_transfer_config=_disk_config(tmp_path / "kv"))
    _run(llm, PROMPT)
    engine = llm.llm_engine
    assert engine.scheduler.reset_prefix_cache()
    # Hold the loader's one thread so the load is still running when the request is aborted.
    gate = threading.Event()
    engine.runner.kv_connector._loader._pool.submit(gate.wait)
    try:
        rid = engine.add_request(None, {"prompt_token_ids": PROMPT}, GREEDY)
        engine.step()
        (request,) = engine.scheduler.requests.values()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        held = _pool_in_use(llm)
        assert held >= EXPECTED_HIT // BS
        # A reset cannot take blocks a load still writes: it says no instead of raising.
        assert engine.scheduler.reset_prefix_cache(reset_running_requests=True) is False
        engine.abort_request(rid)
        for _ in range(3):
            engine.step()
        # The worker still writes those blocks: they are not handed to anyone else yet.
        assert _pool_in_use(llm) == held and engine.scheduler.aborted_while_loading
        assert engine.scheduler.reset_prefix_cache(reset_running_requests=True) is False
    finally:
        gate.set()
    deadline = time.monotonic() + 30
    while engine.scheduler.aborted_while_loading and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    assert not engine.scheduler.aborted_while_loading and _pool_in_use(llm) == 0
    assert not engine.has_unfinished_requests()
    # Nothing half-loaded was cached: the next request loads again and gets the same tokens.
    assert _run(llm, PROMPT) == (reference["prompt"], EXPECTED_HIT)
    llm.llm_engine.close()


def _corrupt(disk_dir, prompt: list[int], block_index: int) -> None:
    """Overwrite a block file's payload (same length, so only its checksum can tell)."""
    path = disk_dir / file_name(_request(prompt).block_hashes[block_index])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES:] = bytes((b + 101) % 256 for b in data[HEADER_BYTES:])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("bad_block", [0, 3])
def test_a_failed_background_load_is_recomputed_never_served(tiny_dir, reference, tmp_path, bad_block, caplog):
    disk = tmp_path / "kv"
    llm = _llm(tiny_dir, kv_transfer_config=_disk_config(disk))
    _run(llm, PROMPT)
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    _corrupt(disk, PROMPT, bad_block)
    tokens, cached, statuses = _step_until_done(llm, PROMPT)
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses
    # The blocks before the bad one loaded; from it on the prompt was computed.
    assert (tokens, cached) == (reference["prompt"], bad_block * BS)
    assert "checksum mismatch" in caplog.text
    # The bad file was dropped, and the recomputed block written again: a valid file now.
    data = (disk / file_name(_request(PROMPT).block_hashes[bad_block])).read_bytes()
    assert zlib.crc32(data[HEADER_BYTES:]) == struct.unpack_from("<I", data, HEADER_BYTES - 8)[0]  # crc32, pad (4)
    assert llm.llm_engine.kv_connector.stats.disk_hit_tokens == bad_block * BS
    assert _pool_in_use(llm) == 0
    llm.llm_engine.close()


def test_kv_load_failure_policy_fail_ends_the_request_with_an_error(tiny_dir, tmp_path):
    disk = tmp_path / "kv"
    config = dict(_disk_config(disk), kv_load_failure_policy="fail")
    llm = _llm(tiny_dir, kv_transfer_config=config)
    _run(llm, PROMPT)
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    _corrupt(disk, PROMPT, 2)
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and list(out.outputs[0].token_ids) == []
    assert _pool_in_use(llm) == 0
    llm.llm_engine.close()


@pytest.mark.parametrize("options", [
    {},
    {"async_scheduling": True,
     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["plain", "async-ngram"])
def test_shared_storage_handoff_loads_in_the_background(tiny_dir, reference, tmp_path, options):
    prefill = _llm(tiny_dir, kv_transfer_config=_shared(tmp_path, "kv_producer"))
    consumer = _shared(tmp_path, "kv_consumer")
    consumer["kv_connector_extra_config"]["load_async"] = True
    decode = _llm(tiny_dir, kv_transfer_config=consumer, **options)
    first = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    params = prefill.generate([{"prompt_token_ids": PROMPT}], first, use_tqdm=False)[0].kv_transfer_params
    then = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"kv_transfer_params": params})
    # The request's cached tokens are the prefill engine's own hit (vLLM's remote_prefill_cached_tokens: none, the
    # prompt was new there); what the decode engine loaded, its connector counts.
    assert params["remote_prefill_cached_tokens"] == 0
    connector = decode.llm_engine.kv_connector
    tokens, cached, statuses = _step_until_done(decode, PROMPT, then)
    assert (tokens, cached, connector.loaded_tokens) == (reference["prompt"], 0, EXPECTED_HIT)
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses
    # A bad file on the way: the decode engine computes from that block on, same tokens.
    assert decode.llm_engine.scheduler.reset_prefix_cache()
    _corrupt(tmp_path, PROMPT, 4)
    tokens, cached, _ = _step_until_done(decode, PROMPT, then)
    # Every block but the bad one arrived (the blocks after it are loaded, then recomputed with it).
    assert (tokens, cached, connector.loaded_tokens) == (reference["prompt"], 0, 2 * EXPECTED_HIT - BS)
    assert _pool_in_use(decode) == 0
    prefill.llm_engine.close()
    decode.llm_engine.close()


def test_load_async_must_be_a_boolean(tiny_dir, tmp_path):
    config = _disk_config(tmp_path / "kv")
    config["kv_connector_extra_config"]["load_async"] = "yes"
    with pytest.raises(ConfigError, match="load_async must be true or false"):
        _llm(tiny_dir, kv_transfer_config=config)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_preempted_requests_resume_through_background_loads(tiny_dir, tmp_path, async_scheduling):
    """Six requests in a 24-block pool preempt each other; a resumed request's blocks come back from the
    disk tier in the background. Tokens equal a roomy engine's; nothing leaks (the autouse leak check)."""
    prompts = [[(s * 17 + 5 * j) % 290 + 5 for j in range(30)] for s in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _llm(tiny_dir, num_blocks=256)
    want = [list(o.outputs[0].token_ids) for o in
            ref.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = _llm(tiny_dir, num_blocks=24, kv_transfer_config=_disk_config(tmp_path / "kv"),
               async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions_total > 0
    assert llm.llm_engine.kv_connector.stats.disk_hit_tokens > 0
    assert sched.make_stats().connector_prefix_cache_totals.preempted_hits > 0  # resumed through loads
    assert not sched.loaded_kv_tokens and _pool_in_use(llm) == 0
    llm.llm_engine.close()


@pytest.mark.timeout(120)
def test_requests_holding_loaded_blocks_never_deadlock_the_pool(tiny_dir, tmp_path):
    """Four histories come back from disk at once into a pool that holds the blocks of one and a half: the
    parked loads take most of the pool, and a promoted request that cannot grow gives its (now cached)
    blocks back instead of waiting on blocks other waiting requests hold. All finish, tokens equal a roomy
    engine's."""
    histories = [[(s * 31 + 7 * j) % 290 + 5 for j in range(44)] for s in range(4)]
    turns = [h + [(s * 13 + 3 * j) % 290 + 5 for j in range(12)] for s, h in enumerate(histories)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = _llm(tiny_dir, num_blocks=256)
    want = [list(o.outputs[0].token_ids) for o in
            ref.generate([{"prompt_token_ids": p} for p in turns], params, use_tqdm=False)]
    # (Without the full-prompt reservation, admissions may take blocks the rest of a prompt needs.)
    llm = _llm(tiny_dir, num_blocks=24, kv_transfer_config=_disk_config(tmp_path / "kv"),
               scheduler_reserve_full_isl=False)
    for h in histories:  # the histories' blocks go to disk
        _run(llm, h)
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in turns], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert llm.llm_engine.kv_connector.stats.disk_hit_tokens > 0
    assert _pool_in_use(llm) == 0
    llm.llm_engine.close()
