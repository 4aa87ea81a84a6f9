"""vLLM 0.32 scheduler behaviour around what its own scheduler tests (tests/peer/core) found missing, beyond what
those cases check: max_num_active_seqs and long_prefill_token_threshold_adaptive as engine arguments (LLM
keyword, CLI flag) with vLLM's checks; reset_prefix_cache(reset_connector=True) with a connector that resets,
cannot, or has no reset; the deferred waiting requests through the stats' consumers (Prometheus, the
data-parallel sum); and the -1 draft padding kept away from a grammar, which vLLM's cases check through a mock
of its own grammar object (not vendorable)."""

from __future__ import annotations

import argparse

import pytest

from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig, engine_config_from_kwargs
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler, SchedulerStats
from tokenloom.core.structured_output import StructuredOutputManager, StructuredOutputRequest
from tokenloom.engine.args import add_engine_args, engine_config_from_args
from tokenloom.engine.engine_stats import sum_engine_stats
from tokenloom.engine.iteration_stats import IterationStats
from tokenloom.engine.metrics import PrometheusMetrics
from tokenloom.sampling_params import SamplingParams


def _scheduler(**sched: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, **sched)
    return Scheduler(config, CacheConfig(block_size=4, num_blocks=64), clock=lambda: 0.0)


def test_the_two_knobs_are_engine_arguments_with_vllms_defaults_and_checks() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["m.gguf", "--max-num-seqs", "8", "--max-num-active-seqs", "3",
                              "--long-prefill-token-threshold", "16", "--long-prefill-token-threshold-adaptive"])
    config = engine_config_from_args(args)
    assert config == engine_config_from_kwargs(model="m.gguf", max_num_seqs=8, max_num_active_seqs=3,
                                               long_prefill_token_threshold=16,
                                               long_prefill_token_threshold_adaptive=True)
    assert config.scheduler.max_num_active_seqs == 3 and config.scheduler.long_prefill_token_threshold_adaptive
    default = SchedulerConfig()
    assert default.max_num_active_seqs is None and default.long_prefill_token_threshold_adaptive is False
    with pytest.raises(ConfigError, match=r"max_num_active_seqs \(9\) cannot be greater than max_num_seqs \(8\)"):
        engine_config_from_kwargs(max_num_seqs=8, max_num_active_seqs=9)
    with pytest.raises(ConfigError, match="max_num_active_seqs must be >= 1"):
        engine_config_from_kwargs(max_num_active_seqs=0)


def test_max_num_active_seqs_caps_admission_not_the_runner() -> None:
    scheduler = _scheduler(max_num_active_seqs=2)
    for i in range(4):
        scheduler.add_request(Request(str(i), [i] * 4, SamplingParams(max_tokens=4)))
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["0", "1"] and output.bound_by == "max_num_seqs"
    assert scheduler.max_num_running_reqs == 8 and scheduler.max_num_active_reqs == 2


class _Connector:
    """The scheduler side of a KV connector, as far as reset_prefix_cache asks it."""

    def __init__(self, reset: bool | None) -> None:
        self.reset = reset
        self.calls = 0

    def reset_cache(self) -> bool | None:
        self.calls += 1
        return self.reset


@pytest.mark.parametrize(("reset", "expected"), [(True, True), (None, True), (False, False)])
def test_reset_connector_asks_the_connector(reset: bool | None, expected: bool) -> None:
    """vLLM's rule: the connector's False fails the reset; None (a connector with no reset) counts as done."""
    scheduler = _scheduler()
    scheduler.connector = connector = _Connector(reset)
    assert scheduler.reset_prefix_cache() is True and connector.calls == 0
    assert scheduler.reset_prefix_cache(reset_connector=True) is expected and connector.calls == 1
    assert scheduler.connector_prefix_cache_stats.reset is expected


def test_a_request_waiting_for_its_grammar_is_counted_deferred_until_admitted() -> None:
    """vLLM's deferred_waiting: blocked from arrival, stepped over, out of the set once admitted or finished."""
    scheduler = _scheduler()
    plain = Request("plain", [1] * 4, SamplingParams(max_tokens=4))
    blocked = Request("blocked", [2] * 4, SamplingParams(max_tokens=4))
    blocked.status = RequestStatus.WAITING_FOR_FSM  # (no grammar: stepped over for ever, as in vLLM)
    scheduler.add_request(blocked)
    scheduler.add_request(plain)
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_skipped_waiting_reqs, stats.num_waiting_total) == (1, 1, 2)
    scheduler.schedule()
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (1, 0, 1)
    scheduler.finish_requests("blocked", RequestStatus.FINISHED_ABORTED)
    assert scheduler.deferred_waiting == set() and scheduler.make_stats().num_skipped_waiting_reqs == 0


