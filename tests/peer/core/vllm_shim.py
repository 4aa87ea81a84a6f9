"""Plumbing that lets vLLM's scheduler unit tests (tests/v1/core) run against tokenloom.core unchanged.

Only names and shapes are adapted, never behaviour: vLLM's constructors and keyword arguments map onto
tokenloom's (a request's block ids come as one KV-cache group, as vLLM's single-group tuple; vLLM's
`num_blocks` counts its null block, tokenloom's does not); arguments for machinery tokenloom lacks
(multimodal, KV connectors, pooling) are dropped where the tests pass their neutral values. Anything a
test asserts is tokenloom's own answer.

Beyond names: vLLM's random priority test gives requests image items, which Request drops (tokenloom has
no encoder; its outputs carry vLLM's encoder fields empty), and vLLM's MockKVConnector is a tokenloom
connector here (MockKVConnector below). A scheduler's output keeps tokenloom's shape, vLLM's V2 model
runner's (a resumed request comes whole, among the new ones), unless built as vLLM builds its V1 one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tokenloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core import outputs as tl_outputs
from tokenloom.core.async_scheduler import AsyncScheduler
from tokenloom.core.block_pool import FreeKVCacheBlockQueue as _TLQueue
from tokenloom.core.block_pool import KVCacheBlock as _TLBlock
from tokenloom.core.request import Request as _TLRequest
from tokenloom.core.request import RequestStatus
from tokenloom.core.scheduler import Scheduler as _TLScheduler
from tokenloom.core.structured_output import StructuredOutputManager
from tokenloom.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams as _TLSamplingParams
from tokenloom.sampling_params import StructuredOutputsParams

EOS_TOKEN_ID = 50256
# max_position_embeddings of the models the tests name
_MODEL_MAX_LEN = {"facebook/opt-125m": 2048, "Qwen/Qwen2.5-VL-3B-Instruct": 128000}
__all__ = ["EOS_TOKEN_ID", "RequestStatus", "create_scheduler", "create_requests", "Request", "SamplingParams",
           "ModelRunnerOutput", "SchedulerOutput", "CachedRequestData", "check_stop", "KVCacheBlock",
           "FreeKVCacheBlockQueue", "DraftTokenIds", "_step_until_done", "StructuredOutputsParams", "ConstantList",
           "AsyncScheduler", "VllmConfig", "MultiModalFeatureSpec", "MultiModalKwargsItem", "PlaceholderRange",
           "get_hash_fn_by_name", "get_request_block_hasher", "init_none_hash", "mock_kv",
           "PoolingParams", "VllmRequestStatus", "make_output", "assert_scheduler_empty"]


class SamplingParams(_TLSamplingParams):
    def update_from_generation_config(self, generation_config: dict, model_eos_token_id: int | None = None) -> None:
        self.eos_token_id = model_eos_token_id


@dataclass
class DraftTokenIds:
    """vLLM's vllm.v1.outputs.DraftTokenIds: the proposer's drafts after a step."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass
class EngineCoreOutputs:
    """vLLM's per-client batch of outputs, with the step's scheduler stats."""

    outputs: list = field(default_factory=list)
    scheduler_stats: Any = None


@dataclass
class VllmConfig:
    """The part of vLLM's VllmConfig the tests read off a scheduler (its cache_config)."""

    cache_config: Any


@dataclass
class PlaceholderRange:
    offset: int
    length: int


@dataclass
class MultiModalKwargsItem:
    @staticmethod
    def dummy() -> MultiModalKwargsItem:
        return MultiModalKwargsItem()


@dataclass
class MultiModalFeatureSpec:
    """vLLM's multimodal item of a request; tokenloom has no encoder, so the shim's Request drops them."""

    data: Any
    mm_position: PlaceholderRange
    identifier: str
    modality: str


def get_hash_fn_by_name(name: str) -> str:
    return name


