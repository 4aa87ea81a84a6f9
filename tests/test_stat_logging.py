"""vLLM's periodic stats line (tokenloom/engine/stat_logging.py) and `disable_log_stats`.

The arithmetic on hand-made IterationStats over an injected clock (throughput, the idle rule, preemptions,
the prefix-cache hit rate over recent requests, the speculative-decoding line, one line per data-parallel
engine); then a live server that logs the line after a request, and logs none with --disable-log-stats;
then `LLM(disable_log_stats=...)` both ways.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest

from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams, envs
from tokenloom.core.kv_cache_manager import PrefixCacheStats
from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.core.spec_decode_stats import SpecDecodingStats
from tokenloom.engine.core_messages import EngineCoreOutputs
from tokenloom.engine.iteration_stats import IterationStats
from tokenloom.engine.request_mirrors import update_mirrors
from tokenloom.engine.stat_logging import CachingMetrics, LoggingStatLogger, PerEngineStatLogger

LOGGER = "tokenloom.engine.stat_logging"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sched(running: int = 0, waiting: int = 0, usage: float = 0.0, preemptions: int = 0,
          prefix: PrefixCacheStats | None = None, spec: SpecDecodingStats | None = None) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                          num_free_blocks=0, num_preemptions_total=preemptions, prefix_cache_queries=0,
                          prefix_cache_hits=0, prefix_cache_stats=prefix, spec_decoding=spec)


def batch_stats(s: SchedulerStats | None, prompt: int = 0, computed: int = 0, generated: int = 0) -> IterationStats:
    return IterationStats(0.0, s, num_prompt_tokens=prompt, num_computed_prompt_tokens=computed,
                          num_generation_tokens=generated)


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    out = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    caplog.clear()
    return out


def test_throughput_over_the_interval_and_the_idle_rule(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(0, "cpu", clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    # 160 prompt tokens of which 60 were prefix-cache hits: the line counts the 100 computed, as vLLM's.
    stat_logger.record(sched(running=2, waiting=1, usage=0.25), batch_stats(None, 160, 100, 30))
    stat_logger.record(sched(running=2, waiting=1, usage=0.25), batch_stats(sched(), 0, 0, 20))
    clock.now += 10.0
    stat_logger.log()
    assert logged(caplog) == [(logging.INFO, "Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation "
                                             "throughput: 5.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, "
                                             "CPU KV cache usage: 25.0%")]
    # Nothing this interval, but the previous one moved tokens: still INFO (vLLM shows the burst's end).
    stat_logger.record(sched(), batch_stats(sched()))
    clock.now += 4.0
    stat_logger.log()
    [(level, line)] = logged(caplog)
    assert level == logging.INFO and line.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg "
                                                     "generation throughput: 0.0 tokens/s, Running: 0 reqs")
    clock.now += 10.0  # two quiet intervals in a row: idle, DEBUG
    stat_logger.log()
    [(level, _)] = logged(caplog)
    assert level == logging.DEBUG
    stat_logger.record(sched(running=1), batch_stats(sched(running=1), 0, 0, 1))
    clock.now += 2.0  # tokens again: back to INFO, over this interval's 2 s only
    stat_logger.log()
    [(level, line)] = logged(caplog)
    assert level == logging.INFO and "Avg generation throughput: 0.5 tokens/s, Running: 1 reqs" in line


def test_the_kv_cache_device_word_is_vllms() -> None:
    assert LoggingStatLogger(device="cuda:0").kv_cache_device == "GPU"
    assert LoggingStatLogger(device="cuda").kv_cache_device == "GPU"
    assert LoggingStatLogger(device="cpu").kv_cache_device == "CPU"


def test_preemptions_are_the_intervals_share_of_the_engines_total(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(0, "cpu", clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stat_logger.record(sched(preemptions=3), batch_stats(sched(), 0, 0, 5))
    stat_logger.record(sched(running=1, preemptions=5), batch_stats(sched(), 0, 0, 5))
    clock.now += 1.0
    stat_logger.log()
    [(_, line)] = logged(caplog)
    assert "Waiting: 0 reqs, Preemptions: 5, CPU KV cache usage: 0.0%" in line
    stat_logger.record(sched(running=1, preemptions=5), batch_stats(sched(), 0, 0, 5))
    clock.now += 1.0
    stat_logger.log()  # no new preemption: no part
    [(_, line)] = logged(caplog)
    assert "Preemptions" not in line
    stat_logger.record(sched(running=1, preemptions=6), batch_stats(sched(), 0, 0, 5))
    clock.now += 1.0
    stat_logger.log()
    [(_, line)] = logged(caplog)
    assert "Preemptions: 1," in line


def test_prefix_cache_hit_rate_over_recent_requests(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(0, "cpu", clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stat_logger.record(sched(), batch_stats(sched()))
    stat_logger.log()  # no lookups yet: no part
    assert "Prefix cache" not in logged(caplog)[0][1]
    stat_logger.record(sched(prefix=PrefixCacheStats(requests=2, queries=100, hits=40)), batch_stats(None))
    stat_logger.record(sched(prefix=PrefixCacheStats(requests=1, queries=100, hits=0)), batch_stats(None))
    stat_logger.record(sched(prefix=PrefixCacheStats()), batch_stats(None))  # an empty interval changes nothing
    clock.now += 1.0
    stat_logger.log()
    assert logged(caplog)[0][1].endswith("CPU KV cache usage: 0.0%, Prefix cache hit rate: 20.0%")
    clock.now += 1.0
    stat_logger.log()  # the rate is over recent requests, not the interval: it stays
    assert logged(caplog)[0][1].endswith("Prefix cache hit rate: 20.0%")

    # vLLM's CachingMetrics: the oldest observations leave once the window (requests) is exceeded, the
    # latest always stays; a reset forgets everything before it.
    window = CachingMetrics(max_recent_requests=3)
    window.observe(PrefixCacheStats(requests=2, queries=10, hits=10))
    window.observe(PrefixCacheStats(requests=2, queries=10, hits=0))
    assert (window.aggregated_requests, window.hit_rate) == (2, 0.0)
    window.observe(PrefixCacheStats(requests=5, queries=10, hits=5))
    assert (window.aggregated_requests, window.hit_rate) == (5, 0.5)
    window.observe(PrefixCacheStats(reset=True, requests=1, queries=4, hits=1))
    assert (window.aggregated_requests, window.hit_rate) == (1, 0.25)
    window.observe(PrefixCacheStats(reset=True))
    assert window.empty


def test_spec_decoding_line_from_the_intervals_change_in_totals(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(0, "cpu", clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    first = SpecDecodingStats(3, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15,
                              num_accepted_tokens_per_pos=[8, 5, 2])
    stat_logger.record(sched(spec=first), batch_stats(None, 0, 0, 25))
    clock.now += 10.0
    stat_logger.log()
    lines = logged(caplog)
    assert len(lines) == 2 and lines[0][1].startswith("Engine 000: ")
    assert lines[1] == (logging.INFO, "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: "
                                      "1.50 tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 15 tokens, "
                                      "Drafted: 30 tokens, Per-position acceptance rate: 0.800, 0.500, 0.200, "
                                      "Avg Draft acceptance rate: 50.0%")
    later = SpecDecodingStats(3, num_drafts=14, num_draft_tokens=42, num_accepted_tokens=19,
                              num_accepted_tokens_per_pos=[10, 6, 3])
    stat_logger.record(sched(spec=later), batch_stats(None, 0, 0, 8))
    clock.now += 4.0
    stat_logger.log()
    assert logged(caplog)[1][1] == ("SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: "
                                    "1.00 tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 4 tokens, "
                                    "Drafted: 12 tokens, Per-position acceptance rate: 0.500, 0.250, 0.250, "
                                    "Avg Draft acceptance rate: 33.3%")
    stat_logger.record(sched(spec=later), batch_stats(None, 0, 0, 8))
    clock.now += 4.0
    stat_logger.log()  # no new drafts: no SpecDecoding line
    assert [line for _, line in logged(caplog) if line.startswith("SpecDecoding")] == []


def test_one_line_per_data_parallel_engine(caplog) -> None:
    clock = FakeClock()
    loggers = PerEngineStatLogger(2, "cpu", clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    total = sched(running=3)  # the engines' sum, as AsyncLLM's `scheduler` with data parallelism
    one = batch_stats(total, 10, 10, 0)
    one.engine_index, one.engine_scheduler = 1, sched(running=3, usage=0.5,
                                                      prefix=PrefixCacheStats(requests=1, queries=8, hits=4))
    loggers.record(one)
    loggers.record(batch_stats(None))  # an abort: no engine behind it
    clock.now += 5.0
    loggers.log()
    assert logged(caplog) == [
        (logging.DEBUG, "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                        "Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%"),
        (logging.INFO, "Engine 001: Avg prompt throughput: 2.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                       "Running: 3 reqs, Waiting: 0 reqs, CPU KV cache usage: 50.0%, Prefix cache hit rate: 50.0%"),
    ]


def test_the_computed_prompt_tokens_leave_out_the_cached_ones() -> None:
    mirrors = {"a": Request("a", list(range(20)), arrival_time=0.0),
               "b": Request("b", list(range(12)), arrival_time=0.0)}
    stats = IterationStats(1.0)
    update_mirrors(EngineCoreOutputs([EngineCoreOutput("a", [1], num_cached_tokens=16),
                                      EngineCoreOutput("b", [1], num_cached_tokens=0)], 1.0, sched(), 2),
                   mirrors, stats)
    assert (stats.num_prompt_tokens, stats.num_computed_prompt_tokens) == (32, 16)


def test_a_failing_log_never_stops_the_loop(caplog) -> None:
    from tokenloom.server.app import _log_stats_forever

    class Broken:
        calls = 0

        def log(self) -> None:
            Broken.calls += 1
            raise RuntimeError("boom")

    async def run() -> None:
        task = asyncio.create_task(_log_stats_forever(Broken(), 0.01))  # type: ignore[arg-type]
        while Broken.calls < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="tokenloom.server.app"):
        asyncio.run(run())
    assert Broken.calls >= 3 and "the periodic stats log failed" in caplog.text


def test_the_interval_variable(monkeypatch) -> None:
    for name in ("TOKENLOOM_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    assert envs.TOKENLOOM_LOG_STATS_INTERVAL == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")  # vLLM's name is read too
    assert envs.TOKENLOOM_LOG_STATS_INTERVAL == 2.5
    monkeypatch.setenv("TOKENLOOM_LOG_STATS_INTERVAL", "0.5")  # tokenloom's first
    assert envs.TOKENLOOM_LOG_STATS_INTERVAL == 0.5
    monkeypatch.setenv("TOKENLOOM_LOG_STATS_INTERVAL", "0")  # vLLM's rule: not positive means the default
    assert envs.TOKENLOOM_LOG_STATS_INTERVAL == 10.0
    monkeypatch.setenv("TOKENLOOM_LOG_STATS_INTERVAL", "often")
    with pytest.raises(ValueError, match="TOKENLOOM_LOG_STATS_INTERVAL must be a number of seconds"):
        envs.TOKENLOOM_LOG_STATS_INTERVAL  # noqa: B018


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


STATS_LINE = re.compile(r"INFO tokenloom\.engine\.stat_logging: Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, "
                        r"Avg generation throughput: ([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
                        r"CPU KV cache usage: [\d.]+%")


def _serve_and_ask(model_dir, tmp_path, *flags: str) -> str:
    """A server logging at INFO with a 0.3 s stats interval: one completion, then a few intervals' log."""
    args = [str(model_dir), "--dtype", "float32", "--num-blocks", "256", "--block-size", "4",
            "--uvicorn-log-level", "info", *flags]
    with ServerProcess(*args, log_path=tmp_path / "server.log", env={"TOKENLOOM_LOG_STATS_INTERVAL": "0.3"}) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 8,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        # An enabled server's line comes within an interval or two (up to 10 s on a busy machine); a disabled
        # one is given five intervals to (wrongly) log one, not the whole deadline.
        deadline = time.monotonic() + (10 if not flags else 1.5)
        while time.monotonic() < deadline and not STATS_LINE.search(s.log_path.read_text()):
            time.sleep(0.1)
        return s.log_path.read_text()


