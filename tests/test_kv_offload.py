"""KV offloading (tokenloom/kv_transfer): blocks evicted from the pool come back from the host tier and from
the disk tier with the same greedy tokens and the cached-token counts, across a restart; bad files are
never served; the tiers stay bounded; no connector changes nothing (the replay tests hold the scheduler
to vLLM's decisions with connector None). Tiny random models, float32, so tokens compare exactly."""

from __future__ import annotations

import logging

import pytest

from tests.tiny_models import make_tiny_hf_model, write_gguf_from_hf
from tokenloom import LLM, StructuredOutputsParams
from tokenloom.config import ConfigError, engine_config_from_kwargs
from tokenloom.engine.kv_connectors import data_parallel_kv_transfer
from tokenloom.kv_transfer.offloading.disk import HEADER_BYTES, SUFFIX, DiskFiles
from tokenloom.kv_transfer.offloading.tiers import DiskTier, HostTier
from tokenloom.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * j + 3) % 290 + 5 for j in range(41)]  # 10 full blocks + 1 token
OTHER = [(11 * j + 5) % 290 + 5 for j in range(90)]  # long enough to push PROMPT out of a 32-block pool
EXPECTED_HIT = (len(PROMPT) - 1) // BS * BS  # the last token is always computed


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The tokens without any connector."""
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=BS)
    return {name: _run(llm, p)[0] for name, p in (("prompt", PROMPT), ("other", OTHER))}


def _run(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _llm(tiny_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 32)
    return LLM(str(tiny_dir), dtype="float32", block_size=BS, **kwargs)


def _connector(llm: LLM):
    return llm.llm_engine.kv_connector


def _offload_config(disk_dir=None, host_blocks: int = 64, disk_blocks: int | None = None, block_nbytes=None):
    extra: dict = {"num_cpu_blocks": host_blocks}
    if disk_dir is not None:
        extra["disk_dir"] = str(disk_dir)
        extra["disk_bytes_to_use"] = (disk_blocks or 1000) * (block_nbytes or _block_nbytes()) + 1
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _block_nbytes() -> int:
    from tests.tiny_models import TINY_HEADS, TINY_HIDDEN, TINY_KV_HEADS, TINY_LAYERS

    head_dim = TINY_HIDDEN // TINY_HEADS
    return TINY_LAYERS * 2 * TINY_KV_HEADS * BS * head_dim * 4  # float32


def test_host_tier_serves_a_prompt_evicted_from_the_pool(tiny_dir, reference):
    llm = _llm(tiny_dir, kv_offloading_size=0.01)
    assert _run(llm, PROMPT) == (reference["prompt"], 0)
    assert _run(llm, PROMPT) == (reference["prompt"], EXPECTED_HIT)  # the pool's own prefix hit
    assert _run(llm, OTHER)[0] == reference["other"]  # evicts PROMPT's blocks from the 32-block pool
    sched = llm.llm_engine.scheduler
    assert sched.kv_cache_manager.get_computed_blocks(_request(PROMPT))[1] < EXPECTED_HIT
    tokens, cached = _run(llm, PROMPT)
    assert (tokens, cached) == (reference["prompt"], EXPECTED_HIT)
    stats = _connector(llm).stats
    assert stats.host_hit_tokens > 0 and stats.disk_hit_tokens == 0
    totals = sched.make_stats().connector_prefix_cache_totals
    assert totals.hits == stats.host_hit_tokens and totals.queries > 0


def _request(prompt: list[int]):
    from tokenloom.core.request import Request

    r = Request("probe", prompt, GREEDY)
    r.set_block_size(BS)
    return r


def test_disk_tier_serves_and_survives_a_restart(tiny_dir, reference, tmp_path):
    disk = tmp_path / "kv"
    config = _offload_config(disk, host_blocks=2)  # a host tier too small to keep the prompt
    llm = _llm(tiny_dir, kv_transfer_config=config)
    assert _run(llm, PROMPT) == (reference["prompt"], 0)
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    assert _run(llm, PROMPT) == (reference["prompt"], EXPECTED_HIT)
    assert _connector(llm).stats.disk_hit_tokens > 0
    assert len(list(disk.glob("*" + SUFFIX))) >= EXPECTED_HIT // BS
    llm.llm_engine.close()

    restarted = _llm(tiny_dir, kv_transfer_config=config)
    assert _run(restarted, PROMPT) == (reference["prompt"], EXPECTED_HIT)
    assert _connector(restarted).stats.disk_hit_tokens == EXPECTED_HIT
    restarted.llm_engine.close()


def test_a_second_engine_on_the_same_directory_is_refused(tiny_dir, tmp_path):
    config = _offload_config(tmp_path / "kv")
    llm = _llm(tiny_dir, kv_transfer_config=config)
    with pytest.raises(RuntimeError, match="in use by another engine"):
        _llm(tiny_dir, kv_transfer_config=config)
    llm.llm_engine.close()


def test_another_fingerprint_starts_empty_with_a_log_line(tiny_dir, reference, tmp_path, caplog):
    disk = tmp_path / "kv"
    llm = _llm(tiny_dir, kv_transfer_config=_offload_config(disk))
    _run(llm, PROMPT)
    llm.llm_engine.close()
    assert list(disk.glob("*" + SUFFIX))
    # Another block size: other block hashes and bytes. The files must not survive the change.
    caplog.set_level(logging.WARNING, logger="tokenloom.kv_transfer.offloading.disk")
    other = LLM(str(tiny_dir), dtype="float32", block_size=8, num_blocks=16,
                kv_transfer_config=_offload_config(disk, block_nbytes=2 * _block_nbytes()))
    assert "written under another model or cache options (block_size, kv_tensors differ)" in caplog.text
    assert not list(disk.glob("*" + SUFFIX))
    assert _run(other, PROMPT)[1] == 0
    other.llm_engine.close()


def test_the_fingerprint_names_the_model_overrides(tiny_dir):
    """hf_overrides / disable_sliding_window change the numbers a block holds: they join the KV fingerprint (the disk
    tier and the P/D wire refuse blocks made under others); an engine without them keeps the fingerprint it had."""
    from tokenloom.config import EngineConfig
    from tokenloom.engine.kv_connectors import kv_block_spec
    from tokenloom.model.loader import load_model
    from tokenloom.model.runner import ModelRunner

    runner = ModelRunner(load_model(tiny_dir), block_size=BS, num_blocks=8, dtype="float32", device="cpu")
    plain = kv_block_spec(runner, EngineConfig(), tiny_dir).fingerprint
    over = kv_block_spec(runner, EngineConfig(hf_overrides={"rope_theta": 5e5}, disable_sliding_window=True),
                         tiny_dir).fingerprint
    assert not {"hf_overrides", "disable_sliding_window"} & plain.keys()
    assert over == {**plain, "hf_overrides": '{"rope_theta": 500000.0}', "disable_sliding_window": True}


def test_corrupt_or_truncated_files_are_skipped_never_served(tiny_dir, reference, tmp_path, caplog):
    disk = tmp_path / "kv"
    config = _offload_config(disk, host_blocks=2)
    llm = _llm(tiny_dir, kv_transfer_config=config)
    _run(llm, PROMPT)
    llm.llm_engine.close()
    req = _request(PROMPT)
    files = DiskFiles(disk, b"", _block_nbytes())
    # Block 3: one payload byte flipped (passes the start-up header check, fails the checksum at lookup).
    path3 = files.path(req.block_hashes[3])
    data = bytearray(path3.read_bytes())
    data[HEADER_BYTES + 100] ^= 0xFF
    path3.write_bytes(bytes(data))
    # Block 6: cut short (dropped at start-up).
    path6 = files.path(req.block_hashes[6])
    path6.write_bytes(path6.read_bytes()[:HEADER_BYTES + 10])
    caplog.set_level(logging.WARNING, logger="tokenloom.kv_transfer.offloading.disk")
    restarted = _llm(tiny_dir, kv_transfer_config=config)
    assert not path6.exists() and "expected" in caplog.text
    tokens, cached = _run(restarted, PROMPT)
    assert tokens == reference["prompt"]
    assert cached == 3 * BS  # blocks 0-2 from disk; block 3 is bad, so the hit ends there
    assert "checksum mismatch" in caplog.text
    # The blocks recomputed from block 3 on were written again (whole files): the next lookup hits them all.
    assert restarted.llm_engine.scheduler.reset_prefix_cache()
    assert _run(restarted, PROMPT) == (reference["prompt"], EXPECTED_HIT)
    restarted.llm_engine.close()


def test_the_tiers_stay_within_their_bounds(tiny_dir, reference, tmp_path):
    disk = tmp_path / "kv"
    llm = _llm(tiny_dir, kv_transfer_config=_offload_config(disk, host_blocks=5, disk_blocks=7))
    for seed in range(4):
        _run(llm, [(seed * 13 + 3 * j) % 290 + 5 for j in range(41)])
    conn = _connector(llm)
    assert len(conn.host) <= 5
    assert len(conn.disk) <= 7 and len(list(disk.glob("*" + SUFFIX))) <= 7
    assert conn.stats.disk_files_evicted > 0
    # The most recent prompt's first blocks are still on disk: a new engine finds them.
    llm.llm_engine.close()
    restarted = _llm(tiny_dir, kv_transfer_config=_offload_config(disk, host_blocks=5, disk_blocks=7))
    assert len(_connector(restarted).disk) == len(list(disk.glob("*" + SUFFIX)))
    restarted.llm_engine.close()


@pytest.mark.parametrize("options", [
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
    {"async_scheduling": True,
     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill: blocks are stored chunk by chunk
], ids=["async", "ngram", "async-ngram", "chunked"])
def test_offloading_combines(tiny_dir, reference, options):
    llm = _llm(tiny_dir, kv_offloading_size=0.01, **options)
    assert _run(llm, PROMPT)[0] == reference["prompt"]
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    assert _run(llm, PROMPT) == (reference["prompt"], EXPECTED_HIT)
    # A prompt that repeats itself: drafts are accepted, and the tier's blocks are verified tokens only.
    looped = PROMPT[:12] * 4
    first = _run(llm, looped, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    again, cached = _run(llm, looped + first[:12], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ref = _llm(tiny_dir, num_blocks=256)
    assert again == _run(ref, looped + first[:12], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert cached >= len(looped) // BS * BS
    # Nothing left pending once the engine is idle: every step's stores came back and were made hits.
    conn = _connector(llm)
    assert not conn._in_flight and not conn.host._pending and not conn._staged and not conn._requests


def test_structured_outputs_on_tier_hits(tiny_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    ref = _run(_llm(tiny_dir, num_blocks=256), PROMPT, params)[0]
    llm = _llm(tiny_dir, kv_offloading_size=0.01)
    assert _run(llm, PROMPT, params)[0] == ref
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    assert _run(llm, PROMPT, params) == (ref, EXPECTED_HIT)


def test_quantized_gguf_weights(tiny_dir, tmp_path):
    """Q8_0 weights kept quantized (the default for a quantized GGUF): a tier hit gives the pool hit's tokens
    (both compute the last token alone over the same KV bytes); the quantization is in the fingerprint."""
    path = write_gguf_from_hf(tiny_dir, tmp_path / "tiny-q8.gguf", qtype="Q8_0")
    llm = LLM(str(path), num_blocks=32, block_size=BS, kv_offloading_size=0.01)
    assert llm.llm_engine.config.quantization == "gguf"
    _run(llm, PROMPT)
    pool_hit = _run(llm, PROMPT)
    assert pool_hit[1] == EXPECTED_HIT
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    assert _run(llm, PROMPT) == pool_hit
    assert _connector(llm).spec.fingerprint["quantization"] == "gguf"


def test_refused_combinations_say_why(tiny_dir):
    with pytest.raises(ConfigError, match="enable-prefix-caching"):
        _llm(tiny_dir, kv_offloading_size=0.01, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="not a tokenloom connector"):
        _llm(tiny_dir, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    with pytest.raises(ConfigError, match="not both"):
        engine_config_from_kwargs(kv_offloading_size=1, kv_transfer_config={"kv_connector": "OffloadingConnector",
                                                                            "kv_role": "kv_producer"})
    with pytest.raises(ConfigError, match="kv_role must be set"):
        engine_config_from_kwargs(kv_transfer_config={"kv_connector": "OffloadingConnector"})
    with pytest.raises(ConfigError, match="need kv_offloading_size"):
        engine_config_from_kwargs(kv_offloading_dir="/tmp/x")
    with pytest.raises(ConfigError, match="cpu_bytes_to_use must be a number"):
        _llm(tiny_dir, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                           "kv_connector_extra_config": {"cpu_bytes_to_use": "lots"}})
    with pytest.raises(ConfigError, match="at least one block"):
        _llm(tiny_dir, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                           "kv_connector_extra_config": {"cpu_bytes_to_use": 100}})
    # A pooling model keeps no KV: refused before loading, encoder (no KV cache at all) and decoder alike.
    from tests.pooling_models import make_tiny_bert

    with pytest.raises(ConfigError, match="not supported with --runner pooling"):
        LLM(str(make_tiny_bert(tiny_dir.parent / "bert")), dtype="float32", kv_offloading_size=0.01)
    with pytest.raises(ConfigError, match="not supported with --runner pooling"):
        _llm(tiny_dir, runner="pooling", kv_offloading_size=0.01)
    # Hybrid KV cache groups (Gemma 2's windowed + full layers): connectors run one group.
    gemma2 = make_tiny_hf_model(tiny_dir.parent / "gemma2", arch="gemma2", seed=3)
    with pytest.raises(ConfigError, match="mixes sliding-window and full-attention"):
        LLM(str(gemma2), dtype="float32", kv_offloading_size=0.01)
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config"):
        _llm(tiny_dir, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                           "kv_connector_extra_config": {"cpu_bytes": 1}})


def test_data_parallel_engines_get_a_directory_each(tmp_path):
    config = engine_config_from_kwargs(kv_offloading_size=1, kv_offloading_dir=str(tmp_path), data_parallel_size=2)
    dirs = [data_parallel_kv_transfer(config, i).kv_transfer_config.kv_connector_extra_config["disk_dir"]
            for i in range(2)]
    assert dirs == [str(tmp_path / "dp0"), str(tmp_path / "dp1")]
    producer = engine_config_from_kwargs(kv_transfer_config=_shared(tmp_path, "kv_producer"), data_parallel_size=2)
    with pytest.raises(ConfigError, match="runs as one engine core"):
        data_parallel_kv_transfer(producer, 0)


def test_host_tier_lru_and_pending_entries():
    tier = HostTier(2)
    a, b = tier.allocate(1), tier.allocate(2)
    assert tier.lookup(1) is None  # pending: its bytes are not there yet
    assert tier.allocate(3) is None  # every slot pending
    tier.complete([1, 2])
    assert tier.lookup(1) == a  # 1 is now the most recent
    assert tier.allocate(3) == b  # so 2 is evicted
    tier.abort([3])
    assert 3 not in tier and len(tier) == 1


def test_disk_tier_bounds_and_recency():
    tier = DiskTier(capacity_bytes=3 * 100, file_bytes=100, existing=[10, 11, 12])
    tier.touch(10)
    ok, evicted = tier.reserve(13)
    assert ok and evicted == [11]
    assert len(tier) == 3
    assert DiskTier(capacity_bytes=150, file_bytes=100, existing=[1, 2, 3]).over_capacity() == [1, 2]


def test_block_hashes_mean_the_same_in_every_process():
    """The disk tier files blocks by block hash, so a hash must not depend on the process (hash(None) did)."""
    import subprocess
    import sys

    code = "from tokenloom.core.request import Request, SamplingParams\n" \
           "r = Request('x', list(range(40)), SamplingParams()); r.set_block_size(4); print(r.block_hashes)"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_data_parallel_engines_offload_to_their_own_directories(tiny_dir, reference, tmp_path):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", num_blocks=32, block_size=BS, data_parallel_size=2,
              routing_policy="round_robin", kv_offloading_size=0.01, kv_offloading_dir=str(tmp_path))
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.client.scheduler_stats
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference["prompt"]] * 2
    # Each engine wrote its own disk tier: every full block it computed (the last sampled token is never fed).
    for rank in (0, 1):
        assert len(list((tmp_path / f"dp{rank}").glob("*" + SUFFIX))) == (len(PROMPT) + GREEDY.max_tokens - 1) // BS
    assert stats.connector_prefix_cache_totals is not None and stats.connector_prefix_cache_totals.queries > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_resume_from_the_tiers(tiny_dir, async_scheduling):
    """Six requests in a 24-block pool preempt each other; a resumed request finds its blocks (prompt and
    outputs) in the host tier. Tokens equal a roomy engine's; nothing leaks (the autouse leak check)."""
    prompts = [[(s * 17 + 5 * j) % 290 + 5 for j in range(30)] for s in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _llm(tiny_dir, num_blocks=256)
    want = [list(o.outputs[0].token_ids) for o in
            ref.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = _llm(tiny_dir, num_blocks=24, kv_offloading_size=0.01, async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions_total > 0
    assert sched.make_stats().connector_prefix_cache_totals.preempted_hits > 0  # counted apart, as vLLM


def _shared(path, role: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.mark.parametrize("options", [
    {},
    {"async_scheduling": True,
     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["plain", "async-ngram"])
def test_shared_storage_handoff_between_two_engines(tiny_dir, reference, tmp_path, options):
    """The prefill/decode flow of tests/test_pd_handoff.py without the servers: kv_transfer_params in through
    SamplingParams.extra_args, out through RequestOutput.kv_transfer_params."""
    prefill = _llm(tiny_dir, kv_transfer_config=_shared(tmp_path, "kv_producer"))
    decode = _llm(tiny_dir, kv_transfer_config=_shared(tmp_path, "kv_consumer"), **options)
    first = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = prefill.generate([{"prompt_token_ids": PROMPT}], first, use_tqdm=False)[0]
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_storage_path"] == str(tmp_path)
    assert params["remote_prefill_cached_tokens"] == 0  # the prefill engine's own hit, reported by the decode engine
    then = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"kv_transfer_params": params})
    got = decode.generate([{"prompt_token_ids": PROMPT}], then, use_tqdm=False)[0]
    assert (list(got.outputs[0].token_ids), got.num_cached_tokens) == (reference["prompt"], 0)
    assert decode.llm_engine.scheduler.make_stats().connector_prefix_cache_totals.hits == EXPECTED_HIT
    # Without kv_transfer_params the decode engine computes the prompt itself (other tokens, no loads).
    other = decode.generate([{"prompt_token_ids": OTHER}], GREEDY, use_tqdm=False)[0]
    assert (list(other.outputs[0].token_ids), other.num_cached_tokens) == (reference["other"], 0)
    # A plain request on the prefill engine writes nothing and returns no kv_transfer_params.
    files = len(list(tmp_path.glob("*" + SUFFIX)))
    plain = prefill.generate([{"prompt_token_ids": OTHER}], GREEDY, use_tqdm=False)[0]
    assert plain.kv_transfer_params is None and len(list(tmp_path.glob("*" + SUFFIX))) == files
    prefill.llm_engine.close()


def test_shared_storage_consumer_of_another_fingerprint_loads_nothing(tiny_dir, tmp_path, caplog):
    prefill = _llm(tiny_dir, kv_transfer_config=_shared(tmp_path, "kv_producer"))
    first = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    params = prefill.generate([{"prompt_token_ids": PROMPT}], first, use_tqdm=False)[0].kv_transfer_params
    caplog.set_level(logging.WARNING, logger="tokenloom.kv_transfer.shared_storage")
    decode = LLM(str(tiny_dir), dtype="float32", block_size=8, num_blocks=16,  # other blocks, other bytes
                 kv_transfer_config=_shared(tmp_path, "kv_consumer"))
    then = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, extra_args={"kv_transfer_params": params})
    assert decode.generate([{"prompt_token_ids": PROMPT}], then, use_tqdm=False)[0].num_cached_tokens == 0
    assert "another model or cache options" in caplog.text
    prefill.llm_engine.close()