def init_none_hash(hash_fn: Any) -> None:
    """vLLM seeds its block-hash chain here; tokenloom's root is fixed per algorithm (core/block_hash.py
    root_parent_hash), and the scheduler's cache config names the algorithm."""


def get_request_block_hasher(block_size: int, hash_fn: Any) -> None:
    """vLLM hands each Request a block hasher; a tokenloom Request hashes its own full blocks."""
    return None


@dataclass(frozen=True)
class MockKVConfig:
    """vLLM's tests/v1/kv_connector/unit/utils.py MockKVConfig: what its MockKVConnector answers."""

    matched_tokens: int = 0
    is_async: bool = False
    num_defers_before_matching: int = 0


def mock_kv(matched_tokens: int, is_async: bool, num_defers_before_matching: int = 0) -> MockKVConfig:
    return MockKVConfig(matched_tokens, is_async, num_defers_before_matching)


class MockKVConnector(KVConnectorBase_V1):
    """vLLM's MockKVConnector (scheduler side) as a tokenloom connector: `matched_tokens` external tokens
    for every request, loaded asynchronously or not, after `num_defers_before_matching` "cannot tell yet"."""

    def __init__(self, mock: MockKVConfig, kv_role: str = "kv_both") -> None:
        super().__init__(SimpleNamespace(kv_role=kv_role, kv_load_failure_policy="recompute"),  # type: ignore[arg-type]
                         KVConnectorRole.SCHEDULER)
        self.mock = mock
        self._defers_left: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: _TLRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        defers = self._defers_left.setdefault(request.request_id, self.mock.num_defers_before_matching)
        if defers > 0:
            self._defers_left[request.request_id] -= 1
            return None, False
        return self.mock.matched_tokens, self.mock.is_async

    def update_state_after_alloc(self, request: _TLRequest, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class _Scheduler(_TLScheduler):
    """tokenloom's Scheduler (NewRequestData.block_ids is already vLLM's one list per KV cache group),
    with vLLM's shapes at two seams: update_from_output returns the outputs by client index (one client,
    0) with the stats vLLM's make_stats attaches there, the step's own spec-decoding stats among them;
    update_draft_token_ids takes vLLM's DraftTokenIds."""

    # tokenloom's runner interface is vLLM's V2 model runner's: a resumed request comes whole, in
    # scheduled_new_reqs. vLLM's create_scheduler_with_priority picks its V1 runner's unless told otherwise.
    use_v2_model_runner = True

    def schedule(self) -> tl_outputs.SchedulerOutput:
        """tokenloom's output with vLLM's encoder fields, empty (tokenloom schedules no encoder inputs), in
        the V1 runner's shape when asked: resumed requests among the cached ones, after the running ones."""
        output = super().schedule()
        output.scheduled_encoder_inputs = {}  # type: ignore[attr-defined]
        output.free_encoder_mm_hashes = []  # type: ignore[attr-defined]
        for new_req in output.scheduled_new_reqs:
            new_req.mm_features = []  # type: ignore[attr-defined]
        cached = output.scheduled_cached_reqs
        cached.resumed_req_ids = set()  # type: ignore[attr-defined]
        cached.all_token_ids = {}  # type: ignore[attr-defined]
        if not self.use_v2_model_runner:
            resumed = [r for r in output.scheduled_new_reqs if r.req_id in output.resumed_req_ids]
            output.scheduled_new_reqs = [r for r in output.scheduled_new_reqs if r.req_id not in output.resumed_req_ids]
            for r in resumed:
                cached.req_ids.append(r.req_id)
                cached.new_block_ids.append(r.block_ids)
                cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.resumed_req_ids = {r.req_id for r in resumed}  # type: ignore[attr-defined]
            cached.all_token_ids = {r.req_id: list(r.prefill_token_ids) for r in resumed}  # type: ignore[attr-defined]
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        stats = self.make_stats()
        stats.spec_decoding_stats = self.spec_decoding_stats  # type: ignore[attr-defined]
        return {0: EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)}

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:  # type: ignore[override]
        super().update_draft_token_ids(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)


