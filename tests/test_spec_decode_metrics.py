"""Prometheus: vLLM's four spec_decode counters under each prefix in force, fed from the scheduler's running
totals."""

from __future__ import annotations

from tokenloom.core.scheduler import SchedulerStats
from tokenloom.core.spec_decode_stats import SpecDecodingStats
from tokenloom.engine.iteration_stats import IterationStats
from tokenloom.engine.metrics import PrometheusMetrics


def _stats(spec: SpecDecodingStats | None) -> IterationStats:
    sched = SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1, num_free_blocks=9,
                           num_preemptions_total=0, prefix_cache_queries=0, prefix_cache_hits=0, spec_decoding=spec)
    return IterationStats(timestamp=0.0, scheduler=sched)


def _spec_lines(m: PrometheusMetrics) -> list[str]:
    return [line for line in m.render().decode().splitlines()
            if "spec_decode" in line and not line.startswith("#") and "_created" not in line]


def test_no_spec_counters_without_speculation():
    m = PrometheusMetrics("m", 10)
    m.record(_stats(None))
    assert _spec_lines(m) == []


def test_exactly_the_four_counters_from_running_totals():
    m = PrometheusMetrics("m", 10, prefix="tokenloom")
    totals = SpecDecodingStats.new(3)
    totals.observe_draft(3, 3)
    totals.observe_draft(3, 1)
    m.record(_stats(totals.copy()))
    totals.observe_draft(2, 0)
    m.record(_stats(totals.copy()))
    m.record(_stats(totals.copy()))  # the same totals again add nothing
    names = {line.split("{")[0] for line in _spec_lines(m)}
    assert names == {"tokenloom:spec_decode_num_drafts_total", "tokenloom:spec_decode_num_draft_tokens_total",
                     "tokenloom:spec_decode_num_accepted_tokens_total",
                     "tokenloom:spec_decode_num_accepted_tokens_per_pos_total"}
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in _spec_lines(m)}
    assert values['tokenloom:spec_decode_num_drafts_total{model_name="m"}'] == 3
    assert values['tokenloom:spec_decode_num_draft_tokens_total{model_name="m"}'] == 8
    assert values['tokenloom:spec_decode_num_accepted_tokens_total{model_name="m"}'] == 4
    per_pos = [values[f'tokenloom:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}}']
               for i in range(3)]
    assert per_pos == [2, 1, 1]


def test_vllm_names_under_the_default_prefix():
    """`--metrics-prefix both` (the default) exports vLLM's names too: dashboards and vLLM's test_llm_engine.py
    read vllm:spec_decode_*; `tokenloom` alone exports none of them."""
    both = PrometheusMetrics("m", 10)
    totals = SpecDecodingStats.new(2)
    totals.observe_draft(2, 1)
    both.record(_stats(totals.copy()))
    names = {line.split("{")[0] for line in _spec_lines(both)}
    assert {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"} < names
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in _spec_lines(both)}
    assert values['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'] == 0
    ours = PrometheusMetrics("m", 10, prefix="tokenloom")
    ours.record(_stats(totals.copy()))
    assert not any(line.startswith("vllm:") for line in _spec_lines(ours))


def test_data_parallel_engines_spec_decoding_totals_add_up() -> None:
    """With several engines the front end sums their reports (engine_stats.sum_engine_stats): the drafts counted
    must be every engine's, not dropped (the server's /metrics, its stats line and LLM.get_metrics read the sum)."""
    from tokenloom.core.scheduler import SchedulerStats
    from tokenloom.core.spec_decode_stats import SpecDecodingStats
    from tokenloom.engine.engine_stats import sum_engine_stats

    def report(drafts: int, accepted_per_pos: list[int]) -> SchedulerStats:
        spec = SpecDecodingStats.new(2)
        spec.num_drafts, spec.num_draft_tokens = drafts, 2 * drafts
        spec.num_accepted_tokens_per_pos = list(accepted_per_pos)
        spec.num_accepted_tokens = sum(accepted_per_pos)
        return SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5, num_free_blocks=4,
                              num_preemptions_total=0, prefix_cache_queries=0, prefix_cache_hits=0,
                              spec_decoding=spec)

    total = sum_engine_stats({0: report(3, [2, 1]), 1: report(5, [4, 0])}).spec_decoding
    assert total is not None
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (8, 16, 7)
    assert total.num_accepted_tokens_per_pos == [6, 1]
    assert sum_engine_stats({0: report(1, [1, 0])}).spec_decoding is not None
