"""Executor: the seam between the engine core and whatever runs the model (vLLM's v1/executor).

The engine core hands each SchedulerOutput to an executor and gets a ModelRunnerOutput back, now
(`non_block=False`) or as a `concurrent.futures.Future` of one (`non_block=True`). It never sees the
runner, so where the model runs is the executor's business alone:

    UniProcExecutor     the runner in the calling thread (the torch ModelRunner; any object with
                        `execute_model(SchedulerOutput) -> ModelRunnerOutput`); with
                        `worker_thread=True` (async scheduling) in one worker thread instead, steps
                        in submission order, two in flight at most (`max_concurrent_batches = 2`);
                        with a `ModelThread`, on the thread that loaded the model
    SimulatedExecutor   the simulator's cost-model runner on a virtual clock (tokenloom/sim/executor.py)
    MultiprocExecutor   tensor / pipeline-parallel worker processes, one per rank
                        (tokenloom/engine/multiproc_executor.py; docs/parallelism.md)

Later executors are new classes, not changes to the engine core. A failed step surfaces as the exception of the call
(or of the future); the engine core turns it into an error for that step's requests only.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tokenloom.config import EngineConfig


_T = TypeVar("_T")


class ExecutorDeadError(RuntimeError):
    """The executor cannot run another step (a worker process died): the engine is dead, not one
    step's requests. The engine core lets it through instead of failing the step's requests."""


class ModelThread:
    """The one thread that owns the model under async scheduling: it loads the weights, builds the
    runner, and runs every step, so the engine thread never starts an OpenMP parallel region.

    Why it matters: libgomp keeps one thread team per thread that starts parallel regions, and once
    it manages more threads than the process has cores it stops spinning at barriers (100 spins,
    then a futex sleep). A model loaded on the engine thread and stepped on a separate worker thread
    has two teams, so on a 2-core machine every barrier of the decode step (~240 a step) became a
    sleep and a wake-up: gguf single-stream TPOT 4.4 -> 11.2 ms, 35,000 context switches in 256
    steps (docs/async.md). With one thread owning the model there is one team."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-model")

    def submit(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> Future[_T]:
        if self._pool is None:
            raise RuntimeError("the model thread is shut down")
        return self._pool.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run fn on the model thread and wait for it (its exception is raised here)."""
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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

    def add_lora(self, lora_request: Any) -> bool:
        """Load and check a LoRA adapter where the model runs (vLLM's Executor.add_lora); ValueError
        saying why it cannot run. Executors whose runner has no LoRA refuse."""
        raise ValueError("LoRA adapters are not supported by this executor")

    def remove_lora(self, lora_int_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def reset(self) -> None:  # noqa: B027 - optional hook, a no-op unless the runner keeps state
        """Drop all per-request state (a fresh scheduler is taking over an idle executor)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the executor holds (threads, worker processes)."""


class UniProcExecutor(Executor):
    """One runner, called in the caller's thread. With non_block the step still runs before the call
    returns (as in vLLM's UniProcExecutor), and the Future comes back already done.

    worker_thread=True (async scheduling): the runner runs in one worker thread, so `execute_model(so,
    non_block=True)` returns at once and the engine core schedules the next step meanwhile (torch's
    kernels release the GIL). One thread keeps the steps in submission order, which is what makes
    async scheduling correct here, as CUDA stream order does in vLLM: step N+1 runs after step N, so
    the runner knows N's sampled token when N+1 needs it as input, and a block freed while a step is
    in flight is only written again by a later step.

    model_thread: the ModelThread that loaded the model (the engine's, when it was built for async
    scheduling). Steps then run on it in both modes (sync: one at a time, the caller waiting), and
    the executor does not shut it down: its owner does. Without one, worker_thread=True starts a
    thread of the executor's own (the runner moves there from the thread that built it)."""

    def __init__(self, runner: Runner, worker_thread: bool = False, model_thread: ModelThread | None = None) -> None:
        self.runner = runner
        self._owns_thread = model_thread is None and worker_thread
        self._thread: ModelThread | None = ModelThread() if self._owns_thread else model_thread
        if worker_thread:
            self.max_concurrent_batches = 2

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: Any, *, worker_thread: bool = False,
                    model_thread: ModelThread | None = None, **runner_kwargs: Any) -> UniProcExecutor:  # fmt: skip
        """The torch ModelRunner over a loaded model, built on model_thread when given; runner_kwargs
        are ModelRunner's (block_size, num_blocks, dtype, device, calibration_token_ids); the
        quantization comes from the config."""
        from tokenloom.model.runner import ModelRunner

        def build() -> ModelRunner:
            return ModelRunner(loaded, quantization=config.quantization, **runner_kwargs)

        runner = model_thread.call(build) if model_thread is not None else build()
        return cls(runner, worker_thread, model_thread)

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.monotonic()
        out = self.runner.execute_model(scheduler_output)
        out.execute_start, out.execute_end = t0, time.monotonic()
        return out

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._thread is not None:
            queued = self._thread.submit(self._run, scheduler_output)
            return queued if non_block else queued.result()
        if not non_block:
            return self._run(scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self._run(scheduler_output))
        except Exception as exc:  # delivered by future.result(), like a worker's failure
            future.set_exception(exc)
        return future

    def take_draft_token_ids(self) -> Any:
        take = getattr(self.runner, "take_draft_token_ids", None)
        return take() if take is not None else None

    # The runner's manager guards its host cache with a lock: these run in the calling thread, never
    # waiting for a step in flight.
    def add_lora(self, lora_request: Any) -> bool:
        add = getattr(self.runner, "add_lora", None)
        if add is None:
            return super().add_lora(lora_request)
        return add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        remove = getattr(self.runner, "remove_lora", None)
        return remove(lora_int_id) if remove is not None else False

    def list_loras(self) -> set[int]:
        list_loras = getattr(self.runner, "list_loras", None)
        return list_loras() if list_loras is not None else set()

    def reset(self) -> None:
        requests = getattr(self.runner, "requests", None)  # the torch ModelRunner's per-request state
        if requests is not None:
            requests.clear()
        spec_decode = getattr(self.runner, "spec_decode", None)  # its proposer's token rows
        if spec_decode is not None:
            spec_decode.reset()
        input_batch = getattr(self.runner, "input_batch", None)  # the custom logits processors' rows
        if input_batch is not None:
            input_batch.remove_all()

    def shutdown(self) -> None:
        if self._thread is not None and self._owns_thread:
            self._thread.shutdown()
        self._thread = None
