"""The Scheduler class itself (vLLM V1's unified, iteration-level scheduler); core/scheduler_factory.py only picks
which scheduler class a configuration runs.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` and
`num_tokens_with_spec`; every step the scheduler hands out tokens from one shared budget so that
the first catches up with the second:

1. RUNNING requests first, in order, each taking min(deficit, long_prefill_token_threshold,
   budget left). When `allocate_slots` finds no room, a victim is preempted (FCFS: the last of
   running; priority: the largest (priority, arrival_time)), loses its blocks and progress, and
   goes back to WAITING; if the victim is the request itself, the running pass stops.
2. WAITING requests next, in policy order, while budget is left and len(running) < max_num_seqs (or
   the lower max_num_active_seqs), but only if nobody was preempted in this step. With chunked
   prefill off, a prompt that does not fit the budget left stops admission (break, not skip).
3. The SchedulerOutput is built from the progress *before* the step; then progress advances
   (the "computed frontier"), so a prefill chunk can be scheduled again before its output returns.

The line-by-line reference is `vllm/v1/core/sched/scheduler.py` (vLLM 0.32); differences are listed
in docs/scheduler.md. `schedule()` reads as those three parts: `_apply_policies` (the opt-in policies
beyond vLLM, off by default), `_schedule_running`, `_schedule_waiting`, then `_make_output`; what the
step has decided so far travels in one `_StepPlan`. Every policy beyond vLLM (the automatic and the
SLO budget, the bounded prefill wait, priority preemption, the comparison batching modes) is a
`StepPolicy` (core/policies.py): the scheduler calls its hooks at fixed points (arrival, admission,
free; preempt, budget, reserve, admission and decode holds, the built output; the step's measured time)
and holds no policy's logic itself.

It implements SchedulerInterface (core/sched_interface.py), all the engine core sees of a scheduler.
AsyncScheduler (core/async_scheduler.py) subclasses it, as vLLM's does, for async scheduling's
placeholders; core/scheduler_factory.py picks the class for a configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenloom.config import (
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    SpeculativeConfig,
    check_long_prefill_threshold,
)
from tokenloom.core.auto_budget import AutoTokenBudget
from tokenloom.core.batch_policy import BatchFormation
from tokenloom.core.cost_model import CostModel
from tokenloom.core.kv_cache_groups import make_kv_cache_groups, max_in_flight_tokens
from tokenloom.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from tokenloom.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenloom.core.policies import HOOKS, PrefillWaitBound, PriorityPreemption, StepContext, StepPolicy, overriding
from tokenloom.core.prompt_fit import prompt_fit, prompt_refusal
from tokenloom.core.repetition import REPETITION_STOP_REASON, check_sequence_repetition
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.request_queue import create_request_queue
from tokenloom.core.sched_interface import SchedulerInterface
from tokenloom.core.slo_budget import SloBudgetController
from tokenloom.core.spec_decode_stats import SpecDecodingStats
from tokenloom.core.structured_output import StructuredOutputManager, grammar_dead_end_message
from tokenloom.exceptions import ValidationError


class RequestRejected(ValidationError):
    """A request that can never be served under this configuration (a ValueError, and vLLM's
    VLLMValidationError by its other name: tokenloom/exceptions.py)."""


@dataclass
class SchedulerStats:
    num_running_reqs: int
    # Waiting for capacity (budget, slots, blocks); the waiting requests admission steps over while they wait
    # for something else (a grammar, a KV load, a LoRA slot) are num_skipped_waiting_reqs, as vLLM splits them.
    num_waiting_reqs: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions_total: int
    prefix_cache_queries: int  # since start (new requests only, as vLLM's counters)
    prefix_cache_hits: int
    prefix_cache_stats: PrefixCacheStats | None = None  # since the previous make_stats()
    # A KV connector's hits (tokens loaded from outside the pool: tokenloom/kv_transfer), as vLLM's
    # connector_prefix_cache_stats: since the previous make_stats(), and since start. None without one.
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    connector_prefix_cache_totals: PrefixCacheStats | None = None
    # Totals since start-up; None without speculative decoding.
    spec_decoding: SpecDecodingStats | None = None
    # With LoRA: requests per adapter name, running and waiting (vLLM's vllm:lora_requests_info); None without.
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None
    num_skipped_waiting_reqs: int = 0

    @property
    def num_waiting_total(self) -> int:
        """Every waiting request, deferred ones included (vLLM's vllm:num_requests_waiting, its log line's
        "Waiting")."""
        return self.num_waiting_reqs + self.num_skipped_waiting_reqs


@dataclass
class _StepPlan:
    """What one schedule() call has decided so far: the budget left and the step's accumulators, filled
    by the running pass and the waiting pass, turned into the SchedulerOutput at the end."""

    now: float
    token_budget: int
    threshold: int  # long_prefill_token_threshold in force this step (0: none)
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = field(default_factory=list)
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    req_to_new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    policy_actions: dict[str, Any] = field(default_factory=dict)
    bound_by: str | None = None  # what stopped the step (the step trace's reason)
    reserve: int = 0  # tokens held back from running requests for starved prompts
    starved: set[str] = field(default_factory=set)
    prefill_scheduled: bool = False  # a running prefill chunk is in the step: no first-decode padding
    hold_decodes: bool = False  # a policy (static batching) holds decodes back: prefills only this step
    # The step as the policies see it (made right after the plan, from its lists).
    policy_view: StepContext = field(init=False, repr=False)

    def take(self, req_id: str, num_new_tokens: int, block_ids: tuple[list[int], ...]) -> None:
        self.req_to_new_block_ids[req_id] = block_ids
        self.num_scheduled_tokens[req_id] = num_new_tokens
        self.token_budget -= num_new_tokens


# Waiting states a thread of its own ends: a grammar compiling, a KV load.
_BACKGROUND_WAITS = (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS)


class Scheduler(SchedulerInterface):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        speculative_config: SpeculativeConfig | None = None,
        step_cost_model: CostModel | None = None,
    ) -> None:
        """`step_cost_model`: what a step costs (core/cost_model.py), for the SLO budget controller;
        needed only with --target-itl-ms / --target-ttft-ms (make_scheduler reads --step-cost-profile)."""
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks must be set before building a Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        # Admission into RUNNING (vLLM's max_num_active_reqs): max_num_active_seqs when set, else max_num_seqs,
        # which also sizes the runner.
        self.max_num_active_reqs = (scheduler_config.max_num_active_seqs
                                    if scheduler_config.max_num_active_seqs is not None else self.max_num_running_reqs)
        self.max_num_scheduled_tokens = scheduler_config.token_budget_ceiling
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.policy = scheduler_config.policy
        # Speculative decoding (n-gram or suffix drafts): up to K drafts per request per step.
        check_long_prefill_threshold(scheduler_config.long_prefill_token_threshold, speculative_config)
        self.speculative_config = speculative_config
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        # vLLM's names, kept so the scheduler reads side by side with vLLM's (and vLLM's own tests that set
        # them still apply). Lookahead KV slots are for draft-model / EAGLE drafts, which tokenloom does
        # not run: n-gram and suffix drafts need none (vLLM's num_lookahead_tokens is 0 for them too), and
        # for the same reason vLLM's start-up check of drafting slots in the budget never applies here.
        self.num_lookahead_tokens = 0
        # Tokens every step that completes a sequence samples, beyond accepted drafts: 1 for every
        # autoregressive model (vLLM sets 0 only for diffusion models, which tokenloom does not run).
        self.num_sampled_tokens_per_step = 1
        # This step's acceptance figures (None when no output carried drafts) and the totals.
        self.spec_decoding_stats: SpecDecodingStats | None = None
        # This step's drafts per request: [scheduled, accepted] (for the step trace).
        self.spec_decoding_per_request: dict[str, list[int]] = {}
        self.spec_decoding_totals = SpecDecodingStats.new(self.num_spec_tokens) if speculative_config else None

        # One group unless the model mixes sliding-window and full layers (vLLM's hybrid groups). The
        # scheduler needs the groups' kinds only (which layers are in them matters to the runner), so
        # "every layer full" (layer_windows None) is one full group, however many layers.
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            watermark=scheduler_config.watermark,
            kv_cache_groups=make_kv_cache_groups(cache_config.layer_windows, 1,
                                                 hybrid=not cache_config.disable_hybrid_kv_cache_manager),
            max_num_batched_tokens=max_in_flight_tokens(scheduler_config.token_budget_ceiling,
                                                        scheduler_config.async_scheduling),
        )
        # The prefix-cache block hash every request is hashed with (core/block_hash.py).
        self.hash_algo = cache_config.prefix_caching_hash_algo
        self.requests: dict[str, Request] = {}
        # The policies beyond vLLM (core/policies.py), each None unless its knobs turn it on; vLLM's values
        # (an explicit max_num_batched_tokens, continuous batching) run none of them.
        self.prefill_wait_bound = (
            PrefillWaitBound(scheduler_config.max_prefill_wait_ms / 1000.0, scheduler_config.max_prefill_wait_steps,
                             scheduler_config.min_prefill_chunk)
            if scheduler_config.max_prefill_wait_ms > 0 or scheduler_config.max_prefill_wait_steps > 0 else None
        )
        self.priority_preemption = (
            PriorityPreemption(scheduler_config.priority_preemption_protection_steps)
            if scheduler_config.enable_priority_preemption else None
        )
        self.slo_budget: SloBudgetController | None = None
        if scheduler_config.slo_targets:
            if step_cost_model is None:
                raise ConfigError(
                    "target_itl_ms needs a step cost model: set step_cost_profile to a profile JSON "
                    "(`tokenloom profile` writes one; shipped: tokenloom/sim/profiles/); the simulator uses its own")
            self.slo_budget = SloBudgetController(
                step_cost_model, scheduler_config.token_budget_ceiling, scheduler_config.target_itl_ms / 1000.0,
                scheduler_config.target_ttft_ms / 1000.0, predicted_clock=scheduler_config.slo_clock == "predicted")
        # The default, automatic budget (core/auto_budget.py): None with an explicit max_num_batched_tokens,
        # which keeps vLLM's fixed budget, or when the SLO controller above sets the budget.
        self.auto_budget = (
            AutoTokenBudget(scheduler_config.token_budget_ceiling, scheduler_config.auto_budget_prefill_ms / 1000.0,
                            self.num_spec_tokens)
            if scheduler_config.auto_token_budget else None
        )
        # The comparison baselines (core/batch_policy.py): batches formed from the queue's head.
        self.batch_formation = (BatchFormation(lockstep=scheduler_config.batching == "static")
                                if scheduler_config.batching != "continuous" else None)
        # The policies that run, in the order each hook is asked; per hook, the ones that override it.
        self.step_policies: list[StepPolicy] = [
            p for p in (self.priority_preemption, self.slo_budget, self.auto_budget, self.prefill_wait_bound,
                        self.batch_formation) if p is not None]
        self._hooks: dict[str, list[StepPolicy]] = self._index_hooks()
        self.num_schedule_calls = 0
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # vLLM's deferred_waiting: the waiting requests admission has stepped over (or that arrived blocked, on a
        # grammar) and not admitted since; the stats count them apart from those waiting for capacity.
        self.deferred_waiting: set[Request] = set()
        # Finished between the previous schedule() and the next: the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Preempted since the previous schedule() built its output, in it or by reset_prefix_cache: the
        # runner drops their state (vLLM's reset_preempted_req_ids).
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # Each update_from_output ends the KV cache manager's lookup interval (vLLM's make_stats at
        # the end of every step); the steps' intervals gather here until make_stats() reports them.
        self._prefix_cache_since_report = PrefixCacheStats()
        # Grammars of constrained requests (set by the engine, which knows the tokenizer); None:
        # constrained requests are rejected. Requests whose grammar failed to compile, with why.
        self.structured_output_manager: StructuredOutputManager | None = None
        self.grammar_compile_errors: dict[str, str] = {}
        # vLLM's lora_config (tokenloom.config.LoRAConfig, set by the engine with --enable-lora): at most
        # max_loras distinct adapters in one step. None: no LoRA (a request naming one is rejected).
        self.lora_config: Any = None
        # The scheduler side of a KV connector (tokenloom/kv_transfer: vLLM's KVConnectorBase_V1, role
        # SCHEDULER), set by the engine; None, the default, changes no decision. It is called where vLLM's
        # scheduler calls it: get_num_new_matched_tokens / update_state_after_alloc at admission,
        # build_connector_meta per step, update_connector_output per output, request_finished at the end.
        self.connector: Any = None
        self.connector_prefix_cache_stats = PrefixCacheStats()
        self.connector_prefix_cache_totals = PrefixCacheStats()
        # Finished requests whose blocks the connector still reads (request_finished said delay_free):
        # freed when a kv_connector_output lists them in finished_sending (vLLM's _free_blocks later).
        self.delayed_free: dict[str, Request] = {}
        # Asynchronous KV loads (vLLM's WAITING_FOR_REMOTE_KVS): requests whose load the worker side reported
        # done (promoted at their next admission try), those whose load failed in part (num_computed_tokens
        # already cut to the prefix that loaded), and those finished while loading (in delayed_free: the
        # worker still writes their blocks, which are freed when it reports the load done).
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.aborted_while_loading: set[str] = set()
        # Promoted after their load, not admitted yet: the tokens the load gave (their cached tokens).
        self.loaded_kv_tokens: dict[str, int] = {}

    # Requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected (a ValueError) saying why it can never run."""
        self._validate(request)
        request.set_block_size(self.block_size, self.hash_algo)
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise RequestRejected(f"request {request.request_id!r}: structured outputs need a grammar "
                                      "backend, and this engine has none")
            # Compiles in the manager's thread pool; admission skips the request until it is done.
            request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            self.structured_output_manager.grammar_init(request)
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            self.deferred_waiting.add(request)  # blocked from arrival (vLLM's _enqueue_waiting_request)
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        for policy in self._hooks["arrived"]:
            policy.arrived(request.request_id, self.num_schedule_calls)

    def add_policy(self, policy: StepPolicy) -> None:
        """Run one more policy (core/policies.py StepPolicy), asked after the configured ones: how a policy
        of one's own plugs in where the scheduler is driven directly (the simulator, replays, tests).
        Before the first request only: a policy that missed arrivals would judge requests it never saw."""
        if self.requests:
            raise ValueError("add_policy: the scheduler already holds requests; add policies before the first one")
        if not isinstance(policy, StepPolicy):
            raise TypeError(f"add_policy takes a StepPolicy (tokenloom.core.policies), got {type(policy).__name__}")
        self.step_policies.append(policy)
        self._hooks = self._index_hooks()

    def _index_hooks(self) -> dict[str, list[StepPolicy]]:
        """Per hook, the policies of step_policies that override it (the only ones the scheduler asks)."""
        return {h: overriding(self.step_policies, h) for h in HOOKS}

    def _validate(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        if request.lora_request is not None and self.lora_config is None:
            raise RequestRejected(f"request {rid!r} names LoRA adapter {request.lora_request.lora_name!r}, but LoRA "
                                  "is not enabled (--enable-lora, LLM(enable_lora=True))")
        kv = self.kv_cache_manager
        fit = prompt_fit(request.num_prompt_tokens, request.max_tokens, self.max_model_len, self.block_size,
                         kv.num_blocks, kv.kv_cache_groups, kv.max_in_flight_tokens)  # fmt: skip
        # The front ends' rule (InputProcessor), kept here for what drives the scheduler without one: the
        # simulator, the replay harness. An empty prompt, or one that can never finish: RequestRejected.
        refusal = prompt_refusal(fit, pooling=request.pooling_params is not None)
        if refusal is not None:
            raise RequestRejected(f"request {rid!r}: {refusal.message}")

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort on client disconnect, errors). Frees their blocks now."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        valid = [r for rid in dict.fromkeys(request_ids) if (r := self.requests.get(rid)) and not r.is_finished()]
        running_to_remove = {id(r) for r in valid if r.status == RequestStatus.RUNNING}
        if running_to_remove:
            self.running = [r for r in self.running if id(r) not in running_to_remove]
        waiting_to_remove = [r for r in valid if r.status != RequestStatus.RUNNING]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)
            self.deferred_waiting.difference_update(waiting_to_remove)
        for request in valid:
            rid = request.request_id
            # vLLM's rule: a load still in flight writes the request's blocks; they are freed when it ends.
            loading = (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                       and rid not in self.finished_recving_kv_req_ids)
            self.finished_recving_kv_req_ids.discard(rid)
            self.failed_recving_kv_req_ids.discard(rid)
            self.loaded_kv_tokens.pop(rid, None)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=loading)
            if loading:
                self.aborted_while_loading.add(rid)
        return valid

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> None:
        assert request.is_finished()
        request.finished_time = self.clock()
        delay_free = delay_free_blocks
        if self.connector is not None:
            # vLLM's _connector_finished: the connector may keep the blocks (a transfer still reads them).
            connector_delays, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id))
            delay_free = delay_free or connector_delays
            request.kv_transfer_params = params
        if delay_free:
            self.delayed_free[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        if request.use_structured_output and self.structured_output_manager is not None:
            self.structured_output_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        for policy in self._hooks["freed"]:
            policy.freed(request.request_id)

    # The step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(now=self.clock(), token_budget=self.max_num_scheduled_tokens,
                         threshold=self._long_prefill_threshold())
        if self.step_policies:  # none with vLLM's settings: its loop alone
            plan.policy_view = self._policy_view(plan)
            self._apply_policies(plan)
        # 1. RUNNING first.
        self._schedule_running(plan)
        # 2. WAITING next, unless this step preempted (never free blocks and fill them at once).
        if plan.preempted_reqs:
            plan.bound_by = plan.bound_by or "kv_blocks"
        else:
            self._schedule_waiting(plan)
        # 3. The output, from the progress before the step; then the frontier advances.
        output = self._make_output(plan)
        if self.connector is not None:
            # Before the frontier advances, as vLLM: the connector sees each request's progress before the step.
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self.structured_output_manager is not None:
            self._add_grammar_bitmask(output)
        self._update_after_schedule(output)
        self.num_schedule_calls += 1
        return output

    def _long_prefill_threshold(self) -> int:
        """long_prefill_token_threshold in force this step (0: none). It exists to stop one long prefill
        starving others, so a lone request may take the whole budget; adaptive, it is floored at a fair share
        of the budget, max_num_batched_tokens / the running and waiting requests (vLLM 0.32's rule)."""
        num_eligible = len(self.running) + len(self.waiting)
        threshold = self.scheduler_config.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and self.scheduler_config.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, self.scheduler_config.token_budget_ceiling // num_eligible)
        return threshold

    def _policy_view(self, plan: _StepPlan) -> StepContext:
        """The step as the policies see it (core/policies.py StepContext): the plan's lists, not copies."""
        return StepContext(now=plan.now, step=self.num_schedule_calls, running=self.running, waiting=self.waiting,
                           requests=self.requests, kv_cache_manager=self.kv_cache_manager,
                           max_num_running_reqs=self.max_num_active_reqs, threshold=plan.threshold,
                           preempted=plan.preempted_reqs, actions=plan.policy_actions,
                           _preempt=self._preempt_request)

    def _apply_policies(self, plan: _StepPlan) -> None:
        """The policies' step hooks before the passes (none runs with vLLM's defaults): preemption for the
        waiting head, this step's budget, tokens held back for starved prompts, a decode hold. Why
        they act goes into plan.policy_actions (the step trace shows it)."""
        view = plan.policy_view
        for policy in self._hooks["preempt"]:
            plan.bound_by = policy.preempt(view) or plan.bound_by
        for policy in self._hooks["budget"]:
            plan.token_budget = policy.budget(view, plan.token_budget)
        for policy in self._hooks["reserve"]:
            reserve, ids = policy.reserve(view, plan.token_budget)
            plan.reserve += reserve
            plan.starved.update(ids)
        for policy in self._hooks["hold_decodes"]:
            plan.hold_decodes |= policy.hold_decodes(view)

    def _refuse_admission(self, plan: _StepPlan, request: Request) -> str | None:
        """The first policy's reason to keep the head of the waiting queue out this step, or None."""
        for policy in self._hooks["refuse_admission"]:
            why = policy.refuse_admission(plan.policy_view, request)
            if why is not None:
                return why
        return None

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Each running request in order takes min(deficit, threshold, budget left); when its slots do
        not fit, victims are preempted until they do or the request itself is the victim."""
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_running_tokens(request, plan)
            if num_new_tokens <= 0:
                # `continue`, not `break`: a request with nothing to do never blocks the others.
                req_index += 1
                continue
            new_blocks, req_index = self._allocate_or_preempt(request, num_new_tokens, req_index, plan)
            if new_blocks is None:
                plan.bound_by = "kv_blocks"
                break
            plan.scheduled_running_reqs.append(request)
            plan.prefill_scheduled |= request.is_prefill_chunk
            plan.take(request.request_id, num_new_tokens, new_blocks.get_block_ids())
            req_index += 1
            if request.request_id in plan.starved:
                plan.starved.discard(request.request_id)
                plan.reserve = max(0, plan.reserve - num_new_tokens) if plan.starved else 0
            self._schedule_spec_tokens(request, num_new_tokens, plan.scheduled_spec_decode_tokens)

    def _num_new_running_tokens(self, request: Request, plan: _StepPlan) -> int:
        """A running request's share of this step (0: nothing to do now)."""
        if (
            request.num_output_placeholders > 0
            and request.num_computed_tokens + 2 - request.num_output_placeholders
            >= request.num_prompt_tokens + request.max_tokens
        ):
            # Async scheduling (vLLM's guard, scheduler.py:663-678): the step in flight already
            # yields the last token even if all its drafts are rejected; schedule nothing more.
            # (computed + 1) - (placeholders - 1): placeholders count in computed, drafts aside.
            return 0
        num_new_tokens = request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
        if 0 < plan.threshold < num_new_tokens:
            num_new_tokens = plan.threshold
        reserve = 0 if request.request_id in plan.starved else plan.reserve
        num_new_tokens = min(num_new_tokens, plan.token_budget - reserve)
        # Never compute a position at or past max_model_len (with drafts: one draft short of the
        # proposer's cap, as vLLM).
        # A pooling request samples nothing: its prompt may fill the context.
        num_sampled = 0 if request.pooling_params is not None else self.num_sampled_tokens_per_step
        num_new_tokens = min(num_new_tokens, self.max_model_len - num_sampled - request.num_computed_tokens)
        if plan.hold_decodes and not request.is_prefill:
            return 0
        return num_new_tokens

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, req_index: int, plan: _StepPlan
    ) -> tuple[Any, int]:
        """allocate_slots for a running request, preempting victims (FCFS: the last of running;
        priority: the largest (priority, arrival_time)) until it fits; None if the request itself
        was preempted. Returns the new blocks and the request's index in running after removals."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                              num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks, req_index
            if self.policy == "priority":
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim_index < req_index:
                    req_index -= 1
                if victim in plan.scheduled_running_reqs:
                    # Undo its share of this step before its blocks go back to the pool.
                    plan.scheduled_running_reqs.remove(victim)
                    plan.token_budget += plan.num_scheduled_tokens.pop(victim.request_id)
                    plan.req_to_new_block_ids.pop(victim.request_id)
                    plan.scheduled_spec_decode_tokens.pop(victim.request_id, None)
            else:
                victim = self.running.pop()
            self._preempt_request(victim, plan.now)
            plan.preempted_reqs.append(victim)
            if victim is request:
                return None, req_index

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in policy order while budget and slots last. A request whose grammar
        still compiles is stepped over; with chunked prefill off, a prompt that does not fit the budget
        left stops admission (break, not skip)."""
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        skipped_waiting: list[Request] = []
        # vLLM's scheduled_loras: the adapters of the running requests this step serves (id 0 is none).
        scheduled_loras: set[int] = set()
        if self.lora_config is not None:
            scheduled_loras = {r.lora_request.lora_int_id for r in plan.scheduled_running_reqs
                               if r.lora_request is not None and r.lora_request.lora_int_id > 0}
        while plan.token_budget > 0 and self.waiting:
            if len(self.running) >= self.max_num_active_reqs:
                plan.bound_by = "max_num_seqs"
                break
            request = self.waiting.peek_request()
            if (request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                    and not self._grammar_ready(request)):
                # Still compiling (or failed): step over it, the others are not held up.
                skipped_waiting.append(self.waiting.pop_request())
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.request_id not in self.finished_recving_kv_req_ids:
                    # Its KV still loads in the background: step over it (vLLM's _handle_blocked_waiting_request).
                    skipped_waiting.append(self.waiting.pop_request())
                    continue
                self._update_waiting_for_remote_kv(request)
                request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            if request.num_stale_output_tokens and not request.drop_stale_output:
                # Output of a step scheduled before its preemption is still in flight and will be
                # delivered: resuming now could sample a position it fills. It lands within the
                # pipeline depth (vLLM's rule).
                skipped_waiting.append(self.waiting.pop_request())
                continue
            if (self.lora_config is not None and request.lora_request is not None
                    and len(scheduled_loras) == self.lora_config.max_loras
                    and request.lora_request.lora_int_id not in scheduled_loras):
                # Scheduling would exceed max_loras: step over it (vLLM's rule, scheduler.py).
                skipped_waiting.append(self.waiting.pop_request())
                continue
            refusal = self._refuse_admission(plan, request) if self._hooks["refuse_admission"] else None
            if refusal is not None:
                plan.bound_by = plan.bound_by or refusal
                break

            num_external_computed = 0
            if request.num_computed_tokens == 0:
                new_computed_blocks, num_new_local_computed = kv.get_computed_blocks(request)
                if self.connector is not None:
                    # Tokens a KV connector holds beyond the pool's hit (vLLM: get_num_new_matched_tokens).
                    ext_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(
                        request, num_new_local_computed)
                    if ext_tokens is None:  # the connector cannot tell yet: try again next step
                        skipped_waiting.append(self.waiting.pop_request())
                        continue
                    if load_kv_async and ext_tokens > 0:
                        # Blocks now, the load in the background; the request waits (vLLM's WAITING_FOR_REMOTE_KVS).
                        if not self._start_remote_kv_load(request, new_computed_blocks, num_new_local_computed,
                                                          ext_tokens):
                            plan.bound_by = "kv_blocks"
                            break
                        skipped_waiting.append(self.waiting.pop_request())
                        continue
                    num_external_computed = ext_tokens
            else:
                new_computed_blocks, num_new_local_computed = [], 0
            num_computed_tokens = request.num_computed_tokens + num_new_local_computed + num_external_computed
            # Tokens loaded in the background (the request was parked in WAITING_FOR_REMOTE_KVS).
            num_loaded = self.loaded_kv_tokens.get(request.request_id, 0)
            # num_tokens, not num_prompt_tokens: a resumed request recomputes its outputs too.
            num_new_tokens = request.num_tokens - num_computed_tokens
            pad_spec_decode = False
            if (
                self.num_spec_tokens > 0
                and num_new_tokens == 1
                and not plan.prefill_scheduled
                and (plan.scheduled_running_reqs or num_computed_tokens > 0)
            ):
                # vLLM pads a first decode to 1 + K tokens with K placeholder drafts (always
                # rejected) to keep decode shapes uniform, and prefers admitting nothing more
                # to admitting it unpadded (scheduler.py:1131-1153).
                padded = 1 + self.num_spec_tokens
                if num_computed_tokens + padded + self.num_sampled_tokens_per_step <= self.max_model_len:
                    if padded > plan.token_budget:
                        plan.bound_by = "budget"
                        break
                    num_new_tokens = padded
                    pad_spec_decode = True
            if 0 < plan.threshold < num_new_tokens:
                num_new_tokens = plan.threshold
            if not cfg.enable_chunked_prefill and num_new_tokens > plan.token_budget:
                plan.bound_by = "budget"
                break
            num_new_tokens = min(num_new_tokens, plan.token_budget)

            new_blocks = kv.allocate_slots(
                request,
                num_new_tokens + num_external_computed,
                num_new_computed_tokens=num_new_local_computed,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=self.num_lookahead_tokens,
                full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                has_scheduled_reqs=bool(self.running),
            )
            if new_blocks is None:
                plan.bound_by = "kv_blocks"
                break
            if not num_loaded:  # (a loaded request was counted, and its connector told, when it parked)
                kv.record_prefix_cache_stats(request, num_new_local_computed)
                if self.connector is not None:
                    self._connector_allocated(request, num_new_local_computed, num_external_computed)

            request = self.waiting.pop_request()
            self.deferred_waiting.discard(request)
            self.running.append(request)
            if num_loaded:
                del self.loaded_kv_tokens[request.request_id]
            if self.lora_config is not None and request.lora_request is not None:
                scheduled_loras.add(request.lora_request.lora_int_id)
            if request.status == RequestStatus.WAITING:
                plan.scheduled_new_reqs.append(request)
            else:
                plan.scheduled_resumed_reqs.append(request)
            plan.take(request.request_id, num_new_tokens, kv.get_block_ids(request.request_id))
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = plan.now
            for policy in self._hooks["admitted"]:
                policy.admitted(request.request_id, self.num_schedule_calls)
            plan.cached_tokens[request.request_id] = num_new_local_computed + num_external_computed + num_loaded
            if pad_spec_decode:
                plan.scheduled_spec_decode_tokens[request.request_id] = [-1] * self.num_spec_tokens
        if skipped_waiting:
            self.deferred_waiting.update(skipped_waiting)
            self.waiting.prepend_requests(skipped_waiting)
        if plan.bound_by == "kv_blocks" and not self.running and (self.loaded_kv_tokens
                                                                   or self.finished_recving_kv_req_ids):
            self._give_back_loaded_blocks()

    # Asynchronous KV loads (vLLM's WAITING_FOR_REMOTE_KVS) --------------------------------------
    def _connector_allocated(self, request: Request, num_local: int, num_external: int) -> None:
        """Blocks were allocated for a first admission: the connector's hit counters and its
        update_state_after_alloc (vLLM's order)."""
        # vLLM counts the tokens the connector was asked about: those the pool did not have.
        queries = request.num_tokens - num_local
        if queries:
            preempted = request.num_preemptions > 0
            self.connector_prefix_cache_stats.record(queries, num_external, preempted)
            self.connector_prefix_cache_totals.record(queries, num_external, preempted)
        # The connector learns where the external tokens go.
        blocks = KVCacheBlocks(self.kv_cache_manager.get_blocks(request.request_id))
        self.connector.update_state_after_alloc(request, blocks, num_external)

    def _start_remote_kv_load(self, request: Request, new_computed_blocks: Any, num_local: int,
                              num_external: int) -> bool:
        """Allocate the blocks an asynchronous load fills and park the request in WAITING_FOR_REMOTE_KVS
        (it stays in the waiting queue, stepped over); False when the pool cannot hold them now. The
        loaded blocks enter the prefix cache only when the load is done (delay_cache_blocks)."""
        kv = self.kv_cache_manager
        new_blocks = kv.allocate_slots(
            request,
            num_external,
            num_new_computed_tokens=num_local,
            new_computed_blocks=new_computed_blocks,
            num_lookahead_tokens=self.num_lookahead_tokens,
            full_sequence_must_fit=self.scheduler_config.scheduler_reserve_full_isl,
            has_scheduled_reqs=bool(self.running),
            delay_cache_blocks=True,
        )
        if new_blocks is None:
            return False
        kv.record_prefix_cache_stats(request, num_local)
        self._connector_allocated(request, num_local, num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        # Counts the tokens still loading; cut back to what loaded if the load fails in part.
        request.num_computed_tokens = num_local + num_external
        return True

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """The load is done (vLLM's method of this name): the blocks that loaded enter the prefix cache;
        after a failure with nothing valid the blocks are returned (the request starts over)."""
        rid = request.request_id
        kv = self.kv_cache_manager
        if rid in self.failed_recving_kv_req_ids and request.num_computed_tokens == 0:
            kv.free(request)
        else:
            kv.cache_blocks(request, request.num_computed_tokens)
        self.failed_recving_kv_req_ids.discard(rid)
        self.finished_recving_kv_req_ids.discard(rid)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1  # the last token is computed again, for its logits
        if request.num_computed_tokens:
            self.loaded_kv_tokens[rid] = request.num_computed_tokens

    def _give_back_loaded_blocks(self) -> None:
        """Nothing runs and the waiting queue is short of blocks, some of which waiting requests hold
        because their KV loaded: those requests return them (cached by the load, so their next admission
        finds them in the prefix cache unless evicted). Waiting requests are never preempted; without
        this, a request at the head could wait for blocks that loaded requests behind it hold, while
        they wait behind it (reachable with scheduler_reserve_full_isl off). A load still running keeps
        its blocks; it is handled here once it ends."""
        kv = self.kv_cache_manager
        for request in list(self.waiting):
            rid = request.request_id
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid in self.finished_recving_kv_req_ids:
                self._update_waiting_for_remote_kv(request)
                request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            if self.loaded_kv_tokens.pop(rid, None) is not None:
                kv.free(request)
                request.num_computed_tokens = 0

    def _mark_failed_loads(self, finished_recving: Iterable[str], invalid_block_ids: set[int]) -> None:
        """Cut each finished load with an invalid block back to the tokens before its first invalid block
        (vLLM's _update_requests_with_invalid_blocks, for loads in flight): those after are recomputed."""
        for rid in finished_recving:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(rid)[0]
            num_blocks = -(-request.num_computed_tokens // self.block_size)
            bad = next((i for i, b in enumerate(block_ids[:num_blocks]) if b in invalid_block_ids), None)
            if bad is not None:
                request.num_computed_tokens = bad * self.block_size
                self.failed_recving_kv_req_ids.add(rid)

    def _fail_kv_loads(self) -> list[EngineCoreOutput]:
        """kv_load_failure_policy "fail": requests whose load failed end with an error (the default,
        "recompute", computes the tokens that did not load)."""
        outputs = []
        for rid in sorted(self.failed_recving_kv_req_ids):
            request = self.requests[rid]
            self.failed_recving_kv_req_ids.discard(rid)
            self.finished_recving_kv_req_ids.discard(rid)
            self.waiting.remove_requests([request])
            self.deferred_waiting.discard(request)
            request.status = RequestStatus.FINISHED_ERROR
            request.error = "the KV connector failed to load this request's KV (kv_load_failure_policy 'fail')"
            self._free_request(request)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="error", error=request.error,
                                            num_cached_tokens=0))
        return outputs

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        """The SchedulerOutput of the plan: new and resumed requests whole, running ones as deltas."""
        num_scheduled_tokens = plan.num_scheduled_tokens
        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        bound_by = plan.bound_by or self._bound_by_at_end(plan.token_budget, num_scheduled_tokens)
        running = plan.scheduled_running_reqs
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    prefill_token_ids=list(r.all_token_ids),
                    sampling_params=r.sampling_params,
                    block_ids=plan.req_to_new_block_ids[r.request_id],
                    num_computed_tokens=r.num_computed_tokens,
                    pooling_params=r.pooling_params,
                    lora_request=r.lora_request,
                )
                for r in plan.scheduled_new_reqs + plan.scheduled_resumed_reqs
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in running],
                new_block_ids=[plan.req_to_new_block_ids[r.request_id] for r in running],
                num_computed_tokens=[r.num_computed_tokens for r in running],
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=plan.scheduled_spec_decode_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            resumed_req_ids={r.request_id for r in plan.scheduled_resumed_reqs},
            cached_tokens=plan.cached_tokens,
            num_prefill_tokens={
                rid: n
                for rid, n in num_scheduled_tokens.items()
                if self.requests[rid].num_computed_tokens < self.requests[rid].num_tokens - 1
            },
            bound_by=bound_by,
            policy_actions=plan.policy_actions,
        )
        if self.lora_config is not None:
            output.lora_names = {rid: req.lora_request.lora_name for rid in num_scheduled_tokens
                                 if (req := self.requests[rid]).lora_request is not None}
        for policy in self._hooks["scheduled"]:  # (non-empty only when some policy runs: the view exists)
            policy.scheduled(plan.policy_view, output)
        return output

    def _grammar_ready(self, request: Request) -> bool:
        """Promote a request waiting for its grammar whose grammar compiled; a failed one is finished next update.
        One with no grammar to wait for (no manager, or no structured-output request) stays stepped over,
        as vLLM's _handle_blocked_waiting_request leaves it."""
        if self.structured_output_manager is None or request.structured_output_request is None:
            return False
        try:
            ready = self.structured_output_manager.is_ready(request)
        except Exception as exc:
            self.grammar_compile_errors[request.request_id] = f"grammar compilation failed: {exc}"
            return False
        if ready:
            request.status = RequestStatus.WAITING
        return ready

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Bitmask rows for exactly the constrained requests that sample this step (before the
        frontier advances: a chunk that stops short of the sequence's end samples nothing): one per
        scheduled draft position and one more, per request. Deferred when a matcher lags behind a
        token still in flight (async scheduling)."""
        sampling = [
            r for rid, n in output.num_scheduled_tokens.items()
            if (r := self.requests[rid]).use_structured_output and r.num_computed_tokens + n >= r.num_tokens
        ]
        if not sampling:
            return
        output.structured_output_request_ids = [r.request_id for r in sampling]
        if self._grammar_lags(sampling):
            output.pending_structured_output_tokens = True
        else:
            self.fill_grammar_bitmask(output)

    def _grammar_lags(self, sampling: list[Request]) -> bool:
        """Whether a matcher has not seen a token already sampled (never here: update_from_output of
        the previous step ran before this schedule)."""
        return False

    def fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The step's bitmask from the matchers as they are now (vLLM's get_grammar_bitmask): rows for
        its constrained requests still alive (one that finished meanwhile samples nothing useful; its
        late output is dropped, so it gets no row)."""
        assert self.structured_output_manager is not None
        alive = [r for rid in output.structured_output_request_ids
                 if (r := self.requests.get(rid)) is not None and not r.is_finished()
                 and r.structured_output_request is not None and r.structured_output_request.matcher is not None]
        output.structured_output_request_ids = [r.request_id for r in alive]
        output.grammar_bitmask = (self.structured_output_manager.grammar_bitmask(
            alive, output.scheduled_spec_decode_tokens) if alive else None)
        output.pending_structured_output_tokens = False

    def _schedule_spec_tokens(self, request: Request, num_new_tokens: int, scheduled: dict[str, list[int]]) -> None:
        """The drafts that fit in `num_new_tokens` go out; scheduling a request always clears its
        drafts, so those cut by the budget are lost (vLLM, scheduler.py:858-876)."""
        if not request.spec_token_ids:
            return
        num_spec = (
            num_new_tokens + request.num_computed_tokens - request.num_tokens - request.num_output_placeholders
        )
        if num_spec > 0:
            scheduled[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []

    def observe_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The engine core reports how long a step took (wall seconds in the engine, virtual ones in the
        simulator), after update_from_output: the policies' step_done hook (the SLO controller corrects its
        predictions with it, the automatic budget learns this machine's rate)."""
        for policy in self._hooks["step_done"]:
            policy.step_done(scheduler_output, seconds)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance the computed frontier now, after the output captured the old values: the runner
        # needs the old start positions, and the next schedule() must not hand out these tokens again.
        # Drafts count as computed too; update_from_output takes back the rejected ones.
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            request.is_prefill_chunk = (
                request.num_computed_tokens < request.num_tokens + request.num_output_placeholders
            )
        # New sets, not clear(): the output just built holds the old ones.
        self.finished_req_ids = set()
        self.preempted_req_ids = set()

    def _preempt_request(self, request: Request, now: float, drop_stale_output: bool = False) -> None:
        """Recompute-style preemption: free the blocks, reset progress, back to waiting.

        `drop_stale_output` (vLLM's): the output of the steps still in flight is dropped instead of
        delivered, for a request that may resume before it lands (reset_prefix_cache)."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # Output of a step still in flight (async scheduling) is stale: appended when it comes
        # back, but without touching the counters reset here (vLLM 0.27+). An undelivered share
        # already in drop mode stays dropped: its positions have been resampled.
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend_request(request)
        self.preempted_req_ids.add(request.request_id)

    def _bound_by_at_end(self, token_budget: int, num_scheduled_tokens: dict[str, int]) -> str:
        """For the step trace, when no loop said what stopped it: the budget, or nothing left to do."""
        return "budget" if token_budget == 0 and self._has_unscheduled_work(num_scheduled_tokens) else "nothing"

    def _has_unscheduled_work(self, num_scheduled_tokens: dict[str, int]) -> bool:
        if self.waiting:
            return True
        return any(
            r.num_tokens_with_spec - r.num_computed_tokens > num_scheduled_tokens.get(r.request_id, 0)
            for r in self.running
        )

    # Results back in -------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        stopped: set[int] = set()
        stopped_preempted: list[Request] = []
        spec_stats: SpecDecodingStats | None = None
        if self.spec_decoding_per_request:
            self.spec_decoding_per_request = {}
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs or {}
        pooler_output = model_runner_output.pooler_output or {}
        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            output_is_stale = False
            if request is not None:
                request.num_in_flight_tokens -= num_tokens_scheduled
                if request.num_stale_output_tokens > 0:  # scheduled before a preemption
                    output_is_stale = True
                    request.num_stale_output_tokens -= num_tokens_scheduled
            if request is None or request.is_finished():
                continue  # finished or aborted while the step ran: its late tokens are dropped
            if output_is_stale and request.drop_stale_output:
                continue  # scheduled before a preemption whose resumption resamples these positions
            status_before = request.status
            if req_id in model_runner_output.failed:
                request.status = RequestStatus.FINISHED_ERROR
                request.error = model_runner_output.failed[req_id]
                self._free_request(request)
                if status_before == RequestStatus.RUNNING:
                    stopped.add(id(request))
                else:
                    stopped_preempted.append(request)
                outputs.append(
                    EngineCoreOutput(req_id, [], finish_reason="error", error=request.error,
                                     num_cached_tokens=max(request.num_cached_tokens, 0))
                )
                continue
            if request.pooling_params is not None:
                # Prefill only (vLLM's pooling requests): finished, blocks freed, once the runner pooled it.
                if req_id in pooler_output:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.first_token_time = request.last_token_time = now
                    self._free_request(request)
                    stopped.add(id(request))
                    outputs.append(EngineCoreOutput(req_id, [], finish_reason="stop",
                                                    num_cached_tokens=max(request.num_cached_tokens, 0),
                                                    pooling_output=pooler_output[req_id]))
                continue
            i = index.get(req_id)
            generated = list(sampled[i]) if i is not None and sampled else []

            spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if spec and generated:
                # Stale output (async: scheduled before a preemption) still counts in the stats, but
                # its rejections predate the preemption's reset and roll nothing back (S:2113-2135).
                num_invalid = scheduler_output.num_invalid_spec_tokens.get(req_id, 0)
                spec_stats = self._rollback_rejected(request, spec, generated, spec_stats,
                                                     rollback=not output_is_stale, num_invalid=num_invalid)

            is_stopped = False
            if generated:
                generated, is_stopped = self._update_request_with_output(request, generated, output_is_stale)
                if request.use_structured_output:
                    is_stopped = self._advance_grammar(request, generated) or is_stopped
                if request.first_token_time is None:
                    request.first_token_time = now
                request.last_token_time = now
            first_output = bool(generated or is_stopped) and request.num_cache_creation_tokens is None
            if first_output:
                # vLLM's PrefillStats.finalize at the first output, before the blocks are freed: the
                # prompt tokens now cached beyond the prefix-cache hit (usage's created_cache_tokens).
                cached_now = min(self.kv_cache_manager.estimate_cached_tokens(request), request.num_prompt_tokens)
                request.num_cache_creation_tokens = max(0, cached_now - max(request.num_cached_tokens, 0))
            if is_stopped:
                self._free_request(request)
                if first_output:
                    _report_remote_prefill_hits(request)
                if status_before == RequestStatus.RUNNING:
                    stopped.add(id(request))
                else:  # a preempted request finished by its stale output (async scheduling)
                    stopped_preempted.append(request)
            prompt_lps = prompt_logprobs.get(req_id)
            if generated or is_stopped or prompt_lps:
                req_logprobs = logprobs.get(req_id) if logprobs else None
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=generated,
                        new_logprobs=req_logprobs[: len(generated)] if req_logprobs else None,
                        finish_reason=request.get_finished_reason(),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        num_cache_creation_tokens=request.num_cache_creation_tokens or 0,
                        error=request.error,
                        new_prompt_logprobs=prompt_lps,
                        kv_transfer_params=request.kv_transfer_params if is_stopped and self.connector else None,
                    )
                )
        if stopped:
            self.running = [r for r in self.running if id(r) not in stopped]
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
            self.deferred_waiting.difference_update(stopped_preempted)
        self.spec_decoding_stats = spec_stats
        if spec_stats is not None and self.spec_decoding_totals is not None:
            self.spec_decoding_totals.add(spec_stats)
        if self.grammar_compile_errors:
            outputs.extend(self._finish_grammar_errors())
        if self.connector is not None and model_runner_output.kv_connector_output is not None:
            self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
            if self.failed_recving_kv_req_ids and self.connector.config.kv_load_failure_policy == "fail":
                outputs.extend(self._fail_kv_loads())
        # One step, one interval of prefix-cache lookups (vLLM: update_from_output -> make_stats).
        self._prefix_cache_since_report.merge(self.kv_cache_manager.make_prefix_cache_stats())
        return outputs

    def _update_from_kv_xfer_finished(self, kv_connector_output: Any) -> None:
        """The connector's report of a step (vLLM's method of this name): blocks held back for a transfer
        are freed once it is sent; loads that finished (with their invalid blocks, reported in the same
        output) let their requests be admitted; the connector updates its own state from the rest."""
        self.connector.update_connector_output(kv_connector_output)
        finished_recving = kv_connector_output.finished_recving or ()
        if kv_connector_output.invalid_block_ids:
            self._mark_failed_loads(finished_recving, kv_connector_output.invalid_block_ids)
        for req_id in finished_recving:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            elif req_id in self.aborted_while_loading:  # finished while loading: its blocks are free now
                self.aborted_while_loading.discard(req_id)
                finished = self.delayed_free.pop(req_id, None)
                if finished is not None:
                    self.kv_cache_manager.free(finished)
        for req_id in kv_connector_output.finished_sending or ():
            request = self.delayed_free.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)

    def _advance_grammar(self, request: Request, token_ids: list[int]) -> bool:
        """Feed the step's tokens to the request's matcher; True if that ends the request."""
        manager = self.structured_output_manager
        assert manager is not None
        if not manager.accept_tokens(request, token_ids):
            request.status = RequestStatus.FINISHED_ERROR
            request.error = grammar_dead_end_message(request.num_output_tokens - len(token_ids), token_ids)
            return True
        if not request.is_finished() and manager.is_terminated(request):
            request.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (ignore_eos)
            return True
        return False

    def _finish_grammar_errors(self) -> list[EngineCoreOutput]:
        errors, self.grammar_compile_errors = self.grammar_compile_errors, {}
        outputs = []
        for request in self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR):
            request.error = errors[request.request_id]
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error", error=request.error))
        return outputs

    def _rollback_rejected(
        self, request: Request, spec: list[int], generated: list[int], stats: SpecDecodingStats | None,
        rollback: bool = True, num_invalid: int = 0,
    ) -> SpecDecodingStats:
        """Rejected drafts were counted as computed at schedule time: take them back (their KV
        slots stay allocated and are overwritten). Counted from the untrimmed output, as vLLM.
        Under async scheduling the drafts were placeholders counted in num_output_placeholders too.
        Drafts the grammar cut (`num_invalid`, padded with -1) roll back like rejected ones but were
        never drafted: the stats leave them out (vLLM's make_spec_decoding_stats)."""
        num_accepted = max(len(generated) - self.num_sampled_tokens_per_step, 0)
        num_rejected = len(spec) - num_accepted
        if rollback:
            if request.num_computed_tokens > 0:
                request.num_computed_tokens -= num_rejected
            if request.num_output_placeholders > 0:
                request.num_output_placeholders -= num_rejected
        if stats is None:
            stats = SpecDecodingStats.new(self.num_spec_tokens)
        stats.observe_draft(len(spec) - num_invalid, num_accepted)
        self.spec_decoding_per_request[request.request_id] = [len(spec), num_accepted]
        request.num_drafts += 1
        request.num_draft_tokens += len(spec)
        request.num_accepted_tokens += num_accepted
        return stats

    def update_draft_token_ids(self, req_ids: Iterable[str], draft_token_ids: Iterable[list[int]]) -> None:
        """The proposer's drafts after a step (vLLM's post_step): ignored for finished requests,
        dropped for a request whose last chunk was a partial prefill, else the pending drafts; a
        constrained request keeps the longest prefix its grammar accepts (vLLM's validate_tokens)."""
        for req_id, drafts in zip(req_ids, draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk:
                request.spec_token_ids = []
                continue
            if request.use_structured_output and self.structured_output_manager is not None:
                drafts = self.structured_output_manager.validate_tokens(request, drafts)
            request.spec_token_ids = list(drafts)

    def update_draft_token_ids_in_output(self, req_ids: Iterable[str], draft_token_ids: Iterable[list[int]],
                                         output: SchedulerOutput) -> None:
        """Async scheduling: a step was scheduled with K placeholder drafts per request; once the step
        before it has landed, the runner's drafts replace them in `output` (vLLM's method of this name,
        called by the engine core before the deferred bitmask). Each list is cut to the slots
        scheduled and, for a constrained request, to the prefix its grammar accepts; the cut ones are
        padded back with -1 (the runner trims them; the step's token counts stay as scheduled) and
        counted in `num_invalid_spec_tokens`. The bitmask is then built over the real drafts."""
        scheduled = output.scheduled_spec_decode_tokens
        for req_id, drafts in zip(req_ids, draft_token_ids):
            request = self.requests.get(req_id)
            placeholders = scheduled.get(req_id)
            if request is None or request.is_finished() or not placeholders:
                continue
            drafts = list(drafts[: len(placeholders)])
            if request.use_structured_output and self.structured_output_manager is not None:
                drafts = self.structured_output_manager.validate_tokens(request, drafts)
            num_invalid = len(placeholders) - len(drafts)
            if num_invalid:
                drafts.extend([-1] * num_invalid)
                output.num_invalid_spec_tokens[req_id] = num_invalid
            scheduled[req_id] = drafts

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int], is_stale: bool = False
    ) -> tuple[list[int], bool]:
        """Append a step's tokens with the stop check after each (the AsyncScheduler extends it)."""
        return self._append_and_check_stop(request, new_token_ids)

    def _append_and_check_stop(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        for n, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if self._check_stop(request):
                return new_token_ids[:n], True
        return new_token_ids, False

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        # vLLM 0.32's check_stop: min_tokens is the sampler's to enforce (it masks stop tokens while too few
        # outputs exist, per draft position too), so a stop token that was sampled all the same ends the
        # request: the sampler gives EOS back to a grammar that can only end, and that end is honoured.
        if last == params.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        # vLLM's order: repetition only once min_tokens are out (the checks above end a request regardless).
        repetition = params.repetition_detection
        if (repetition is not None and request.num_output_tokens >= params.min_tokens
                and check_sequence_repetition(request.output_token_ids, repetition)):
            request.status = RequestStatus.FINISHED_REPETITION
            request.stop_reason = REPETITION_STOP_REASON
            return True
        return False

    # Figures ---------------------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def num_running_requests(self) -> int:
        return len(self.running)

    def has_background_work(self) -> bool:
        # (a load aborted while in flight: still to hear the end of)
        return any(r.status in _BACKGROUND_WAITS for r in self.waiting) or bool(self.aborted_while_loading)

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones the runner has not been told about yet."""
        return (self.has_unfinished_requests() or bool(self.finished_req_ids)
                or bool(self.aborted_while_loading))  # a step must run to hear that their load ended

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) - len(self.deferred_waiting),
            num_skipped_waiting_reqs=len(self.deferred_waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.block_pool.get_num_free_blocks(),
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=kv.prefix_cache_totals.queries,
            prefix_cache_hits=kv.prefix_cache_totals.hits,
            prefix_cache_stats=self._take_prefix_cache_stats(),
            connector_prefix_cache_stats=self._take_connector_prefix_cache_stats(),
            connector_prefix_cache_totals=replace(self.connector_prefix_cache_totals) if self.connector else None,
            spec_decoding=self.spec_decoding_totals.copy() if self.spec_decoding_totals else None,
            running_lora_adapters=_lora_counts(self.running) if self.lora_config is not None else None,
            waiting_lora_adapters=_lora_counts(self.waiting) if self.lora_config is not None else None,
        )

    def _take_connector_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if self.connector is None:
            return None
        stats, self.connector_prefix_cache_stats = self.connector_prefix_cache_stats, PrefixCacheStats()
        return stats

    def _take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the previous report: the steps' intervals plus the open one."""
        stats, self._prefix_cache_since_report = self._prefix_cache_since_report, PrefixCacheStats()
        stats.merge(self.kv_cache_manager.make_prefix_cache_stats())
        return stats

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's reset: with `reset_running_requests`, running requests are preempted back to waiting
        first (last first, so they resume in order), which frees every block; otherwise the reset
        only succeeds when no request holds blocks. With `reset_connector` the KV connector's cache is
        reset too (reset_connector_cache), and the result is True only if both were."""
        if reset_running_requests:
            now = self.clock()
            while self.running:
                # They may resume at the next schedule, before their in-flight output lands: drop it.
                self._preempt_request(self.running.pop(), now, drop_stale_output=True)
        ok = self.kv_cache_manager.reset_prefix_cache()
        if not ok and (self.aborted_while_loading or any(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting)):
            return False  # a KV load still writes its blocks (they cannot be taken back): try again after it
        if reset_running_requests and not ok:
            raise RuntimeError("failed to reset the prefix cache even after preempting every running request")
        if reset_connector:
            ok = self.reset_connector_cache() and ok
        return ok

    def reset_connector_cache(self) -> bool:
        """Reset the KV connector's cache (vLLM's method of this name). With no connector there is nothing
        to reset, which is success: a caller that always asks for it (a cache-clearing cascade after a
        weight update) must not see reset_prefix_cache fail for a connector it never configured."""
        if self.connector is None:
            return True
        if self.connector.reset_cache() is False:
            return False
        self.connector_prefix_cache_stats.reset = True
        return True


def _lora_counts(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per LoRA adapter name (the base model's not counted)."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts


def _report_remote_prefill_hits(request: Request) -> None:
    """vLLM's (Scheduler.update_from_output): a prefill run for a decode engine, finished at its first output, hands
    its own prefix-cache hit (local and connector-loaded tokens) on in the connector's kv_transfer_params as
    `remote_prefill_cached_tokens`; the decode engine reports that as the request's cached tokens instead of its own
    near-total hit on the KV it pulled (engine/output_processor.py)."""
    params = request.kv_transfer_params
    if params is not None and params.get("do_remote_prefill"):
        params["remote_prefill_cached_tokens"] = max(request.num_cached_tokens, 0)
