"""Offline metrics: LLM.get_metrics() (vLLM's), fed by the per-step IterationStats LLMEngine builds with
disable_log_stats=False, read back as vLLM's reader types from a registry of that LLM's own."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams
from tokenloom.engine.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

# Repetitive prompt ids so the n-gram proposer finds matches and drafts.
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]},
           {"prompt_token_ids": [20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5))


def _llm(tiny_dir: str, **kwargs: object) -> LLM:
    return LLM(tiny_dir, dtype="float32", num_blocks=64, block_size=4, max_model_len=64, **kwargs)


def _one(metrics: list[Metric], name: str, **labels: str) -> Metric:
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, found)
    return found[0]


def test_counters_after_a_run(tiny_dir: str) -> None:
    """Also vLLM's --custom-histogram-buckets: a family's bounds replace its defaults in every histogram of it
    (request_tokens: prompt and generation lengths), the others keep vLLM's (request_tokens' default is its 1-2-5
    series up to max_model_len)."""
    llm = _llm(tiny_dir, disable_log_stats=False, custom_histogram_buckets={"request_tokens": [4.0, 12.0, 20.0]})
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.get_metrics()
    finally:
        llm.llm_engine.close()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == 24
    assert all(m.name.startswith("vllm:") for m in metrics)  # vLLM's reader: vLLM's names only
    prompt = _one(metrics, "vllm:prompt_tokens")
    assert isinstance(prompt, Counter) and prompt.value == 15 + 11
    gen = _one(metrics, "vllm:generation_tokens")
    assert isinstance(gen, Counter) and gen.value == generated
    success = _one(metrics, "vllm:request_success", finished_reason="length")
    assert isinstance(success, Counter) and success.value == 2
    hist = _one(metrics, "vllm:request_generation_tokens")
    assert isinstance(hist, Histogram) and hist.count == 2 and hist.sum == generated
    assert hist.buckets == {"4.0": 0, "12.0": 2, "20.0": 2, "+Inf": 2}  # both generated 12
    assert list(_one(metrics, "vllm:request_prompt_tokens").buckets) == ["4.0", "12.0", "20.0", "+Inf"]
    assert list(_one(metrics, "vllm:e2e_request_latency_seconds").buckets)[:3] == ["0.3", "0.5", "0.8"]
    ttft = _one(metrics, "vllm:time_to_first_token_seconds")
    assert isinstance(ttft, Histogram) and ttft.count == 2
    running = _one(metrics, "vllm:num_requests_running")
    assert isinstance(running, Gauge) and running.value == 0.0
    assert _one(metrics, "vllm:iteration_tokens_total").count > 0  # one per engine step


def test_histogram_families_default_to_vllms_buckets() -> None:
    """Without custom buckets each histogram has its family's vLLM bounds: request_tokens (prompt, generation,
    max_tokens) vLLM's 1-2-5 series up to max_model_len, iteration_tokens powers of two."""
    from types import SimpleNamespace

    from tokenloom.engine.metrics import PrometheusMetrics
    from tokenloom.engine.metrics_reader import get_metrics_snapshot

    info = SimpleNamespace(max_model_len=100, block_size=16, num_blocks=10)
    metrics = get_metrics_snapshot(PrometheusMetrics("m", 10, prefix="vllm", info=info).registry)
    assert list(_one(metrics, "vllm:request_prompt_tokens").buckets) == \
        ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    assert list(_one(metrics, "vllm:iteration_tokens_total").buckets)[:3] == ["1.0", "8.0", "16.0"]
    assert list(_one(metrics, "vllm:request_params_n").buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]


def test_abort_counts_as_abort(tiny_dir: str) -> None:
    llm = _llm(tiny_dir, disable_log_stats=False)
    try:
        engine = llm.llm_engine
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))
        engine.step()
        engine.abort_request("a")
        metrics = llm.get_metrics()
    finally:
        llm.llm_engine.close()
    assert _one(metrics, "vllm:request_success", finished_reason="abort").value == 1
    assert _one(metrics, "vllm:request_success", finished_reason="length").value == 0


def test_spec_decode_counters_with_ngram_drafts(tiny_dir: str) -> None:
    llm = _llm(tiny_dir, disable_log_stats=False, speculative_config=NGRAM)
    try:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.get_metrics()
        totals = llm.llm_engine.scheduler.make_stats().spec_decoding
    finally:
        llm.llm_engine.close()
    assert totals is not None and totals.num_draft_tokens > 0  # the prompts did make the proposer draft
    drafts = _one(metrics, "vllm:spec_decode_num_drafts")
    draft_tokens = _one(metrics, "vllm:spec_decode_num_draft_tokens")
    accepted = _one(metrics, "vllm:spec_decode_num_accepted_tokens")
    assert (drafts.value, draft_tokens.value, accepted.value) == (
        totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens)
    per_pos = _one(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    assert isinstance(per_pos, Vector) and per_pos.values == totals.num_accepted_tokens_per_pos
    assert len(per_pos.values) == 3


def test_spec_decode_counters_exist_before_the_first_draft(tiny_dir: str) -> None:
    """vLLM's SpecDecodingProm makes its counters (one per draft position too) when the engine starts, so a reader
    can difference them from before the first request, as vLLM's test_async_scheduling.py does."""
    llm = _llm(tiny_dir, disable_log_stats=False, speculative_config=NGRAM)
    try:
        metrics = llm.get_metrics()
    finally:
        llm.llm_engine.close()
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens"):
        assert _one(metrics, name).value == 0
    assert _one(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos").values == [0, 0, 0]


def test_two_llms_count_apart(tiny_dir: str) -> None:
    first = _llm(tiny_dir, disable_log_stats=False)
    second = _llm(tiny_dir, disable_log_stats=False)
    try:
        first.generate(PROMPTS, GREEDY, use_tqdm=False)
        second.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert _one(first.get_metrics(), "vllm:generation_tokens").value == 24
        assert _one(second.get_metrics(), "vllm:generation_tokens").value == 12
    finally:
        first.llm_engine.close()
        second.llm_engine.close()


def test_get_metrics_with_stats_off_asserts_as_vllm(tiny_dir: str) -> None:
    """vLLM's LLM defaults disable_log_stats to True and its get_metrics() then asserts."""
    llm = _llm(tiny_dir)
    try:
        assert llm.llm_engine.log_stats is False
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        with pytest.raises(AssertionError, match="Stat logging disabled"):
            llm.get_metrics()
    finally:
        llm.llm_engine.close()
