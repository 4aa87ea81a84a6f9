"""Figures the API process derives from each batch of engine outputs, for metrics (vLLM's IterationStats).

AsyncLLM fills one IterationStats per batch it receives (and one per abort it performs) and hands it to
its stat loggers, e.g. the server's Prometheus metrics; LLMEngine does the same per step when stats are on
(disable_log_stats=False), for LLM.get_metrics(). Both count through the helpers below, so a figure means
the same offline and served. Latencies are seconds on the engine's clock (`time.monotonic()` unless a test
gives the in-process scheduler another).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.core_messages import StepInfo
from tokenloom.engine.outputs import PoolingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    """One finished core request (one of the `n` completions of a request)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float
    queue_time: float | None  # None: never scheduled
    num_prompt_tokens: int
    num_generation_tokens: int
    # vLLM's per-request phases: first scheduled → finished (inference) = prefill (→ first token) + decode.
    inference_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    max_tokens_param: int | None = None
    n_param: int | None = None  # on the first completion of a request only, so n is counted once per request


@dataclass
class IterationStats:
    timestamp: float
    scheduler: SchedulerStats | None = None  # None: no engine batch behind these figures (an abort)
    step: StepInfo | None = None
    ipc_latency: float | None = None  # batch built in the engine → received here
    num_prompt_tokens: int = 0  # prompts of the requests that got their first token
    # ... less the tokens they found in the prefix cache or loaded through a KV connector: the prompt tokens
    # actually computed (vLLM's prompt_token_stats.computed, what its logged prompt throughput counts).
    num_computed_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # With data parallelism: the engine whose batch this is, and its own report (`scheduler` is the sum).
    engine_index: int | None = None
    engine_scheduler: SchedulerStats | None = None


StatLogger = Callable[[IterationStats], None]


def count_new_tokens(stats: IterationStats, request: Request, num_new_tokens: int, ts: float,
                     prev_token_time: float | None) -> None:  # fmt: skip
    """Count `num_new_tokens` that `request` produced at `ts`. `prev_token_time` None: its first tokens
    (time to first token, and its prompt counts as processed), else when its previous tokens came."""
    if prev_token_time is None:
        stats.time_to_first_tokens.append(ts - request.arrival_time)
        stats.num_prompt_tokens += request.num_prompt_tokens
        stats.num_computed_prompt_tokens += computed_prompt_tokens(request)
    else:
        stats.inter_token_latencies.append(ts - prev_token_time)
    stats.num_generation_tokens += num_new_tokens


def count_pooled_prompt(stats: IterationStats, request: Request) -> None:
    """A pooling request finished: its prompt was computed (it produces no tokens to count it by)."""
    stats.num_prompt_tokens += request.num_prompt_tokens
    stats.num_computed_prompt_tokens += computed_prompt_tokens(request)


def computed_prompt_tokens(request: Request) -> int:
    """The prompt tokens the engine computed: the prompt less what its first scheduling found cached
    (prefix cache or KV connector; -1 until then, when nothing was found)."""
    return max(0, request.num_prompt_tokens - max(request.num_cached_tokens, 0))


def record_finished(out: RequestOutput | PoolingRequestOutput, cores: list[Request], stats: IterationStats,
                    take: Callable[[Request], bool]) -> None:  # fmt: skip
    """Append a FinishedRequestStats for each completion of `out` that finished. `take(core)` says whether
    that core request is still uncounted (and marks it counted), so that each counts once. A streamed
    output with n > 1 carries only some of the completions: each is matched to its core by its index."""
    if isinstance(out, PoolingRequestOutput):
        core = cores[0]
        if out.finished and take(core):
            reason = "stop" if out.error is None else ("abort" if "abort" in out.error else "error")
            end = core.finished_time or stats.timestamp
            # A pooled prompt's "first token" is its end: all of its time is prefill.
            stats.finished.append(_finished_stats(core, reason, 0, end, end, None, 1))
        return
    for comp in out.outputs:
        core = cores[comp.index]
        if comp.finish_reason is None or not take(core):
            continue
        stats.finished.append(_finished_stats(core, comp.finish_reason, len(comp.token_ids),
                                              core.finished_time or stats.timestamp, core.first_token_time,
                                              core.sampling_params.max_tokens,
                                              len(cores) if comp.index == 0 else None))


def _finished_stats(core: Request, reason: str, num_generation_tokens: int, end: float,
                    first_token_time: float | None, max_tokens: int | None, n: int | None) -> FinishedRequestStats:
    """vLLM's per-request phases from `core`'s timestamps: queued (arrival → first scheduled), prefill
    (→ first token), decode (→ `end`)."""
    queued = core.first_scheduled_time
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=end - core.arrival_time,
        queue_time=None if queued is None else queued - core.arrival_time,
        num_prompt_tokens=core.num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        inference_time=None if queued is None else end - queued,
        prefill_time=None if queued is None or first_token_time is None else first_token_time - queued,
        decode_time=None if first_token_time is None else end - first_token_time,
        max_tokens_param=max_tokens,
        n_param=n,
    )


def log_stats(stat_loggers: Iterable[StatLogger], stats: IterationStats) -> None:
    """Hand `stats` to every stat logger; one that fails is logged and skipped (figures must never take
    serving or generation down)."""
    for stat_logger in stat_loggers:
        try:
            stat_logger(stats)
        except Exception:
            logger.exception("stat logger failed")
