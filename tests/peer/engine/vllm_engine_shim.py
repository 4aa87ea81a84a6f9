# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32's v1/engine objects that its engine tests drive directly, over tokenloom's. Plumbing only: each
stand-in translates shapes (vLLM's constructor, its numpy logprob rows, its internal / external request ids) and
calls tokenloom's class, which does the work the test checks.

- `EngineCoreRequest`: vLLM's fields (the ones its tests pass); the OutputProcessor stand-in turns it into
  tokenloom's core `Request` under its internal id, and keys the user's output by its external id (vLLM's
  `external_req_id`, which tokenloom's front ends use as the request id: the core requests' ids derive from it).
- `EngineCoreOutput`: vLLM's output fields; `new_logprobs` (a `LogprobsLists` row per token: the sampled token
  first, then the top-n, with the sampled token's rank) and `new_prompt_logprobs_tensors` (one such row per prompt
  position from the second on) become tokenloom's `SampleLogprobs` (the sampled / prompt token, its logprob and
  rank, the top-n as (id, logprob) pairs) and `new_prompt_logprobs` (first position, rows).
- `OutputProcessor`: tokenloom's (tokenloom/engine/output_processor.py) with vLLM's methods; vLLM's tokenizer
  argument (a transformers tokenizer) is wrapped in tokenloom's Tokenizer, which decodes through it.
  `process_outputs(outputs, engine_core_timestamp, iteration_stats)` counts the batch into `iteration_stats` with
  `update_mirrors` (tokenloom/engine/request_mirrors.py), what AsyncLLM does with each batch the engine sends.
- `ParentRequest`: tokenloom's (tokenloom/engine/parallel_sampling.py), built from vLLM's EngineCoreRequest.
- `RequestOutputCollector`: tokenloom's RequestStream (AsyncLLM's per-request output queue, which merges unread
  outputs as vLLM's collector does), with the collector's put / get.
- `IterationStats`: tokenloom's, with vLLM's no-argument constructor (a batch time of 0).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from tokenloom.core.outputs import EngineCoreOutput as _TLEngineCoreOutput
from tokenloom.core.outputs import SampleLogprobs
from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.async_llm import RequestStream
from tokenloom.engine.core_messages import EngineCoreOutputs as _TLEngineCoreOutputs
from tokenloom.engine.iteration_stats import IterationStats as _TLIterationStats
from tokenloom.engine.output_processor import OutputProcessor as _TLOutputProcessor
from tokenloom.engine.parallel_sampling import ParentRequest as _TLParentRequest
from tokenloom.engine.request_mirrors import update_mirrors
from tokenloom.model.tokenizer import Tokenizer
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["EngineCoreOutput", "EngineCoreRequest", "FinishReason", "IterationStats", "LogprobsLists",
           "LogprobsTensors", "OutputProcessor", "OutputProcessorOutput", "ParentRequest", "PrefillStats",
           "RequestOutputCollector"]


class FinishReason(enum.IntEnum):
    """vLLM's v1 FinishReason: its str() is the OpenAI finish_reason, tokenloom's string."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class LogprobsLists(NamedTuple):
    """vLLM's: per token, [sampled, top-1, ..., top-n] ids and logprobs, and the sampled token's rank."""

    logprob_token_ids: Any
    logprobs: Any
    sampled_token_ranks: Any
    cu_num_generated_tokens: Any = None


class LogprobsTensors(NamedTuple):
    """vLLM's: per prompt position (the second on), [prompt token, top-1, ..., top-n] ids and logprobs, and the
    prompt token's rank."""

    logprob_token_ids: Any
    logprobs: Any
    selected_token_ranks: Any


class PrefillStats:
    """vLLM's PrefillStats (its engine core's report of a request's prefill): tokenloom's engine core reports the
    same figure as EngineCoreOutput.num_cached_tokens."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_local_cached_tokens = 0
        self.num_external_cached_tokens = 0

    def set(self, num_prompt_tokens: int, num_local_cached_tokens: int, num_external_cached_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_local_cached_tokens = num_local_cached_tokens
        self.num_external_cached_tokens = num_external_cached_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.num_local_cached_tokens + self.num_external_cached_tokens


@dataclass
class EngineCoreRequest:
    """vLLM's engine-core request, the fields its tests pass."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: Any
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    arrival_time: float
    lora_request: Any
    cache_salt: str | None
    data_parallel_rank: int | None
    external_req_id: str | None = None
    session_id: str | None = None

    @property
    def params(self) -> SamplingParams | PoolingParams:
        return self.sampling_params if self.sampling_params is not None else self.pooling_params  # type: ignore


@dataclass
class EngineCoreOutput:
    """vLLM's engine-core output, the fields its tests set."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Any = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prefill_stats: PrefillStats | None = None

    def as_tokenloom(self, num_cached_tokens: int) -> _TLEngineCoreOutput:
        """`num_cached_tokens`: the request's, which tokenloom's engine core reports on every output (vLLM's in
        the first one's prefill_stats)."""
        return _TLEngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=list(self.new_token_ids),
            new_logprobs=_sample_logprobs(self.new_logprobs),
            finish_reason=None if self.finish_reason is None else str(self.finish_reason),
            stop_reason=self.stop_reason,
            num_cached_tokens=num_cached_tokens,
            new_prompt_logprobs=_prompt_logprobs(self.new_prompt_logprobs_tensors),
            pooling_output=self.pooling_output,
            kv_transfer_params=self.kv_transfer_params,
        )


