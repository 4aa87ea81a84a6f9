"""What crosses the boundary between the scheduler and a runner: plain dataclasses, nothing else.

A runner (the torch ModelRunner or the cost-model SimulatedRunner) sees only a SchedulerOutput and
answers with a ModelRunnerOutput; the scheduler turns that into per-request EngineCoreOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: newly admitted, or resumed after preemption.

    `prefill_token_ids` is the whole current sequence (prompt + outputs so far, so a resumed
    request recomputes its outputs too); `num_computed_tokens` is where this step starts
    (its prefix-cache hit, or 0). `block_ids`: its block table, one list per KV cache group
    (vLLM's tuple; one group unless the model mixes sliding and full layers).
    """

    req_id: str
    prompt_token_ids: list[int]
    prefill_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # A pooling request (embed, classify, ...): the runner pools its hidden states when its prompt is
    # fully computed instead of sampling; None for generation.
    pooling_params: PoolingParams | None = None
    # The request's LoRA adapter (tokenloom.lora.request.LoRARequest, vLLM's field); None: the base model.
    lora_request: Any = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed since their last step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # per request, per KV cache group
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step. Insertion order: running first, then admitted.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Finished (or aborted) between the previous step and this one: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted while building this step: the runner drops their state too.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests resumed after preemption (they also appear in scheduled_new_reqs).
    resumed_req_ids: set[str] = field(default_factory=set)
    # Observability: the prefix-cache hit (tokens) of each request admitted this step, the
    # tokens of each request that are prefill (vs. one decode token), and what bound the step.
    cached_tokens: dict[str, int] = field(default_factory=dict)
    num_prefill_tokens: dict[str, int] = field(default_factory=dict)
    bound_by: str = "nothing"
    # Structured outputs: the constrained requests that sample this step, and their grammar bitmask
    # (rows in this order: one per scheduled draft plus one, per request; int32 words, one bit per
    # vocabulary entry, 1 = allowed). `pending_structured_output_tokens` (async scheduling): a
    # constrained request has a token in flight, so the bitmask waits for it (vLLM's field; the
    # engine core fills it with Scheduler.fill_grammar_bitmask once that step's output is in).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    pending_structured_output_tokens: bool = False
    # Async scheduling with drafts: per request, how many of its placeholder drafts the grammar cut
    # (padded back with -1 by Scheduler.update_draft_token_ids_in_output; not counted as drafted).
    num_invalid_spec_tokens: dict[str, int] = field(default_factory=dict)
    # What an opt-in scheduling policy did this step and why (core/policies.py); empty by default.
    policy_actions: dict[str, Any] = field(default_factory=dict)
    # With LoRA enabled: the adapter name of each scheduled request that runs one (the step trace's "lora").
    lora_names: dict[str, str] = field(default_factory=dict)
    # Under the SLO token budget only: the profile's seconds for this step as scheduled, and for its
    # decode part (StepShape.decode_part); the engine core reports the measured time next to it
    # (Scheduler.observe_step_time).
    predicted_step: tuple[float, float] | None = None
    # A KV connector's instructions to its worker side for this step (tokenloom/kv_transfer; vLLM's
    # field): which blocks to load before the forward and to save after it. None without a connector.
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class SampleLogprobs:
    """Log-probabilities around one sampled token."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # the top-n (token_id, logprob), best first


@dataclass
class KVConnectorOutput:
    """vLLM's KVConnectorOutput: what a KV connector's worker side reports after a step.

    finished_sending / finished_recving: requests whose asynchronous transfers ended (blocks held back
    for a send can be freed); invalid_block_ids: blocks whose load failed (their tokens are recomputed);
    kv_connector_stats: the connector's own figures for the step (its scheduler side reads them)."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: dict[str, Any] | None = None


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request in req_ids: empty for a prefill chunk that did not reach the end.
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[SampleLogprobs]] | None = None
    # prompt_logprobs of the prompt tokens this step computed: req_id -> (index of the first prompt
    # token scored, one SampleLogprobs per scored token). Only for requests that asked.
    prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]] | None = None
    # Requests whose execution failed: they are finished with an error, the rest go on.
    failed: dict[str, str] = field(default_factory=dict)
    # Wall (or simulated) seconds the step took to execute, when the runner knows it.
    execute_time: float | None = None
    # When the executor ran the step (time.monotonic seconds), for the step trace's timeline: under
    # async scheduling it overlaps the scheduling of the next step.
    execute_start: float | None = None
    execute_end: float | None = None
    # Pooling requests whose prompt this step completed: req_id -> the pooled output (a float32 numpy
    # array: [H], [L, H], or the class probabilities). vLLM's ModelRunnerOutput.pooler_output.
    pooler_output: dict[str, Any] | None = None
    # The worker side of a KV connector reports on the step (vLLM's kv_connector_output); None without one.
    kv_connector_output: KVConnectorOutput | None = None

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0  # prompt tokens written to the prefix cache (vLLM's PrefillStats)
    error: str | None = None
    new_prompt_logprobs: tuple[int, list[SampleLogprobs]] | None = None  # see ModelRunnerOutput
    pooling_output: Any = None  # a pooling request's result (it finishes in the same output)
    # What the KV connector returned for the request when it finished (vLLM's field; disaggregated prefill:
    # the prefill engine's blocks for the decode engine). None without a connector.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
