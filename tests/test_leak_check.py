"""The leak check of tests/conftest.py catches what it claims to: a planted leak of each kind fails its test,
a clean test passes. Run through pytester with the real fixture, over EngineCores with the replay runner
kept alive in module state (as a fixture keeps its engine)."""

from __future__ import annotations

INNER_CONFTEST = "from tests.conftest import engine_leak_check  # noqa: F401\n"

INNER_TESTS = '''
from tests.sched_utils import create_requests, create_scheduler
from tokenloom.core.replay_runner import ReplayRunner
from tokenloom.engine.core import EngineCore
from tokenloom.engine.executor import UniProcExecutor


KEPT = []  # module state outliving each test, as a module-scoped fixture's engine does


def _core():
    sched = create_scheduler(num_blocks=64, block_size=4)
    core = EngineCore(sched, UniProcExecutor(ReplayRunner(sched)))
    KEPT.append(core)
    return core


def _drain(core):
    while core.scheduler.has_requests():
        core.step()


def test_clean():
    core = _core()
    for r in create_requests(3, num_tokens=9, max_tokens=5):
        core.add_request(r)
    _drain(core)


def test_unfinished_request():
    core = _core()
    core.add_request(create_requests(1, num_tokens=9, max_tokens=50)[0])
    core.step()


def test_blocks_held_outside_any_request():
    core = _core()
    core.scheduler.kv_cache_manager.block_pool.get_new_blocks(2)


def test_runner_state_for_a_dropped_request():
    core = _core()
    core.executor.runner.requests = {"ghost": object()}


def test_a_dropped_engine_is_garbage_not_a_leak():
    sched = create_scheduler(num_blocks=64, block_size=4)
    core = EngineCore(sched, UniProcExecutor(ReplayRunner(sched)))
    core.add_request(create_requests(1, num_tokens=9, max_tokens=50)[0])
    core.step()


def test_aborted_request_is_clean():
    core = _core()
    (r,) = create_requests(1, num_tokens=9, max_tokens=50)
    core.add_request(r)
    core.step()
    core.abort_requests([r.request_id])
'''


def test_planted_leaks_fail_their_tests(pytester) -> None:
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 6 and outcomes.get("errors") == 3, result.stdout.str()
    text = result.stdout.str()
    assert "ERROR at teardown of test_unfinished_request" in text
    assert "were never finished or aborted" in text
    assert "ERROR at teardown of test_blocks_held_outside_any_request" in text
    assert "KV blocks are still allocated" in text
    assert "ERROR at teardown of test_runner_state_for_a_dropped_request" in text and "'ghost'" in text
