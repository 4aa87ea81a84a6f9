"""What crosses the pipes between the API process and the engine-core process.

API → engine: EngineCoreRequest (one per core request; `n > 1` is already fanned out), AbortRequests,
Shutdown. Engine → API: EngineProgress while loading, EngineReady once (or EngineFailed), then one
EngineCoreOutputs per loop iteration that did something, and EngineFailed if the loop dies. All are
plain dataclasses, pickled by multiprocessing.Connection; timestamps are `time.monotonic()`, which is
one clock for every process on the machine, so the API process can subtract them from its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    pooling_params: PoolingParams | None = None  # a pooling request (prefill only, pooled output)
    lora_request: Any = None  # its LoRA adapter (tokenloom.lora.request.LoRARequest), or None
    # vLLM's: the reasoning gate of a constrained request (tokenloom/core/structured_output.py).
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None

    @classmethod
    def from_request(cls, request: Request) -> EngineCoreRequest:
        """What crosses the pipe for a front end's core Request (the engine process builds its own from it)."""
        so = request.structured_output_request
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params, request.arrival_time,
                   request.priority, pooling_params=request.pooling_params, lora_request=request.lora_request,
                   reasoning_ended=so.reasoning_ended if so is not None else None,
                   reasoning_parser_kwargs=so.reasoning_parser_kwargs if so is not None else None)

    def to_request(self) -> Request:
        """The engine process's own Request for it."""
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params, arrival_time=self.arrival_time,
                       priority=self.priority, pooling_params=self.pooling_params, lora_request=self.lora_request,
                       reasoning_ended=self.reasoning_ended, reasoning_parser_kwargs=self.reasoning_parser_kwargs)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class EngineReady:
    """What the API process needs to know about the loaded engine (it never loads the model)."""

    model_name: str
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_id: int | None
    vocab_size: int
    dtype: str
    device: str
    load_time_s: float
    quantization: str | None = None
    # The model's generation_config.json defaults (tokenloom/engine/generation_config.py).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    extra_eos_token_ids: list[int] = field(default_factory=list)
    # What a request's KV needs (tokenloom/core/prompt_fit.py): each KV cache group's sliding window
    # (None: full attention; one None: a model without windows) and the tokens in flight that size a
    # sliding group's cap.
    kv_cache_group_windows: list[int | None] = field(default_factory=lambda: [None])
    max_in_flight_tokens: int = 0
    # The token budget in force (config.token_budget_labels): /metrics' tokenloom:token_budget_info.
    token_budget: dict[str, str] = field(default_factory=dict)
    # A pooling model (--runner pooling): its tasks and defaults (engine/pooling.py); None: generation.
    pooling: Any = None
    # With --enable-lora: what the API process checks adapters against before it serves them
    # (tokenloom/lora/peft_loader.py): max_loras, max_lora_rank, num_layers, target_shapes. None: no LoRA.
    lora: dict[str, Any] | None = None
    # The custom logits processors the engine built, as "module:Class" names: the front end loads them to run
    # their validate_params on each request (tokenloom/sample/logits_processor).
    logits_processors: list[str] = field(default_factory=list)
    # With --speculative-config: its K, the drafts per step (0: no speculative decoding). The front end's
    # metrics export the spec-decode counters from the start then, as vLLM's, not from the first drafts.
    num_speculative_tokens: int = 0
    # With --reasoning-parser: its start and end strings as token ids (vLLM's ReasoningConfig), what a request's
    # thinking_token_budget counts from and forces; None without a parser (the budget is then refused).
    reasoning_token_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # --custom-histogram-buckets (vLLM's ObservabilityConfig, checked): the front end's Prometheus histograms
    # (engine/metrics.py) take these bounds for their families. None: every family's default.
    custom_histogram_buckets: dict[str, list[float]] | None = None
    # What the KV cache stores (float32, bfloat16, float16, int8): --kv-cache-dtype as resolved (auto: the model's
    # dtype, config.auto_kv_cache_dtype); "" from an engine that does not say.
    kv_cache_dtype: str = ""


@dataclass
class EngineProgress:
    """While the model loads, about once a second: the CPU seconds the engine and its child processes
    (kernel compilers) have used so far, and the last thing it logged. The API process waits as long as
    either moves (TOKENLOOM_ENGINE_READY_TIMEOUT bounds a stall, not the load)."""

    cpu_s: float
    stage: str


@dataclass
class EngineFailed:
    """The engine could not start, or its loop died; the message says why."""

    message: str


@dataclass
class StepInfo:
    num_tokens: int  # tokens scheduled in the step (iteration tokens)
    duration_s: float  # schedule + execute + update


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    timestamp: float  # when the batch was built (after the step)
    stats: SchedulerStats
    num_requests_received: int  # core requests added so far (to count those still in the pipe)
    step: StepInfo | None = None  # None: no step ran (only messages were handled)
    # request id -> first time it was scheduled, reported once (the API process computes queue time).
    first_scheduled: dict[str, float] = field(default_factory=dict)
    # request id -> times it was preempted, for requests finished in this batch that ever were.
    num_preemptions: dict[str, int] = field(default_factory=dict)
    engine_index: int = 0  # the data-parallel rank of the engine that sent it
