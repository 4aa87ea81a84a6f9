"""Prometheus: vLLM's four spec_decode counters (our prefix), fed from the scheduler's running totals."""

from __future__ import annotations

from tokenloom.core.scheduler import SchedulerStats
from tokenloom.core.spec_decode_stats import SpecDecodingStats
from tokenloom.engine.iteration_stats import IterationStats
from tokenloom.server.metrics import ServerMetrics


def _stats(spec: SpecDecodingStats | None) -> IterationStats:
    sched = SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1, num_free_blocks=9,
                           num_preemptions_total=0, prefix_cache_queries=0, prefix_cache_hits=0, spec_decoding=spec)
    return IterationStats(timestamp=0.0, scheduler=sched)


def _spec_lines(m: ServerMetrics) -> list[str]:
    return [line for line in m.render().decode().splitlines()
            if "spec_decode" in line and not line.startswith("#") and "_created" not in line]


def test_no_spec_counters_without_speculation():
    m = ServerMetrics("m", 10)
    m.record(_stats(None))
    assert _spec_lines(m) == []


def test_exactly_the_four_counters_from_running_totals():
    m = ServerMetrics("m", 10)
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
