"""Suffix decoding (`{"method": "suffix"}`, vLLM's SuffixDecodingProposer over arctic-inference):
vLLM's option names, defaults and errors; the proposer's bookkeeping (drafts from another request's
output, requests outside the batch stopped and restarted from their prompt, max_model_len caps);
greedy outputs token-identical with and without it (a busy tiny-model batch with chunked prefill and
preemption; the default model), a repeated request accepting the drafts that n-gram cannot offer,
and no leaked KV blocks. Also the start-up checks of the token budget against 1 + K.

The tests that need the suffix trees skip when arctic-inference is not installed (`make test`
installs it: Makefile, .suffix-installed)."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom.config import (
    ConfigError,
    SchedulerConfig,
    SpeculativeConfig,
    check_verification_budget,
    has_arctic_inference,
)
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

needs_arctic = pytest.mark.skipif(
    not has_arctic_inference(), reason="arctic-inference is not installed (the suffix-tree library; `make test` "
    "builds it: Makefile target .venv/.suffix-installed)")


def _free_all(llm: LLM) -> bool:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    return kv.block_pool.get_num_free_blocks() == kv.num_blocks


# Options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,field", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth=0 must be >= 1"),
    ({"suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth must be an integer"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests=-1 must be >= 0"),
    ({"suffix_decoding_max_cached_requests": 2**31}, "suffix_decoding_max_cached_requests=2147483648"),
    ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor=-0.5 must be >= 0"),
    ({"suffix_decoding_max_spec_factor": "big"}, "suffix_decoding_max_spec_factor must be a number"),
    ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob=1.5 must be in \[0, 1\]"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"suffix_decoding_tree_depth": 8}, "unknown field.*suffix_decoding_tree_depth"),
])
def test_bad_suffix_options_name_the_field(bad, field):
    # Checked before the library is looked for: these errors show whether or not it is installed.
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig.from_any({"method": "suffix", **bad})


def test_suffix_without_the_library_says_how_to_install(monkeypatch):
    import tokenloom.config as config

    monkeypatch.setattr(config, "has_arctic_inference", lambda: False)
    with pytest.raises(ConfigError, match="Arctic Inference is required for suffix decoding.*arctic-inference==0.3.0"):
        SpeculativeConfig(method="suffix")


@needs_arctic
def test_suffix_defaults_are_vllms():
    c = SpeculativeConfig.from_any('{"method": "suffix"}')
    assert (c.num_speculative_tokens, c.model) == (24, "suffix")  # K defaults to the tree depth
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    assert SpeculativeConfig(method="suffix", num_speculative_tokens=4).num_speculative_tokens == 4


@needs_arctic
def test_suffix_with_async_scheduling_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="async scheduling is only supported.*'suffix'"):
        LLM(str(tmp_path / "no-such-model"), async_scheduling=True, speculative_config={"method": "suffix"})


# Start-up checks of the budget ----------------------------------------------------------------
def test_budget_below_one_verification_is_refused_by_the_engine(tmp_path):
    missing = str(tmp_path / "no-such-model")  # the check runs before loading
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=4 is below 1 \+ num_speculative_tokens = 5"):
        LLM(missing, max_num_batched_tokens=4, max_num_seqs=4, speculative_config=spec)
    check_verification_budget(5, SpeculativeConfig(method="ngram", num_speculative_tokens=4))  # fits exactly
    check_verification_budget(1, None)

    from tokenloom.config import CacheConfig
    from tokenloom.sim.simulate import simulate  # the simulator refuses what the engine refuses

    with pytest.raises(ConfigError, match="max_num_batched_tokens=4 is below"):
        simulate([], SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4), CacheConfig(num_blocks=10),
                 None, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=4))


def test_replay_keeps_vllms_stall_for_a_budget_below_one_verification():
    """The replay runs what vLLM runs: the second request, whose prompt the prefix cache holds, is
    padded to 1 + K = 5 tokens, which never fit a budget of 4; vLLM stalls, so does the replay."""
    from tokenloom.core.replay import replay

    prompt = [1, 2, 3, 4, 5, 6, 8, 10, 11]
    trace = {"config": {"max_num_batched_tokens": 4, "max_num_seqs": 2, "enable_chunked_prefill": True,
                        "long_prefill_token_threshold": 0, "block_size": 4, "num_blocks": 50, "policy": "fcfs",
                        "enable_prefix_caching": True, "max_model_len": 48, "num_speculative_tokens": 4},
             "requests": [{"id": "a", "arrival_step": 0, "prompt_token_ids": prompt, "max_tokens": 2},
                          {"id": "b", "arrival_step": 6, "prompt_token_ids": prompt, "max_tokens": 2}]}
    summary = replay(trace)["summary"]
    assert summary["stalled"] and summary["unfinished"] == ["b"]
    assert SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=2).max_num_batched_tokens == 4


# The proposer -----------------------------------------------------------------------------------
def _proposer(k=8, depth=24, cached=100, factor=1.0, prob=0.1, max_model_len=200):
    from tokenloom.spec_decode.suffix_proposer import SuffixProposer

    return SuffixProposer(k, depth, cached, factor, prob, max_model_len)


def _step(p, sampled: dict[str, list[int]], batch=None):
    for rid, toks in sampled.items():
        p.append_tokens(rid, toks)
    ids = [r for r, t in sampled.items() if t]
    return dict(zip(ids, p.propose(ids, batch_req_ids=batch if batch is not None else list(sampled))))


@needs_arctic
def test_drafts_come_from_another_requests_output():
    p = _proposer()
    out = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    p.add_request("a", [1, 2, 3], num_prompt_tokens=3)
    for t in out:
        _step(p, {"a": [t]})
    p.remove_request("a")  # finished: its output stays in the global tree
    p.add_request("b", [7, 8, 9], num_prompt_tokens=3)  # nothing of it in b's own context
    assert _step(p, {"b": [50]}) == {"b": [51]}  # a 1-token match drafts at most 1 token (spec factor 1)
    assert _step(p, {"b": [51]}) == {"b": [52, 53]}
    assert _step(p, {"b": [52, 53]}) == {"b": [54, 55, 56, 57]}

    from tokenloom.spec_decode.ngram_proposer import NgramProposer

    ngram = NgramProposer(8, 1, 4, 200)  # the n-gram proposer sees b's context only
    ngram.add_request("b", [7, 8, 9, 50, 51, 52, 53])
    assert ngram.propose(["b"]) == [[]]


@needs_arctic
def test_a_request_outside_the_batch_is_stopped_and_restarts_from_its_prompt():
    p = _proposer()
    p.add_request("a", [1, 2, 3], num_prompt_tokens=3)
    for t in [40, 41, 42, 43, 44, 45]:
        _step(p, {"a": [t]})
    assert "a" in p.cache.active_requests and "a" in p.cache.cached_requests
    p.add_request("b", [9, 9, 9], num_prompt_tokens=3)
    _step(p, {"b": [5]}, batch=["b"])  # a was not scheduled this step: vLLM stops it
    assert "a" not in p.cache.active_requests and "a" in p.cache.cached_requests
    p.add_request("c", [8, 8], num_prompt_tokens=2)
    assert _step(p, {"c": [42, 43]}, batch=["b", "c"]) == {"c": [44, 45]}  # a's output is still there
    # a samples again: started anew, which evicts its earlier output from the global tree
    _step(p, {"a": [46]}, batch=["a", "b"])
    assert "a" in p.cache.active_requests and "c" not in p.cache.active_requests
    p.add_request("d", [7, 7], num_prompt_tokens=2)
    assert _step(p, {"d": [42, 43]}, batch=["a", "d"]) == {"d": []}  # a's 40..45 are gone


@needs_arctic
def test_prefill_chunks_and_max_model_len():
    p = _proposer(max_model_len=12)
    p.add_request("a", [1, 2, 3, 4, 1, 2, 3], num_prompt_tokens=7)
    assert p.propose(["a"], batch_req_ids=["a"]) == [[]]  # sampled nothing (a prefill chunk): no draft
    assert "a" not in p.cache.active_requests
    assert _step(p, {"a": [4]}) == {"a": [1, 2, 3]}  # its prompt tree; min(K, 12 - 8 - 1) = 3
    assert _step(p, {"a": [1, 2]}) == {"a": [3]}  # 10 tokens: 12 - 10 - 1 = 1
    assert _step(p, {"a": [3, 4]}) == {"a": []}  # at max_model_len: nothing


@needs_arctic
def test_k_caps_the_draft_and_reset_forgets_the_outputs():
    p = _proposer(k=2)
    p.add_request("a", [1, 2, 3], num_prompt_tokens=3)
    for t in [60, 61, 62, 63, 64, 65, 66]:
        _step(p, {"a": [t]})
    p.add_request("b", [1], num_prompt_tokens=1)
    assert _step(p, {"b": [60, 61, 62]}) == {"b": [63, 64]}
    p.reset()
    assert not p.cache.cached_requests and not p.cache.active_requests
    p.add_request("b", [1], num_prompt_tokens=1)
    assert _step(p, {"b": [60, 61, 62]}) == {"b": []}


# End to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@needs_arctic
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_busy_batch_greedy_identical(tiny_dir, monkeypatch, kernels):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", kernels)
    knobs = dict(dtype="float32", num_blocks=48, block_size=4, max_num_batched_tokens=40, max_num_seqs=8,
                 enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(i + j % (3 + i % 4)) % 200 + 3 for j in range(18 + 5 * i)]} for i in range(10)]
    plain = LLM(str(tiny_dir), **knobs)
    spec = LLM(str(tiny_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 8}, **knobs)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for _ in range(2):  # the second time the global tree holds every output
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want
    sched = spec.llm_engine.scheduler
    assert sched.num_preemptions_total > 0
    assert sched.spec_decoding_totals.num_accepted_tokens > 0
    assert _free_all(spec) and _free_all(plain)
    runner = spec.llm_engine.runner  # the proposer holds no request the runner has dropped
    assert set(runner.spec_decode.proposer.cache.active_requests) <= set(runner.requests)


@needs_arctic
@pytest.mark.slow
def test_a_repeated_request_accepts_the_drafts_ngram_lacks():
    """The same chat twice: its output does not copy its prompt, so n-gram drafts little; the
    second time, suffix decoding drafts from the first output and accepts most of it."""
    conv = [[{"role": "user", "content": "Write a short poem about autumn leaves."}]]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    # Token identity with and without drafts holds for the float path; the quantized kernels
    # verify k+1 rows in other accumulation orders than one-row decode, so on some CPUs a near
    # tie flips (seen on CI's machine).
    knobs = dict(kv_cache_memory=256 << 20, quantization="none", dtype="float32")
    want = LLM(**knobs).chat(conv, params, use_tqdm=False)[0].outputs[0].token_ids
    accepted = {}
    for name, cfg in (("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                 "prompt_lookup_min": 1}),
                      ("suffix", {"method": "suffix"})):
        llm = LLM(**knobs, speculative_config=cfg)
        totals = llm.llm_engine.scheduler.spec_decoding_totals
        for run in range(2):
            before = totals.num_accepted_tokens
            assert llm.chat(conv, params, use_tqdm=False)[0].outputs[0].token_ids == want
            accepted[name, run] = totals.num_accepted_tokens - before
        assert _free_all(llm)
    assert accepted["ngram", 1] == accepted["ngram", 0]  # n-gram does not learn across requests
    assert accepted["suffix", 1] > accepted["suffix", 0]
    assert accepted["suffix", 1] >= 0.6 * len(want) > accepted["ngram", 1]
