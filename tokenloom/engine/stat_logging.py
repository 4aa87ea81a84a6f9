"""The server's periodic stats line, vLLM's LoggingStatLogger (vllm/v1/metrics/loggers.py, 0.32).

Fed the IterationStats AsyncLLM hands to its stat loggers; every $TOKENLOOM_LOG_STATS_INTERVAL seconds
the server calls `log()`, which writes vLLM's line, word for word, so log scrapers written for vLLM work:

    Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s, Running: 2 reqs,
    Waiting: 0 reqs, CPU KV cache usage: 1.2%, Prefix cache hit rate: 33.3%

and, with speculative decoding, vLLM's "SpecDecoding metrics: ..." line after it. At INFO, or at DEBUG when
the engine was idle this interval and the one before (vLLM's rule, so an idle server stays quiet). With data
parallelism one line per engine ("Engine 000", "Engine 001"), as vLLM's default per-engine loggers.

Where tokenloom's figures differ in form from vLLM's, the arithmetic is the same: preemptions and the
speculative-decoding counts arrive as totals since start-up (SchedulerStats) and are differenced here;
vLLM gets them per step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from tokenloom.core.kv_cache_manager import PrefixCacheStats
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.core.spec_decode_stats import SpecDecodingStats
from tokenloom.engine.iteration_stats import IterationStats

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class CachingMetrics:
    """vLLM's CachingMetrics: the hit rate over the most recent `max_recent_requests` requests, fed the
    per-interval PrefixCacheStats (so one burst of misses long ago does not weigh on today's rate)."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits) per observation

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:  # reset_prefix_cache ran: what was cached before says nothing about now
            self.reset()
        if stats.requests == 0:  # an empty interval would only push useful ones out of the window
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        # Drop the oldest observations past the window, always keeping the latest one.
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        return self.aggregated_query_hit / self.aggregated_query_total if self.aggregated_query_total else 0.0


class SpecDecodingLogging:
    """vLLM's SpecDecodingLogging, fed running totals: `observe` keeps the latest, `log` reports the change
    since the previous `log` (vLLM sums the per-step stats of the interval: the same figures)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.latest: SpecDecodingStats | None = None
        self.at_last_log: SpecDecodingStats | None = None
        self.last_log_time = clock()

    def observe(self, totals: SpecDecodingStats) -> None:
        self.latest = totals

    def log(self, log_fn: Callable[..., None]) -> None:
        now = self.clock()
        elapsed, self.last_log_time = now - self.last_log_time, now
        latest, before = self.latest, self.at_last_log
        if latest is None:
            return
        self.at_last_log = latest
        num_drafts = latest.num_drafts - (before.num_drafts if before else 0)
        if num_drafts <= 0:  # vLLM logs only an interval that verified drafts
            return
        num_draft_tokens = latest.num_draft_tokens - (before.num_draft_tokens if before else 0)
        num_accepted_tokens = latest.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        per_pos = list(latest.num_accepted_tokens_per_pos)
        for i, n in enumerate(before.num_accepted_tokens_per_pos if before else []):
            if i < len(per_pos):
                per_pos[i] -= n
        draft_throughput = num_draft_tokens / elapsed if elapsed > 0 else 0.0
        accepted_throughput = num_accepted_tokens / elapsed if elapsed > 0 else 0.0
        acceptance_rate = num_accepted_tokens / num_draft_tokens * 100 if num_draft_tokens > 0 else float("nan")
        log_fn(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + num_accepted_tokens / num_drafts,  # conventionally counts the bonus token, as vLLM
            accepted_throughput, draft_throughput, num_accepted_tokens, num_draft_tokens,
            ", ".join(f"{n / num_drafts:.3f}" for n in per_pos), acceptance_rate,
        )


class LoggingStatLogger:
    """One engine's stats line (vLLM's LoggingStatLogger): `record` each report, `log` once an interval."""

    def __init__(self, engine_index: int = 0, device: str = "cpu", clock: Clock = time.monotonic) -> None:
        self.engine_index = engine_index
        device_type = device.split(":")[0]  # "cuda:0" -> "cuda"
        self.kv_cache_device = "GPU" if device_type == "cuda" else device_type.upper()
        self.clock = clock
        self.last_scheduler_stats: SchedulerStats | None = None
        self.prefix_caching_metrics = CachingMetrics()  # over recent requests, never reset by log()
        self.connector_prefix_caching_metrics = CachingMetrics()
        self.spec_decoding_logging = SpecDecodingLogging(clock)
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0
        self.engine_is_idle = False
        self._preemptions_seen = 0  # the engine's preemption total as of its last report
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0

    def record(self, scheduler_stats: SchedulerStats | None, stats: IterationStats) -> None:
        # Prompt throughput counts the prompt tokens computed, not those found cached (as vLLM's).
        self.num_prompt_tokens += stats.num_computed_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        if scheduler_stats is None:  # an abort's figures: no engine report behind them
            return
        self.num_preemptions += max(0, scheduler_stats.num_preemptions_total - self._preemptions_seen)
        self._preemptions_seen = scheduler_stats.num_preemptions_total
        if scheduler_stats.prefix_cache_stats is not None:
            self.prefix_caching_metrics.observe(scheduler_stats.prefix_cache_stats)
        if scheduler_stats.connector_prefix_cache_stats is not None:
            self.connector_prefix_caching_metrics.observe(scheduler_stats.connector_prefix_cache_stats)
        if scheduler_stats.spec_decoding is not None:
            self.spec_decoding_logging.observe(scheduler_stats.spec_decoding)
        self.last_scheduler_stats = scheduler_stats

    def _throughput(self, tokens: int, now: float) -> float:
        elapsed = now - self.last_log_time
        return tokens / elapsed if elapsed > 0 else 0.0

    def log(self) -> None:
        now = self.clock()
        prompt_throughput = self._throughput(self.num_prompt_tokens, now)
        generation_throughput = self._throughput(self.num_generation_tokens, now)
        # vLLM's rule: idle (DEBUG) only when this interval and the one before moved no tokens, so the
        # line that shows a burst ending still comes at INFO.
        self.engine_is_idle = not any((prompt_throughput, generation_throughput,
                                       self.last_prompt_throughput, self.last_generation_throughput))
        self.last_prompt_throughput, self.last_generation_throughput = prompt_throughput, generation_throughput
        num_preemptions = self.num_preemptions
        # vLLM 0.32 zeroes its interval counters before it formats the line, so its "Preemptions" part never
        # shows; this one reports the interval's preemptions, which is what vLLM's code sets out to do.
        self._reset(now)
        log_fn = logger.debug if self.engine_is_idle else logger.info
        sched = self.last_scheduler_stats
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        args: list[int | float | str] = [prompt_throughput, generation_throughput,
                                         sched.num_running_reqs if sched else 0,
                                         sched.num_waiting_total if sched else 0]
        if sched and sched.num_skipped_waiting_reqs > 0:
            parts.append("Deferred: %d reqs")
            args.append(sched.num_skipped_waiting_reqs)
        if num_preemptions > 0:
            parts.append("Preemptions: %d")
            args.append(num_preemptions)
        parts.append("%s KV cache usage: %.1f%%")
        args += [self.kv_cache_device, (sched.kv_cache_usage if sched else 0.0) * 100]
        if not self.prefix_caching_metrics.empty:
            parts.append("Prefix cache hit rate: %.1f%%")
            args.append(self.prefix_caching_metrics.hit_rate * 100)
        if not self.connector_prefix_caching_metrics.empty:
            parts.append("External prefix cache hit rate: %.1f%%")
            args.append(self.connector_prefix_caching_metrics.hit_rate * 100)
        log_fn("Engine %03d: " + ", ".join(parts), self.engine_index, *args)
        self.spec_decoding_logging.log(log_fn)


class PerEngineStatLogger:
    """vLLM's default with data parallelism: one LoggingStatLogger per engine, each fed its own engine's
    report (IterationStats.engine_scheduler; `scheduler`, the engines' sum, carries no per-interval figures)
    and its own batches' tokens. Registered with AsyncLLM as `engine.stat_loggers.append(logger.record)`."""

    def __init__(self, num_engines: int = 1, device: str = "cpu", clock: Clock = time.monotonic) -> None:
        self.device = device
        self.clock = clock
        # Every engine from the start, so an engine that got no request yet still has its (idle) line.
        self.loggers = {i: LoggingStatLogger(i, device, clock) for i in range(max(1, num_engines))}

    def record(self, stats: IterationStats) -> None:
        if stats.engine_index is None:  # one engine, or an abort (no engine's batch, no tokens)
            index, sched = 0, stats.scheduler
        else:
            index, sched = stats.engine_index, stats.engine_scheduler
        if index not in self.loggers:
            self.loggers[index] = LoggingStatLogger(index, self.device, self.clock)
        self.loggers[index].record(sched, stats)

    def log(self) -> None:
        for stat_logger in self.loggers.values():
            stat_logger.log()
