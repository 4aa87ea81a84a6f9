"""The executor seam: the engine core hands SchedulerOutputs to an Executor, now or as a Future."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.cost_model import CostModel
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.engine.executor import Executor, ModelThread, UniProcExecutor
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.executor import SimulatedExecutor
from tokenloom.sim.runner import SIM_TOKEN_ID
from tokenloom.workload.clock import VirtualClock

UNIT = CostModel({"overhead": 1.0})


def _core(executor: Executor, clock: VirtualClock) -> EngineCore:
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    return EngineCore(Scheduler(sched, CacheConfig(block_size=4, num_blocks=64), clock=clock), executor)


def _request(rid: str, max_tokens: int = 3) -> Request:
    return Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_both_executors_run_one_batch_at_a_time() -> None:
    assert UniProcExecutor(object()).max_concurrent_batches == 1  # type: ignore[arg-type]
    assert SimulatedExecutor(UNIT, VirtualClock()).max_concurrent_batches == 1


def test_non_block_returns_a_done_future_with_the_same_output() -> None:
    clock = VirtualClock()
    executor = SimulatedExecutor(UNIT, clock)
    core = _core(executor, clock)
    core.add_request(_request("a"))
    output = core.scheduler.schedule()
    future = executor.execute_model(output, non_block=True)
    assert isinstance(future, Future) and future.done()
    result = future.result()
    assert result.req_ids == ["a"] and result.sampled_token_ids == [[SIM_TOKEN_ID]]
    assert clock() == 1.0  # the step ran before the call returned: one modelled second
    # The blocking call answers the next step directly.
    core.scheduler.update_from_output(output, result)
    again = executor.execute_model(core.scheduler.schedule())
    assert isinstance(again, ModelRunnerOutput) and again.sampled_token_ids == [[SIM_TOKEN_ID]]


def test_the_engine_core_runs_a_workload_through_the_simulated_executor() -> None:
    clock = VirtualClock()
    core = _core(SimulatedExecutor(UNIT, clock), clock)
    core.add_request(_request("a", max_tokens=3))
    core.add_request(_request("b", max_tokens=2))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens == {"a": [SIM_TOKEN_ID] * 3, "b": [SIM_TOKEN_ID] * 2}
    assert core.num_steps == 3 and clock() == 3.0


class FailingOnce:
    """A runner whose first step raises, as a kernel failure would."""

    def __init__(self, inner: UniProcExecutor) -> None:
        self.inner = inner
        self.calls = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("simulated kernel failure")
        return self.inner.execute_model(scheduler_output)


def test_a_failing_step_surfaces_through_the_future_and_fails_only_its_requests() -> None:
    clock = VirtualClock()
    failing = FailingOnce(SimulatedExecutor(UNIT, clock))
    executor = UniProcExecutor(failing)
    core = _core(executor, clock)
    core.add_request(_request("a"))
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert "simulated kernel failure" in (outs[0].error or "")
    # The executor reports the failure as the future's exception, and raises it when blocking.
    core.add_request(_request("b"))
    failing.calls = 0
    output = core.scheduler.schedule()
    future = executor.execute_model(output, non_block=True)
    assert isinstance(future.exception(), RuntimeError)
    failing.calls = 0
    with pytest.raises(RuntimeError, match="simulated"):
        executor.execute_model(output)
    core.abort_requests(["b"])  # b was scheduled by hand, never updated: leave the engine clean


def test_later_requests_run_after_a_failed_step() -> None:
    clock = VirtualClock()
    core = _core(UniProcExecutor(FailingOnce(SimulatedExecutor(UNIT, clock))), clock)
    core.add_request(_request("a"))
    assert core.step()[0].finish_reason == "error"
    core.add_request(_request("b", max_tokens=2))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert tokens == [SIM_TOKEN_ID] * 2


def test_reset_drops_the_runners_request_state() -> None:
    clock = VirtualClock()
    executor = SimulatedExecutor(UNIT, clock)
    core = _core(executor, clock)
    core.add_request(_request("a"))
    core.step()
    assert executor.runner.tracker.lengths
    executor.reset()
    assert not executor.runner.tracker.lengths


def test_a_model_thread_runs_calls_on_one_thread_and_raises_their_errors() -> None:
    import threading

    thread = ModelThread()
    idents = {thread.call(threading.get_ident) for _ in range(3)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    thread.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.call(threading.get_ident)


def test_an_executor_steps_on_the_model_thread_it_is_given_in_both_modes_and_leaves_it_running() -> None:
    import threading

    class Recorder:
        def __init__(self) -> None:
            self.idents: set[int] = set()

        def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
            self.idents.add(threading.get_ident())
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])

    thread, runner = ModelThread(), Recorder()
    owner = thread.call(threading.get_ident)
    for worker_thread in (False, True):
        executor = UniProcExecutor(runner, worker_thread=worker_thread, model_thread=thread)
        assert executor.max_concurrent_batches == (2 if worker_thread else 1)
        executor.execute_model(None)  # type: ignore[arg-type]  # the recorder never reads it
        future = executor.execute_model(None, non_block=True)  # type: ignore[arg-type]
        assert isinstance(future, Future) and future.result() is not None
        executor.shutdown()
    assert runner.idents == {owner}
    assert thread.call(threading.get_ident) == owner  # not shut down by the executors
    thread.shutdown()
