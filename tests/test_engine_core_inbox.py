"""The engine-core process's inbox (EngineCoreProc), as vLLM 0.32's EngineCoreProc treats it.

An abort that arrives while a request's last step runs (vLLM's PR 29987, its tests/v1/engine/test_abort_final_step.py)
is applied before that step's output, so the request ends aborted, not "length", for the scheduler, the KV
connector's request_finished and the stats alike. vLLM's test patches its CUDA worker and reads the status through a
connector in a forked engine; here the engine-core loop runs in the test's thread over pipes, with an executor that
sends the abort down the inbox while it "runs" the step, so the abort is in the pipe exactly while the step is in
flight. A request whose preprocessing fails ends with "error" and the engine goes on."""

from __future__ import annotations

from multiprocessing import Pipe
from typing import Any

import pytest

from tests.sched_utils import create_requests, create_scheduler, runner_output
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import RequestStatus
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_messages import AbortRequests, EngineCoreRequest, Shutdown
from tokenloom.engine.core_proc import EngineCoreProc
from tokenloom.engine.executor import Executor
from tokenloom.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole


class StatusRecorder(KVConnectorBase_V1):
    """The scheduler side of a KV connector that only records how each request finished."""

    def __init__(self) -> None:
        super().__init__(None, KVConnectorRole.SCHEDULER)  # type: ignore[arg-type]
        self.finished: dict[str, RequestStatus] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self.finished[request.request_id] = request.status
        return False, None

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class AbortWhileRunning(Executor):
    """Runs a step as the sched_utils runner does; while the step that completes `victim` runs, the client's
    abort of it arrives (is written to the engine's inbox)."""

    def __init__(self, scheduler: Any, client_end: Any, victim: str) -> None:
        self.scheduler = scheduler
        self.client_end = client_end
        self.victim = victim

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        output: ModelRunnerOutput = runner_output(self.scheduler, scheduler_output)
        if self.victim in output.req_ids and output.sampled_token_ids[output.req_id_to_index[self.victim]]:
            self.client_end.send(AbortRequests([self.victim]))
        from concurrent.futures import Future

        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future if non_block else output


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_abort_during_the_last_step_finishes_aborted(max_tokens: int) -> None:
    scheduler = create_scheduler()
    connector = scheduler.connector = StatusRecorder()
    client_end, engine_end = Pipe()
    core = EngineCore(scheduler, AbortWhileRunning(scheduler, client_end, "0"))
    proc = EngineCoreProc(core, engine_end, engine_end)
    [victim, other] = create_requests(2, max_tokens=max_tokens)
    for request in (victim, other):
        proc._apply(EngineCoreRequest.from_request(request))
    outputs: list[Any] = []
    while core.has_work():
        # The first step of `max_tokens` 1 is the victim's last; with 3 its abort comes in its first step too.
        outputs += core.step()
        proc._handle_inbox(block=False)
    assert connector.finished == {"0": RequestStatus.FINISHED_ABORTED, "1": RequestStatus.FINISHED_LENGTH_CAPPED}
    # The aborted request's step produced nothing for it: its client ended it already.
    assert [o.request_id for o in outputs if o.finished] == ["1"]
    assert not any(o.request_id == "0" for o in outputs)
    assert not scheduler.requests


def test_an_add_read_mid_step_waits_for_the_step_and_keeps_its_place() -> None:
    """Messages read while a step runs are applied after it, in order: an add then its abort leave nothing
    running, and a Shutdown read mid-step still stops the loop."""
    scheduler = create_scheduler()
    client_end, engine_end = Pipe()
    core = EngineCore(scheduler, AbortWhileRunning(scheduler, client_end, "none"))
    proc = EngineCoreProc(core, engine_end, engine_end)
    [first, late] = create_requests(2, max_tokens=4)
    proc._apply(EngineCoreRequest.from_request(first))
    client_end.send(EngineCoreRequest.from_request(late))
    client_end.send(AbortRequests(["1"]))
    client_end.send(Shutdown())
    core.step()  # reads the three messages mid-step: "1" is not in the scheduler yet
    assert set(scheduler.requests) == {"0"}
    assert proc._handle_inbox(block=False) and proc.stopping
    assert set(scheduler.requests) == {"0"}  # "1" was added, then aborted, in the order sent


def test_a_request_whose_preprocessing_fails_ends_with_error_and_the_engine_goes_on(monkeypatch) -> None:
    """vLLM's _handle_request_preproc_error, in the engine-core process (the in-process client's is vLLM's own test,
    tests/peer/requests/test_vllm_preprocess_error_handling.py)."""
    scheduler = create_scheduler()
    client_end, engine_end = Pipe()
    core = EngineCore(scheduler, AbortWhileRunning(scheduler, client_end, "none"))
    proc = EngineCoreProc(core, engine_end, engine_end)
    original = EngineCore.preprocess_add_request

    def failing(self: EngineCore, request: Any) -> Any:
        if request.request_id == "0":
            raise RuntimeError("boom")
        return original(self, request)

    monkeypatch.setattr(EngineCore, "preprocess_add_request", failing)
    for request in create_requests(2, max_tokens=2):
        proc._apply(EngineCoreRequest.from_request(request))
    batch = proc._batch([], None)
    [failed] = batch.outputs
    assert (failed.request_id, failed.finish_reason, failed.new_token_ids) == ("0", "error", [])
    assert "RuntimeError: boom" in failed.error
    assert set(scheduler.requests) == {"1"}
    while core.has_work():
        core.step()
    assert not scheduler.requests
