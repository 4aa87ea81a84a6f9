"""EngineCore: the one loop everything hangs on — schedule, execute, update.

The model runs behind an Executor (tokenloom/engine/executor.py): the in-process torch runner, or
the simulator's cost model. The engine core knows nothing of text, nor where the model runs.

`step()` is vLLM's EngineCore.step: schedule, hand the SchedulerOutput to the executor, wait for
its ModelRunnerOutput, update. With an executor that keeps more than one step in flight
(`max_concurrent_batches > 1`: async scheduling), `step()` is vLLM's `step_with_batch_queue`
instead: it schedules step N+1 and launches it while step N executes, then waits for N and
processes its output, so the scheduling of N+1 (and the output processing of N-1 in the caller)
overlaps N's execution. Outputs still come back in step order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tokenloom.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.sched_interface import SchedulerInterface
from tokenloom.core.scheduler import RequestRejected
from tokenloom.engine.core_messages import EngineCoreRequest, StepInfo
from tokenloom.engine.executor import Executor, ExecutorDeadError
from tokenloom.engine.trace import StepTracer
from tokenloom.spec_decode.adaptive import AdaptiveDraftPolicy

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A scheduled step whose output the engine core has not processed yet."""

    scheduler_output: SchedulerOutput
    future: Future[ModelRunnerOutput]
    t_start: float  # schedule() began
    t_scheduled: float  # schedule() returned