class _AsyncScheduler(_Scheduler, AsyncScheduler):
    """tokenloom's AsyncScheduler with the same seams (vLLM's create_scheduler(async_scheduling=True))."""


def create_scheduler(
    model: str = "facebook/opt-125m",
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 8192,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    long_prefill_token_threshold_adaptive: bool = False,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
    speculative_method: str | None = None,
    policy: str = "fcfs",
    skip_tokenizer_init: bool = False,
    async_scheduling: bool = False,
    use_kv_connector: MockKVConfig | None = None,
    kv_role: str = "kv_both",
    **unused: Any,
) -> _Scheduler:
    sched = SchedulerConfig(policy=policy,  # type: ignore[arg-type]

        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_model_len=max_model_len or max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=long_prefill_token_threshold_adaptive,
        async_scheduling=async_scheduling,
    )
    # vLLM's pool counts block 0, its null block, which no request ever gets.
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks - 1, enable_prefix_caching=enable_prefix_caching)
    # vLLM's helper builds an n-gram SpeculativeConfig when num_speculative_tokens is given; with a
    # speculative_method, n-grams of 1 to K tokens. Its "ngram_gpu" proposes the same drafts in the
    # worker, which under async scheduling the scheduler sees as K placeholders either way.
    spec = None
    if num_speculative_tokens:
        lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": num_speculative_tokens} if speculative_method else {}
        spec = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens, method="ngram", **lookup)
    # vLLM's scheduler takes max_model_len from the model config: the helper's max_model_len when given
    # (it passes it to both configs), else the model's own (opt-125m: 2,048), while SchedulerConfig's
    # checks, made above, default to the token budget.
    object.__setattr__(sched, "max_model_len", max_model_len or _MODEL_MAX_LEN[model])
    scheduler_cls = _AsyncScheduler if async_scheduling else _Scheduler
    scheduler = scheduler_cls(sched, cache, clock=lambda: 0.0, speculative_config=spec)
    if use_kv_connector is not None:
        # vLLM's helper also builds its ExampleConnector (use_kv_connector=True) or one named by a string;
        # tokenloom's counterparts need a worker side and storage, and no vendored case uses them.
        if not isinstance(use_kv_connector, MockKVConfig):
            raise NotImplementedError(f"vllm_shim: use_kv_connector={use_kv_connector!r} (only mock_kv(...))")
        scheduler.connector = MockKVConnector(use_kv_connector, kv_role)
    scheduler.vllm_config = VllmConfig(cache_config=SimpleNamespace(  # type: ignore[attr-defined]
        block_size=block_size, prefix_caching_hash_algo="sha256"))
    if skip_tokenizer_init:
        # vLLM's scheduler always has a StructuredOutputManager; with skip_tokenizer_init it has no
        # tokenizer, hence no grammar backend (tokenloom: a manager built without a backend factory).
        scheduler.structured_output_manager = StructuredOutputManager(None)
    return scheduler


class ConstantList(Sequence):
    """vLLM's vllm.v1.utils.ConstantList: a read-only view of a list."""

    def __init__(self, x: list) -> None:
        self._x = x

    def __getitem__(self, item: Any) -> Any:
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)


class _Request(_TLRequest):
    """tokenloom's Request under vLLM's names: update_block_hashes(), and all_token_ids, which vLLM's
    tests rebind to a fresh view after replacing _all_token_ids (tokenloom's always reads _all_token_ids,
    so the view must be of that list)."""

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @all_token_ids.setter
    def all_token_ids(self, view: ConstantList) -> None:
        assert view._x is self._all_token_ids, "all_token_ids must be a view of _all_token_ids"

    def update_block_hashes(self) -> None:
        self._update_block_hashes()


