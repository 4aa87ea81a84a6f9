"""Figures the API process derives from each batch of engine outputs, for metrics (vLLM's IterationStats).

AsyncLLM fills one IterationStats per batch it receives (and one per abort it performs) and hands it to
its stat loggers, e.g. the server's Prometheus metrics. Latencies are seconds on `time.monotonic()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.core_messages import StepInfo


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
