"""SimulatedExecutor: the engine core's Executor over the cost-model SimulatedRunner.

Each step runs in the calling thread and advances the virtual clock by its modelled time, so every
timestamp the scheduler reads is simulated time; with non_block the Future comes back already done,
as from the in-process executor.

With `async_scheduling=True` the executor keeps two steps in flight (`max_concurrent_batches = 2`),
so the engine core runs vLLM's batch queue with the AsyncScheduler exactly as on the real engine:
step N+1 is scheduled before step N's output is processed. A launched step runs (and advances the
clock) only when its output is first needed, always in submission order, which is when it would
have finished on the engine: so step N+1 is scheduled at the virtual time step N started, and the
runner sees N's sampled tokens (and fills N+1's placeholder drafts from them) as the worker thread
does.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from tokenloom.core.cost_model import CostModel
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.engine.executor import UniProcExecutor
from tokenloom.sim.runner import SIM_TOKEN_ID, SimulatedRunner
from tokenloom.workload.clock import VirtualClock


class _LaunchedStep(Future):
    """A step launched but not run yet: `result()` runs it (and every step launched before it)."""

    def __init__(self, executor: SimulatedExecutor, scheduler_output: SchedulerOutput) -> None:
        super().__init__()
        self.executor = executor
        self.scheduler_output = scheduler_output

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            self.executor.run_launched(self)
        return super().result(timeout)


class SimulatedExecutor(UniProcExecutor):
    runner: SimulatedRunner

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = SIM_TOKEN_ID, *,
                 async_scheduling: bool = False, **spec_kwargs: Any) -> None:  # fmt: skip
        """spec_kwargs: SimulatedRunner's speculative-decoding options (num_spec_tokens, spec_acceptance,
        max_model_len, seed)."""
        super().__init__(SimulatedRunner(cost_model, clock, token_id, **spec_kwargs))
        self._launched: deque[_LaunchedStep] = deque()
        if async_scheduling:
            self.max_concurrent_batches = 2

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self.max_concurrent_batches == 1 or not non_block:
            self.run_launched(None)
            return super().execute_model(scheduler_output, non_block)
        step = _LaunchedStep(self, scheduler_output)
        self._launched.append(step)
        return step

    def run_launched(self, until: _LaunchedStep | None) -> None:
        """Run the launched steps in order, up to and including `until` (None: all of them)."""
        while self._launched:
            step = self._launched.popleft()
            try:
                step.set_result(self._run(step.scheduler_output))
            except Exception as exc:  # delivered by result(), like a worker's failure
                step.set_exception(exc)
            if step is until:
                return

    def reset(self) -> None:
        self.run_launched(None)
        self.runner.tracker.clear()