def Request(request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None,  # noqa: N802
            pooling_params: Any = None, arrival_time: float = 0.0, priority: int = 0, block_size: int = 16,
            mm_features: Any = None, **unused: Any) -> _TLRequest:
    return _Request(request_id, prompt_token_ids, sampling_params, arrival_time=arrival_time, priority=priority,
                    block_size=block_size, pooling_params=pooling_params)


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    stop_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
    same_prompt: bool = False,
    block_size: int = 16,
    req_ids: list[str] | None = None,
    ignore_eos: bool = False,
    **unused: Any,
) -> list[_TLRequest]:
    requests = []
    for i in range(num_requests):
        params = SamplingParams(ignore_eos=ignore_eos, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                prompt_logprobs=prompt_logprobs)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        prompt = [0] * num_tokens if same_prompt else [i] * num_tokens
        rid = req_ids[i] if req_ids else f"{i}"
        requests.append(Request(rid, prompt, params, block_size=block_size))
    return requests


def ModelRunnerOutput(req_ids: list[str], req_id_to_index: dict[str, int],  # noqa: N802
                      sampled_token_ids: list[list[int]], logprobs: Any = None,
                      prompt_logprobs_dict: dict | None = None, pooler_output: Any = None,
                      **unused: Any) -> tl_outputs.ModelRunnerOutput:
    return tl_outputs.ModelRunnerOutput(req_ids=req_ids, req_id_to_index=req_id_to_index,
                                        sampled_token_ids=sampled_token_ids, logprobs=logprobs)


class CachedRequestData(tl_outputs.CachedRequestData):
    @staticmethod
    def make_empty() -> tl_outputs.CachedRequestData:
        return tl_outputs.CachedRequestData()


def SchedulerOutput(scheduled_new_reqs: list, scheduled_cached_reqs: Any,  # noqa: N802
                    num_scheduled_tokens: dict[str, int], total_num_scheduled_tokens: int,
                    scheduled_spec_decode_tokens: dict[str, list[int]] | None = None,
                    finished_req_ids: set[str] | None = None, **unused: Any) -> tl_outputs.SchedulerOutput:
    return tl_outputs.SchedulerOutput(
        scheduled_new_reqs=scheduled_new_reqs, scheduled_cached_reqs=scheduled_cached_reqs,
        num_scheduled_tokens=num_scheduled_tokens, total_num_scheduled_tokens=total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=scheduled_spec_decode_tokens or {}, finished_req_ids=finished_req_ids or set(),
    )


def check_stop(request: _TLRequest, max_model_len: int) -> bool:
    """vLLM's vllm.v1.core.sched.utils.check_stop: tokenloom's scheduler check, for one request."""
    probe = object.__new__(_TLScheduler)
    probe.max_model_len = max_model_len
    return _TLScheduler._check_stop(probe, request)


class KVCacheBlock(_TLBlock):
    """vLLM's names for the free-list links."""

    __slots__ = ()

    prev_free_block = property(lambda self: self.prev_free, lambda self, v: setattr(self, "prev_free", v))
    next_free_block = property(lambda self: self.next_free, lambda self, v: setattr(self, "next_free", v))


class FreeKVCacheBlockQueue(_TLQueue):
    """vLLM's names: the sentinels are fake_free_list_head/tail, append() is append_n([block])."""

    def __init__(self, blocks: list) -> None:
        super().__init__(blocks)
        self._head.__class__ = KVCacheBlock
        self._tail.__class__ = KVCacheBlock

    @property
    def fake_free_list_head(self) -> KVCacheBlock:
        return self._head  # type: ignore[return-value]

    @property
    def fake_free_list_tail(self) -> KVCacheBlock:
        return self._tail  # type: ignore[return-value]

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])