class EngineCore:
    def __init__(self, scheduler: SchedulerInterface, executor: Executor, tracer: StepTracer | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tracer = tracer
        self.clock = scheduler.clock
        spec = scheduler.speculative_config
        # tokenloom's opt-in adaptive drafting (tokenloom/spec_decode/adaptive.py); None: vLLM's.
        self.draft_policy = AdaptiveDraftPolicy(spec) if spec is not None and spec.adaptive else None
        self.num_steps = 0
        # Figures for metrics: what the last step did.
        self.last_step_tokens = 0
        self.last_step_time = 0.0
        # vLLM's batch queue: the steps in flight, oldest first (depth max_concurrent_batches).
        self.batch_queue_size = executor.max_concurrent_batches
        self.batch_queue: deque[_InFlight] = deque()
        # vLLM's aborts queue: where aborts that arrived while a step ran are read, just before that step's
        # output is applied (None: nothing arrives mid-step; the engine-core process sets it).
        self.pending_aborts: Callable[[], list[str]] | None = None

    def preprocess_add_request(self, request: EngineCoreRequest | Request) -> Request:
        """vLLM's: the engine's Request for what a client sent. An EngineCoreRequest (from across a pipe) becomes
        a new Request; the in-process client's Request is the front end's own object (its OutputProcessor reads
        the timestamps the scheduler writes on it), taken as it is. Whatever this raises, the client gets the
        request back finished with "error" and the engine goes on (EngineCoreProc, InprocClient), as vLLM's
        _handle_request_preproc_error."""
        if isinstance(request, Request):
            return request
        return request.to_request()

    def add_request(self, request: Request) -> None:
        """Raises RequestRejected (a ValueError) for a request that can never run (a LoRA adapter that
        does not load or fit the base model among them: it is loaded now, not mid-step)."""
        lora = request.lora_request
        if lora is not None and self.scheduler.lora_config is not None:
            try:
                self.executor.add_lora(lora)
            except ValueError as exc:
                raise RequestRejected(str(exc)) from None
        self.scheduler.add_request(request)

    # vLLM's EngineCore.add_lora / remove_lora / list_loras (runtime adapter loading).
    def add_lora(self, lora_request: Any) -> bool:
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.executor.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.executor.list_loras()

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        # With a step in flight the blocks are freed now too: the worker runs steps in order, so a
        # later step that reuses them runs after the one in flight (vLLM relies on stream order).
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def has_work(self) -> bool:
        """Something to schedule, a finished id to report, or a step in flight to collect."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step_reported(self) -> tuple[list[EngineCoreOutput], StepInfo | None]:
        """One step() and, for metrics, what it did: a StepInfo when a step finished (async scheduling: a call
        may only launch one) and did something (an empty step while grammars compile says nothing), else
        None. The engine-core process and the in-process client report steps by this one rule."""
        num_steps = self.num_steps
        outputs = self.step()
        if self.num_steps != num_steps and (self.last_step_tokens or outputs):
            return outputs, StepInfo(self.last_step_tokens, self.last_step_time)
        return outputs, None

    def step(self) -> list[EngineCoreOutput]:
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        if not self.scheduler.has_requests():
            return []
        t_start = self.clock()
        scheduler_output = self.scheduler.schedule()
        t_scheduled = self.clock()
        future = self.executor.execute_model(scheduler_output, non_block=True)
        outputs = self._finish_step(_InFlight(scheduler_output, future, t_start, t_scheduled))
        if scheduler_output.is_empty and not outputs and self._waiting_on_background_work():
            # Nothing can run until a grammar compiles or a KV load ends: yield the CPU to the compile
            # and load threads instead of spinning through empty steps.
            time.sleep(0.001)
        return outputs

    def _waiting_on_background_work(self) -> bool:
        """A waiting request needs a grammar compile or a KV load that runs on another thread."""
        return self.scheduler.has_background_work()

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """vLLM's EngineCore.step_with_batch_queue (engine/core.py:698-812).

        Schedule and launch a step while the queue has room and there is something to schedule;
        return at once (no outputs) unless the queue is now full or nothing more can be scheduled;
        otherwise wait for the oldest step and process its output.
        """
        queue = self.batch_queue
        if self.scheduler.has_requests():
            t_start = self.clock()
            scheduler_output = self.scheduler.schedule()
            t_scheduled = self.clock()
            finished: list[EngineCoreOutput] = []
            if scheduler_output.pending_structured_output_tokens:
                # A constrained request's last token is still in flight: its grammar bitmask needs it.
                # vLLM runs the forward pass and defers only the sampling; here the runner does both
                # in one call, so the step waits for the one in flight (only steps with such a request).
                finished = self.drain()
                if self.scheduler.num_spec_tokens:
                    # The drafts proposed after the step just drained replace this step's
                    # placeholders, cut by the grammar, so the bitmask covers the drafts that run.
                    drafts = self.executor.take_draft_token_ids()
                    if drafts is not None:
                        self.scheduler.update_draft_token_ids_in_output(
                            drafts.req_ids, drafts.draft_token_ids, scheduler_output)
                self.scheduler.fill_grammar_bitmask(scheduler_output)
            future = self.executor.execute_model(scheduler_output, non_block=True)
            queue.append(_InFlight(scheduler_output, future, t_start, t_scheduled))  # type: ignore[arg-type]
            if finished:
                return finished
            if len(queue) < self.batch_queue_size and (
                not scheduler_output.is_empty or self.scheduler.has_requests()
            ):
                return []  # don't block on the step in flight: schedule the next one first
        elif not queue:
            return []
        return self._finish_step(queue.popleft())

    def drain(self) -> list[EngineCoreOutput]:
        """Collect every step in flight (async scheduling), in order."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue:
            outputs.extend(self._finish_step(self.batch_queue.popleft()))
        return outputs

    def _finish_step(self, step: _InFlight) -> list[EngineCoreOutput]:
        """Wait for a step's model output, update the scheduler from it, and record the step."""
        scheduler_output = step.scheduler_output
        t_wait = self.clock()
        try:
            model_output = self._result(scheduler_output, step.future)
        except ExecutorDeadError:
            self.batch_queue.clear()  # the steps behind it died with the executor: nothing left to collect
            raise
        t_update = self.clock()
        self._process_pending_aborts()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.scheduler.num_spec_tokens and self.batch_queue_size == 1:
            # Async scheduling has no post_step drafts (vLLM's too): the AsyncScheduler schedules K
            # placeholder drafts and the runner fills them from the tokens it has when it runs.
            self._post_step(outputs)
        t_end = self.clock()
        if not model_output.failed:  # a failed step's time measures nothing the cost model predicts
            self.scheduler.observe_step_time(scheduler_output, self._step_seconds(step, model_output, t_update, t_end))
        self.num_steps += 1
        self.last_step_tokens = scheduler_output.total_num_scheduled_tokens
        self.last_step_time = t_end - step.t_start
        if self.tracer is not None:
            timing = {
                "t_scheduled": step.t_scheduled,
                "t_wait": t_wait,
                "t_update": t_update,
                "t_exec_start": model_output.execute_start,
                "t_exec_end": model_output.execute_end,
                "in_flight": len(self.batch_queue),
            }
            self.tracer.record(step.t_start, t_end, self.scheduler, scheduler_output, outputs, timing)
        return outputs

    def _process_pending_aborts(self) -> None:
        """vLLM's _process_aborts_queue (PR 29987): a request aborted while its last step ran ends as aborted, not
        as that step's update would end it ("length", "stop"): the KV connector's request_finished and the stats
        see FINISHED_ABORTED, and its blocks are freed as an abort's."""
        if self.pending_aborts is None:
            return
        request_ids = self.pending_aborts()
        if request_ids:
            self.abort_requests(request_ids)

    @staticmethod
    def preprocess_error_output(request_id: str, exc: BaseException) -> EngineCoreOutput:
        """The output that ends a request whose preprocess_add_request raised (logged here, with its traceback)."""
        logger.exception("Unexpected error pre-processing request %s", request_id)
        return EngineCoreOutput(request_id, [], finish_reason="error",
                                error=f"Unexpected error pre-processing request: {type(exc).__name__}: {exc}")

    def _step_seconds(self, step: _InFlight, model_output: ModelRunnerOutput, t_update: float, t_end: float) -> float:
        """What the step cost, as the SLO controller's predictions count it: the scheduler's own time
        (schedule, update) plus the runner's execution as the runner timed it. Spans of steps in
        flight together (async scheduling) overlap; these parts do not. In the simulator the clock
        stands still around the runner, and its execution is the cost model's prediction, exactly."""
        execute = model_output.execute_time
        if execute is None:  # a runner that does not time itself: the executor's span, else the wait
            start, end = model_output.execute_start, model_output.execute_end
            execute = end - start if start is not None and end is not None else t_update - step.t_scheduled
        return (step.t_scheduled - step.t_start) + execute + (t_end - t_update)

    def _post_step(self, outputs: list[EngineCoreOutput]) -> None:
        """vLLM's EngineCore.post_step: the drafts the runner proposed after this step go to the
        scheduler (through the opt-in adaptive policy, which may trim them)."""
        policy = self.draft_policy
        if policy is not None:
            policy.observe(self.scheduler.spec_decoding_per_request)
            policy.forget(o.request_id for o in outputs if o.finished)
        drafts = self.executor.take_draft_token_ids()
        if drafts is None:
            return
        lists = drafts.draft_token_ids
        if policy is not None:
            lists = policy.trim(drafts.req_ids, lists, num_decoding=self.scheduler.num_running_requests())
        self.scheduler.update_draft_token_ids(drafts.req_ids, lists)

    @staticmethod
    def _result(scheduler_output: SchedulerOutput, future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        try:
            return future.result()
        except ExecutorDeadError:  # no later step can run either: the engine is dead, not this step
            raise
        except Exception as exc:  # the step failed as a whole: its requests end with an error
            logger.exception("model execution failed; finishing the step's requests with an error")
            req_ids = list(scheduler_output.num_scheduled_tokens)
            message = f"model execution failed: {type(exc).__name__}: {exc}"
            return ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[] for _ in req_ids],
                failed={r: message for r in req_ids},
            )