def _sched_stats(waiting: int, deferred: int) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=1, num_waiting_reqs=waiting, kv_cache_usage=0.1, num_free_blocks=9,
                          num_preemptions_total=0, prefix_cache_queries=0, prefix_cache_hits=0,
                          num_skipped_waiting_reqs=deferred)


def test_prometheus_splits_waiting_by_reason_and_totals_it() -> None:
    """vllm:num_requests_waiting is every waiting request; its by-reason gauge splits those waiting for room
    (capacity) from those stepped over while they wait for something else (deferred)."""
    m = PrometheusMetrics("m", 10, prefix="vllm")
    m.record(IterationStats(timestamp=0.0, scheduler=_sched_stats(2, 3)))
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in m.render().decode().splitlines()
              if line.startswith("vllm:num_requests_waiting")}
    assert values == {'vllm:num_requests_waiting{model_name="m"}': 5,
                      'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"}': 2,
                      'vllm:num_requests_waiting_by_reason{model_name="m",reason="deferred"}': 3}
    assert m.last_num_waiting == 5  # what the ORCA load header reports


def test_data_parallel_engines_deferred_requests_add_up() -> None:
    total = sum_engine_stats({0: _sched_stats(2, 3), 1: _sched_stats(1, 4)})
    assert (total.num_waiting_reqs, total.num_skipped_waiting_reqs, total.num_waiting_total) == (3, 7, 10)


class _RecordingMatcher:
    """A grammar matcher that accepts every token, records the tokens it was asked about and, as
    llguidance does, raises on a negative id (vLLM's _RecordingGrammar, at tokenloom's seam)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def is_terminated(self) -> bool:
        return False

    def accept_token(self, token: int) -> bool:
        if token < 0:
            raise OverflowError("negative token id")
        self.seen.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        pass


def _decoding_constrained_request(scheduler: Scheduler) -> tuple[Request, _RecordingMatcher]:
    request = Request("0", [0], SamplingParams(max_tokens=16))
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=["0"], req_id_to_index={"0": 0},
                                                           sampled_token_ids=[[0]]))
    scheduler.structured_output_manager = StructuredOutputManager(None)
    matcher = _RecordingMatcher()
    request.structured_output_request = StructuredOutputRequest(("regex", "x"), matcher=matcher)
    return request, matcher


def test_draft_padding_never_reaches_the_grammar() -> None:
    """vLLM's test_update_draft_token_ids_strips_ngram_padding and ..._in_output_strips_padding: drafts padded
    with -1 are cut at the first pad before the grammar validates them; on the output path the cut ones are
    padded back and counted invalid."""
    from tokenloom.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=4, method="ngram")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                          CacheConfig(block_size=4, num_blocks=64), clock=lambda: 0.0, speculative_config=spec)
    request, matcher = _decoding_constrained_request(scheduler)
    scheduler.update_draft_token_ids(["0"], [[10, 11, -1, -1]])
    assert matcher.seen == [10, 11] and request.spec_token_ids == [10, 11]

    matcher.seen.clear()
    output = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={},
                             total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={"0": [0, 0, 0, 0]})
    scheduler.update_draft_token_ids_in_output(["0"], [[10, 11, -1, -1]], output)
    assert matcher.seen == [10, 11]
    assert output.scheduled_spec_decode_tokens == {"0": [10, 11, -1, -1]}
    assert output.num_invalid_spec_tokens == {"0": 2}


def test_request_status_formats_as_its_name() -> None:
    """vLLM's RequestStatus.__str__ (tests/v1/test_request.py's test_request_status_fmt_str, for the statuses
    tokenloom shares): an f-string shows the name, where a bare IntEnum would show its number; the waiting-for-
    grammar status goes by vLLM 0.32's name, vLLM's earlier one an alias."""
    for name in ("WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED",
                 "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_ERROR",
                 "FINISHED_REPETITION"):
        assert f"{RequestStatus[name]}" == name
    assert RequestStatus.WAITING_FOR_FSM is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_REPETITION) == "repetition"
    assert RequestStatus.is_finished(RequestStatus.FINISHED_REPETITION)
