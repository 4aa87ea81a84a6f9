"""Executor: the seam between the engine core and whatever runs the model (vLLM's v1/executor).

The engine core hands each SchedulerOutput to an executor and gets a ModelRunnerOutput back, now
(`non_block=False`) or as a `concurrent.futures.Future` of one (`non_block=True`). It never sees the
runner, so where the model runs is the executor's business alone:

    UniProcExecutor     the runner in the calling thread (the torch ModelRunner; any object with
                        `execute_model(SchedulerOutput) -> ModelRunnerOutput`)
    SimulatedExecutor   the simulator's cost-model runner on a virtual clock (tokenloom/sim/executor.py)

Later executors are new classes here, not changes to the engine core: one that runs the step in a
worker thread (for a batch queue of depth 2, `max_concurrent_batches = 2`), one per data-parallel
replica, or one that drives worker processes. A failed step surfaces as the exception of the call
(or of the future); the engine core turns it into an error for that step's requests only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tokenloom.config import EngineConfig


class Runner(Protocol):
    """What an in-process executor wraps: the torch ModelRunner, the SimulatedRunner, a recorder."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class Executor(ABC):
    """Runs the model for the engine core. Subclasses implement `execute_model`."""

    # How many steps may be in flight at once: the engine core keeps a batch queue this deep
    # (vLLM's `max_concurrent_batches`). 1: every step finishes before the next is scheduled.
    max_concurrent_batches: int = 1

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step. With non_block, return a Future whose result (or exception) is the step's."""

    def take_draft_token_ids(self) -> Any:
        """Speculative decoding: the drafts proposed after the last step (an object with `req_ids`
        and `draft_token_ids`), or None. vLLM's EngineCore.post_step hands them to the scheduler."""
        return None

    def reset(self) -> None:  # noqa: B027 - optional hook, a no-op unless the runner keeps state
        """Drop all per-request state (a fresh scheduler is taking over an idle executor)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the executor holds (threads, worker processes)."""


class UniProcExecutor(Executor):
    """One runner, called in the caller's thread. With non_block the step still runs before the call
    returns (as in vLLM's UniProcExecutor), and the Future comes back already done."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: Any, **runner_kwargs: Any) -> UniProcExecutor:
        """The torch ModelRunner over a loaded model; runner_kwargs are ModelRunner's (block_size,
        num_blocks, dtype, device, calibration_token_ids); the quantization comes from the config."""
        from tokenloom.model.runner import ModelRunner

        return cls(ModelRunner(loaded, quantization=config.quantization, **runner_kwargs))

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if not non_block:
            return self.runner.execute_model(scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.runner.execute_model(scheduler_output))
        except Exception as exc:  # delivered by future.result(), like a worker's failure
            future.set_exception(exc)
        return future

    def take_draft_token_ids(self) -> Any:
        take = getattr(self.runner, "take_draft_token_ids", None)
        return take() if take is not None else None

    def reset(self) -> None:
        requests = getattr(self.runner, "requests", None)  # the torch ModelRunner's per-request state
        if requests is not None:
            requests.clear()
        spec_decode = getattr(self.runner, "spec_decode", None)  # its proposer's token rows
        if spec_decode is not None:
            spec_decode.reset()
