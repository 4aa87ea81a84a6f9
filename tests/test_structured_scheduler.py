"""Structured outputs in the scheduler (no model, no torch): WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR while the
grammar compiles, others admitted meanwhile, bitmask rows for exactly the rows that sample, matcher advanced with
the accepted tokens, compile errors finish the request, an abort while compiling leaves nothing behind."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from tests.sched_utils import create_scheduler
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.structured_output import StructuredOutputManager
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams


class ListMatcher:
    """Accepts exactly `allowed` in order; terminated once all were accepted."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed, self.pos = allowed, 0

    def accept_token(self, token_id: int) -> bool:
        if self.pos < len(self.allowed) and self.allowed[self.pos] == token_id:
            self.pos += 1
            return True
        return False

    def fill_bitmask(self, bitmask: list, index: int) -> None:
        bitmask[index] = {self.allowed[self.pos]}

    def is_terminated(self) -> bool:
        return self.pos == len(self.allowed)

    def rollback(self, num_tokens: int) -> None:
        self.pos -= num_tokens


class GatedBackend:
    """Compiles "regex" specs to a token list once `gate` is set; "grammar" specs fail."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.compiles: list[str] = []

    def compile(self, kind: str, spec: str) -> list[int]:
        self.gate.wait(10)
        self.compiles.append(spec)
        if kind == "grammar":
            raise ValueError("bad grammar")
        return [int(t) for t in spec.split(",")]

    def matcher(self, compiled: list[int], stop_token_ids) -> ListMatcher:
        return ListMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> list:
        return [None] * num_rows

    def fill_all_allowed(self, bitmask: list, index: int) -> None:
        bitmask[index] = "all"


def constrained(rid: str, spec: str, n_prompt: int = 6, max_tokens: int = 8, kind: str = "regex") -> Request:
    so = StructuredOutputsParams(**{kind: spec})
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens, structured_outputs=so))


def plain(rid: str, n_prompt: int = 6) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=8))


def with_manager(**kw):
    sched = create_scheduler(**kw)
    backend = GatedBackend()
    sched.structured_output_manager = StructuredOutputManager(lambda: backend, max_workers=1)
    return sched, backend


def test_waiting_for_fsm_does_not_block_others_and_is_admitted_once_compiled() -> None:
    sched, backend = with_manager(max_num_batched_tokens=64, num_blocks=64, block_size=4)
    sched.add_request(constrained("c", "7,8"))
    sched.add_request(plain("p"))
    assert sched.requests["c"].status == RequestStatus.WAITING_FOR_FSM
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["p"]  # the compiling one is stepped over, not a barrier
    assert [r.request_id for r in sched.waiting] == ["c"] and so.grammar_bitmask is None
    sched.update_from_output(so, ModelRunnerOutput(["p"], {"p": 0}, [[1]]))
    backend.gate.set()
    sched.structured_output_manager.executor.shutdown(wait=True)  # compiled now
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"p", "c"}
    assert so.structured_output_request_ids == ["c"] and so.grammar_bitmask == [{7}]


def test_bitmask_rows_only_for_rows_that_sample_and_matcher_follows_tokens() -> None:
    # A 10-token prompt in chunks of 4: the first two chunks sample nothing, so carry no bitmask row.
    sched, backend = with_manager(max_num_batched_tokens=4, max_num_seqs=4, max_model_len=64, num_blocks=64,
                                  block_size=4)
    backend.gate.set()
    sched.add_request(constrained("c", "5,6,2", n_prompt=10))
    sched.structured_output_manager.executor.shutdown(wait=True)
    rows = []
    outputs = []
    for token in (None, None, 5, 6, 2):
        so = sched.schedule()
        rows.append(list(so.structured_output_request_ids))
        sampled = [[token]] if token is not None else [[]]
        outputs += sched.update_from_output(so, ModelRunnerOutput(["c"], {"c": 0}, sampled))
    assert rows == [[], [], ["c"], ["c"], ["c"]]
    # The grammar completed with its last token: finished, "stop", its matcher freed.
    assert outputs[-1].finish_reason == "stop" and not sched.requests
    assert not sched.structured_output_manager.requests


def test_a_token_the_grammar_rejects_finishes_the_request_with_an_error() -> None:
    sched, backend = with_manager(num_blocks=64, block_size=4)
    backend.gate.set()
    sched.add_request(constrained("c", "5,6"))
    sched.structured_output_manager.executor.shutdown(wait=True)
    so = sched.schedule()
    [out] = sched.update_from_output(so, ModelRunnerOutput(["c"], {"c": 0}, [[9]]))
    assert out.finish_reason == "error"
    assert out.error.startswith("the structured-output grammar allows no token here: after 0 ")
    assert "[9] were refused" in out.error


def test_compile_error_finishes_only_that_request() -> None:
    sched, backend = with_manager(num_blocks=64, block_size=4)
    backend.gate.set()
    sched.add_request(constrained("bad", "root ::= x", kind="grammar"))
    sched.add_request(plain("p"))
    sched.structured_output_manager.executor.shutdown(wait=True)
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(["p"], {"p": 0}, [[1]]))
    errors = [o for o in outs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["bad"] and "bad grammar" in errors[0].error
    assert "bad" not in sched.requests and "p" in sched.requests and len(sched.waiting) == 0


def test_a_compile_that_raised_timeout_error_is_a_failed_compile() -> None:
    """vLLM 0.32's rule (#53130, its tests/v1/structured_output/test_request.py): a grammar future that ended in
    TimeoutError has finished (failed), it is not still compiling; the request ends with the error."""
    sched, backend = with_manager(num_blocks=64, block_size=4)
    request = constrained("slow", "7,8")
    sched.add_request(request)
    timed_out: Future = Future()
    timed_out.set_exception(TimeoutError("compiler timed out"))
    request.structured_output_request.compiled = timed_out
    so = sched.schedule()
    [out] = sched.update_from_output(so, ModelRunnerOutput([], {}, []))
    assert (out.request_id, out.finish_reason) == ("slow", "error") and "compiler timed out" in out.error
    assert not sched.requests
    backend.gate.set()


def test_without_a_tokenizer_a_constrained_request_waits_one_step_then_errors() -> None:
    # vLLM's skip_tokenizer_init: no grammar can compile. After one schedule() the request is where
    # vLLM's leaves it (waiting, stepped over: tests/peer/core's vendored case); vLLM's would wait for
    # ever (its frontend refuses it first), tokenloom's then finishes with vLLM's frontend message.
    sched = create_scheduler(num_blocks=64, block_size=4)
    sched.structured_output_manager = StructuredOutputManager(None)
    sched.add_request(constrained("c", "1,2"))
    sched.add_request(plain("p"))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["p"] and [r.request_id for r in sched.waiting] == ["c"]
    outs = sched.update_from_output(so, ModelRunnerOutput(["p"], {"p": 0}, [[1]]))
    [err] = [o for o in outs if o.finish_reason == "error"]
    assert err.request_id == "c" and "skip_tokenizer_init" in err.error
    assert "c" not in sched.requests and len(sched.waiting) == 0 and not sched.structured_output_manager.requests
    assert sched.structured_output_manager.num_compiles == 0
    sched.structured_output_manager.clear_backend()


def test_abort_while_compiling_leaves_no_state_behind() -> None:
    sched, backend = with_manager(num_blocks=64, block_size=4)
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.add_request(constrained("c", "1,2"))
    sched.schedule()
    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert not sched.requests and len(sched.waiting) == 0 and not sched.structured_output_manager.requests
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    backend.gate.set()  # the compile finishing later touches nothing
    sched.structured_output_manager.executor.shutdown(wait=True)
    so = sched.schedule()
    assert so.is_empty and not sched.has_unfinished_requests()


def test_equal_schemas_compile_once() -> None:
    sched, backend = with_manager(num_blocks=64, block_size=4)
    backend.gate.set()
    for i in range(3):
        sched.add_request(constrained(f"c{i}", "4,5"))
    sched.structured_output_manager.executor.shutdown(wait=True)
    assert backend.compiles == ["4,5"]
    manager = sched.structured_output_manager
    assert manager.num_compiles == 1 and manager.num_cache_hits == 2


def test_constrained_request_without_a_backend_is_rejected() -> None:
    import pytest

    from tokenloom.core.scheduler import RequestRejected

    sched = create_scheduler(num_blocks=64, block_size=4)
    with pytest.raises(RequestRejected, match="grammar backend"):
        sched.add_request(constrained("c", "1"))
