"""What the engine hands back to users: vLLM's offline API shapes (RequestOutput, CompletionOutput)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

# Defined in tokenloom/logprobs.py (vLLM's vllm.logprobs); code also imports Logprob from here.
from tokenloom.logprobs import Logprob, PromptLogprobs, SampleLogprobs  # noqa: F401  (Logprob: re-exported)

logger = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: token_id -> Logprob (the sampled token and the top-n); a FlatLogprobs
    # read the same way with SamplingParams(flat_logprobs=True).
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # Since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None
    lora_request: Any = None  # vLLM's: the LoRA adapter this completion ran with, or None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timestamps (seconds on the engine's clock) and the latencies they give."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(init=False)
class RequestOutput:
    """vLLM's RequestOutput, with its constructor (same parameters, same order): a keyword it does not know is
    ignored with a warning, vLLM's forward compatibility (code written for a newer vLLM still runs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # prompt_logprobs: per prompt token None (the first) or token_id -> Logprob (the prompt's + the top-n).
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None
    lora_request: Any  # vLLM's: the LoRA adapter the request ran with (a LoRARequest), or None
    encoder_prompt: str | None  # vLLM's encoder-decoder fields: None here (decoder-only models)
    encoder_prompt_token_ids: list[int] | None
    num_cached_tokens: int
    # Prompt tokens this request wrote to the prefix cache (vLLM's num_cache_creation_tokens).
    num_cache_creation_tokens: int
    # vLLM's: the KV connector's parameters for the request when it finished (disaggregated prefill).
    kv_transfer_params: dict[str, Any] | None
    error: str | None  # tokenloom's: why the request failed, or None

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 prompt_logprobs: PromptLogprobs | None, outputs: list[CompletionOutput], finished: bool,
                 metrics: RequestMetrics | None = None, lora_request: Any = None, encoder_prompt: str | None = None,
                 encoder_prompt_token_ids: list[int] | None = None, num_cached_tokens: int | None = None,
                 num_cache_creation_tokens: int | None = None, *, kv_transfer_params: dict[str, Any] | None = None,
                 error: str | None = None, **kwargs: Any) -> None:  # fmt: skip
        if kwargs:
            _warn_extra_arguments(kwargs)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens or 0
        self.num_cache_creation_tokens = num_cache_creation_tokens or 0
        self.kv_transfer_params = kv_transfer_params
        self.error = error

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: merge a later output of the same request into this one (its streaming collector does, when a
        consumer falls behind). `aggregate` (DELTA outputs): a completion's new text, token ids and logprobs are
        appended to the one of the same index; otherwise (CUMULATIVE) it replaces it. A completion of an index
        not seen yet is added."""
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        if next_output.error is not None:
            self.error = next_output.error
        for nxt in next_output.outputs:
            for i, comp in enumerate(self.outputs):
                if comp.index != nxt.index:
                    continue
                if aggregate:
                    comp.text += nxt.text
                    comp.token_ids = list(comp.token_ids) + list(nxt.token_ids)
                    if nxt.logprobs:
                        assert comp.logprobs is not None
                        comp.logprobs.extend(nxt.logprobs)  # a list, or a FlatLogprobs (its extend)
                    comp.cumulative_logprob = nxt.cumulative_logprob
                    comp.finish_reason = nxt.finish_reason
                    comp.stop_reason = nxt.stop_reason
                    # tokenloom's delta fields: a DELTA output's are its whole content.
                    comp.delta_text, comp.delta_token_ids = comp.text, list(comp.token_ids)
                    comp.delta_logprobs = comp.logprobs
                else:
                    self.outputs[i] = nxt
                    _carry_deltas(comp, nxt)
                break
            else:
                self.outputs.append(nxt)


def _carry_deltas(earlier: CompletionOutput, merged: CompletionOutput) -> None:
    """tokenloom's delta fields of a cumulative completion replacing an unread one: what is new since the last
    output the consumer read, so the unread output's part too."""
    merged.delta_text = earlier.delta_text + merged.delta_text
    merged.delta_token_ids = list(earlier.delta_token_ids) + list(merged.delta_token_ids)
    if isinstance(earlier.delta_logprobs, list) and isinstance(merged.delta_logprobs, list):
        merged.delta_logprobs = earlier.delta_logprobs + merged.delta_logprobs


def _warn_extra_arguments(kwargs: dict[str, Any]) -> None:
    if not _warned_extra_arguments:  # once per process, as vLLM's warning_once
        _warned_extra_arguments.append(True)
        logger.warning("RequestOutput: Ignoring extra arguments: %s", kwargs)


_warned_extra_arguments: list[bool] = []


# Pooling models (vLLM's vllm/outputs.py shapes) -----------------------------------------------------


@dataclass
class PoolingOutput:
    """A pooling request's result: `data` is a torch tensor ([H], [L, H] or the class probabilities)."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if data.dim() != 1:
            raise ValueError("an embedding is one vector per prompt")
        return cls(out.request_id, EmbeddingOutput(data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