def _row(ids: Any, logprobs: Any, rank: Any) -> SampleLogprobs:
    """One vLLM logprobs row ([chosen, top-1, ..., top-n]) as tokenloom's SampleLogprobs."""
    ids, logprobs = [int(t) for t in ids], [float(v) for v in logprobs]
    return SampleLogprobs(token_id=ids[0], logprob=logprobs[0], rank=int(rank), top=list(zip(ids[1:], logprobs[1:])))


def _sample_logprobs(lists: LogprobsLists | None) -> list[SampleLogprobs] | None:
    if lists is None:
        return None
    return [_row(ids, lps, rank) for ids, lps, rank in zip(lists.logprob_token_ids, lists.logprobs,
                                                            lists.sampled_token_ranks)]


def _prompt_logprobs(tensors: LogprobsTensors | None) -> tuple[int, list[SampleLogprobs]] | None:
    """vLLM's rows start at the prompt's second position (the first has none): tokenloom's first index is 1."""
    if tensors is None:
        return None
    rows = zip(tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist(), tensors.selected_token_ranks.tolist())
    return 1, [_row(ids, lps, rank) for ids, lps, rank in rows]


# The scheduler's report a batch carries: none here (the tests drive the output side only).
_NO_SCHEDULER_STATS = SchedulerStats(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0, num_free_blocks=0,
                                     num_preemptions_total=0, prefix_cache_queries=0, prefix_cache_hits=0)


class IterationStats(_TLIterationStats):
    """tokenloom's IterationStats with vLLM's constructor (no arguments)."""

    def __init__(self, timestamp: float = 0.0, **kwargs: Any) -> None:
        super().__init__(timestamp, **kwargs)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[Any]
    reqs_to_abort: list[str]


class ParentRequest(_TLParentRequest):
    """tokenloom's ParentRequest, built from vLLM's EngineCoreRequest."""

    def __init__(self, request: EngineCoreRequest) -> None:
        assert request.external_req_id is not None and request.sampling_params is not None
        super().__init__(request.request_id, request.sampling_params, request.external_req_id)


class OutputProcessor:
    """tokenloom's OutputProcessor with vLLM's constructor and methods."""

    def __init__(self, tokenizer: Any, log_stats: bool, stream_interval: int = 1) -> None:
        del log_stats  # tokenloom's front ends count stats beside the OutputProcessor (process_outputs below)
        self._processor = _TLOutputProcessor(None if tokenizer is None else Tokenizer(tokenizer), stream_interval)
        self._mirrors: dict[str, Request] = {}  # internal id -> the core request, as AsyncLLM keeps it
        self._external: dict[str, str] = {}  # internal id -> external id
        self._cached: dict[str, int] = {}  # internal id -> its prefix-cache hit, from its first output

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent_req: Any = None,
                    request_index: int = 0, queue: RequestOutputCollector | None = None) -> None:
        del request_index, queue  # outputs are read from process_outputs (AsyncLLM queues them itself)
        if parent_req is not None:
            raise NotImplementedError("tokenloom's OutputProcessor takes the n children of a request together")
        assert request.external_req_id is not None
        prompt_ids = list(request.prompt_token_ids or [])
        core = Request(request.request_id, prompt_ids, request.sampling_params, arrival_time=request.arrival_time,
                       pooling_params=request.pooling_params, lora_request=request.lora_request)
        self._processor.add_request(request.external_req_id, prompt, prompt_ids, [core], request.arrival_time)
        self._mirrors[request.request_id] = core
        self._external[request.request_id] = request.external_req_id

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput], engine_core_timestamp: float | None = None,
                        iteration_stats: IterationStats | None = None, **_: Any) -> OutputProcessorOutput:
        for out in engine_core_outputs:
            if out.prefill_stats is not None:
                self._cached[out.request_id] = out.prefill_stats.num_cached_tokens
        outputs = [o.as_tokenloom(self._cached.get(o.request_id, 0)) for o in engine_core_outputs]
        # What AsyncLLM does with every batch: the core requests' figures (cached tokens, token times) updated and
        # the batch's tokens counted, before the OutputProcessor reads them.
        batch = _TLEngineCoreOutputs(outputs, engine_core_timestamp or time.monotonic(), _NO_SCHEDULER_STATS, 0)
        update_mirrors(batch, self._mirrors, iteration_stats if iteration_stats is not None else IterationStats())
        request_outputs, reqs_to_abort = self._processor.process_outputs(outputs)
        for out in outputs:
            if out.finished or out.request_id in reqs_to_abort:
                self._mirrors.pop(out.request_id, None)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def abort_requests(self, request_ids: list[str], internal: bool) -> list[str]:
        """vLLM's: ids are internal (the core requests') or external (the user's); returns the internal ids."""
        external = [self._external.get(rid, rid) for rid in request_ids] if internal else list(request_ids)
        aborted = []
        for rid in external:
            aborted.extend(self._processor.core_ids(rid))
            self._processor.finish_aborted(rid)
        return aborted

    def get_num_unfinished_requests(self) -> int:
        return self._processor.num_unfinished()

    def has_unfinished_requests(self) -> bool:
        return self._processor.has_unfinished_requests()


class RequestOutputCollector:
    """vLLM's per-request output queue: tokenloom's RequestStream, whose unread outputs merge as vLLM's do."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.request_id = request_id
        self._stream = RequestStream(None, merge_kind=output_kind)  # type: ignore[arg-type]

    def put(self, output: Any) -> None:
        self._stream.pending.add(output.request_id)
        self._stream._put(output)

    async def get(self) -> Any:
        return await self._stream.__anext__()

