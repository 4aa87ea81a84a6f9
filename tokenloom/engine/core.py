"""EngineCore: the one loop everything hangs on — schedule, execute, update.

The model runs behind an Executor (tokenloom/engine/executor.py): the in-process torch runner, or
the simulator's cost model. The engine core knows nothing of text, nor where the model runs.

`step()` is vLLM's EngineCore.step: schedule, hand the SchedulerOutput to the executor, wait for
its ModelRunnerOutput, update. An executor with `max_concurrent_batches > 1` would be driven by a
second variant (vLLM's `step_with_batch_queue`: schedule step N+1 while step N runs), built from
the same three parts: `scheduler.schedule()`, `executor.execute_model(..., non_block=True)` and
`_finish_step()`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from tokenloom.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.engine.executor import Executor
from tokenloom.engine.trace import StepTracer
from tokenloom.spec_decode.adaptive import AdaptiveDraftPolicy

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, tracer: StepTracer | None = None) -> None:
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

    def add_request(self, request: Request) -> None:
        """Raises RequestRejected (a ValueError) for a request that can never run."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_requests():
            return []
        t_start = self.clock()
        scheduler_output = self.scheduler.schedule()
        future = self.executor.execute_model(scheduler_output, non_block=True)
        outputs = self._finish_step(t_start, scheduler_output, future)
        if scheduler_output.is_empty and not outputs and self._waiting_for_grammar():
            # Nothing can run until a grammar compiles: yield the CPU to the compile threads
            # instead of spinning through empty steps.
            time.sleep(0.001)
        return outputs

    def _waiting_for_grammar(self) -> bool:
        return any(r.status == RequestStatus.WAITING_FOR_FSM for r in self.scheduler.waiting)

    def _finish_step(
        self, t_start: float, scheduler_output: SchedulerOutput, future: Future[ModelRunnerOutput]
    ) -> list[EngineCoreOutput]:
        """Wait for a step's model output, update the scheduler from it, and record the step."""
        model_output = self._result(scheduler_output, future)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.scheduler.num_spec_tokens:
            self._post_step(outputs)
        t_end = self.clock()
        self.num_steps += 1
        self.last_step_tokens = scheduler_output.total_num_scheduled_tokens
        self.last_step_time = t_end - t_start
        if self.tracer is not None:
            self.tracer.record(t_start, t_end, self.scheduler, scheduler_output, outputs)
        return outputs

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
            lists = policy.trim(drafts.req_ids, lists, num_decoding=len(self.scheduler.running))
        self.scheduler.update_draft_token_ids(drafts.req_ids, lists)

    @staticmethod
    def _result(scheduler_output: SchedulerOutput, future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        try:
            return future.result()
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