def create_scheduler_with_priority(enable_prefix_caching: bool = False, use_v2_model_runner: bool | None = None,
                                   use_kv_connector: bool = False, **kwargs: Any) -> _Scheduler:
    """vLLM's helper of the same name: the priority policy, prefix caching off unless asked, and its V1
    model runner's output shape unless the V2 one is asked for (its default, bool(VLLM_USE_V2_MODEL_RUNNER),
    is False with the variable unset). Its use_kv_connector builds vLLM's ExampleConnector over an empty
    storage directory, which finds no KV to load and holds no block back, so it changes no decision of the
    cases that pass it; none is built here."""
    scheduler = create_scheduler(policy="priority", enable_prefix_caching=enable_prefix_caching, **kwargs)
    scheduler.use_v2_model_runner = bool(use_v2_model_runner)
    return scheduler


def create_requests_with_priority(
    num_requests: int,
    priorities: list[int],
    arrival_times: list[float] | None = None,
    num_tokens: int = 10,
    max_tokens: int = 16,
    stop_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
    starting_idx: int = 0,
    same_prompt: bool = False,
    block_size: int = 16,
    req_ids: list[str] | None = None,
    **unused: Any,
) -> list[_TLRequest]:
    """vLLM's helper of the same name (same prompts, ids and arrival times)."""
    arrival_times = arrival_times or [float(i) for i in range(num_requests)]
    req_ids = req_ids or [f"{i + starting_idx}" for i in range(num_requests)]
    params = SamplingParams(ignore_eos=False, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                            prompt_logprobs=prompt_logprobs)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return [
        Request(req_ids[i], [starting_idx] * num_tokens if same_prompt else [i + starting_idx] * num_tokens,
                params, arrival_time=arrival_times[i], priority=priorities[i], block_size=block_size)
        for i in range(num_requests)
    ]


def _step_until_done(scheduler: _TLScheduler, output: tl_outputs.SchedulerOutput,
                     model_runner_output: tl_outputs.ModelRunnerOutput) -> None:
    """vLLM's helper of this name in test_scheduler.py: update, then schedule and update until every
    request finished. Its KV-connector asserts have no counterpart (no connector)."""
    all_finished = False
    scheduler.update_from_output(output, model_runner_output)
    while not all_finished:
        output = scheduler.schedule()
        assert len(scheduler.running)
        for num_scheduled_tokens in output.num_scheduled_tokens.values():
            assert num_scheduled_tokens == 1  # in the decode phase now
        ecos = scheduler.update_from_output(output, model_runner_output)[0]
        all_finished = all(eco.finish_reason is not None for eco in ecos.outputs)


# --- peer-sched: helpers of the cases vendored with max_num_active_seqs, the adaptive long-prefill threshold,
# --- the deferred-waiting stats, pooling, the memory-leak check and the priority cases (2026-12-06) ---------

# tokenloom's RequestStatus has vLLM 0.32's names (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR since 2026-12-07).
VllmRequestStatus = RequestStatus


def make_output(scheduler: _TLScheduler) -> tl_outputs.ModelRunnerOutput:
    """vLLM's helper of this name in test_scheduler.py: one token (1000) for every running request."""
    return ModelRunnerOutput(
        req_ids=[req.request_id for req in scheduler.running],
        req_id_to_index={req.request_id: i for i, req in enumerate(scheduler.running)},
        sampled_token_ids=[[1000]] * len(scheduler.running),
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def assert_scheduler_empty(scheduler: _TLScheduler) -> None:
    """vLLM's helper of this name in test_scheduler.py: nothing left behind. Its encoder-cache checks have no
    counterpart (no encoder cache); vLLM's coordinator.single_type_managers are tokenloom's
    kv_cache_manager.managers, and vLLM's pool counts its null block (never free), tokenloom's has none."""
    assert len(scheduler.requests) == 0
    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_req_ids) == 0

    manager = scheduler.kv_cache_manager.managers[0]
    assert len(manager.req_to_blocks) == 0
    assert len(manager.num_cached_block) == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_blocks
    for block in pool.blocks:
        assert block.ref_cnt == 0