@pytest.mark.slow
def test_a_server_logs_the_stats_line_and_not_with_disable_log_stats(model_dir, tmp_path) -> None:
    log = _serve_and_ask(model_dir, tmp_path)
    lines = STATS_LINE.findall(log)
    assert lines, log[-3000:]
    assert any(float(prompt) > 0 and float(gen) > 0 for prompt, gen in lines), lines
    log = _serve_and_ask(model_dir, tmp_path, "--disable-log-stats")
    assert "Avg prompt throughput" not in log, log[-3000:]


@pytest.mark.parametrize("disable_log_stats", [False, True])
def test_llm_takes_disable_log_stats(model_dir, disable_log_stats: bool) -> None:
    """vLLM's engine argument: code that passes it runs, and RequestOutput.metrics is filled either way."""
    llm = LLM(str(model_dir), dtype="float32", num_blocks=64, block_size=4, max_model_len=64,
              disable_log_stats=disable_log_stats)
    try:
        out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert out[0].metrics is not None
    finally:
        llm.shutdown()


def test_waiting_counts_deferred_requests_and_names_them(caplog) -> None:
    """vLLM's line: "Waiting" is every waiting request, those admission steps over (a grammar compiling, a KV
    load) included, and a "Deferred" part names those when there are any."""
    clock = FakeClock()
    stat_logger = LoggingStatLogger(0, "cpu", clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    deferred = sched(running=1, waiting=2)
    deferred.num_skipped_waiting_reqs = 3
    stat_logger.record(deferred, batch_stats(sched(), 0, 0, 5))
    clock.now += 1.0
    stat_logger.log()
    [(_, line)] = logged(caplog)
    assert "Running: 1 reqs, Waiting: 5 reqs, Deferred: 3 reqs, CPU KV cache usage" in line
    stat_logger.record(sched(running=1, waiting=2), batch_stats(sched(), 0, 0, 5))
    clock.now += 1.0
    stat_logger.log()
    [(_, line)] = logged(caplog)
    assert "Waiting: 2 reqs, CPU KV cache usage" in line and "Deferred" not in line
