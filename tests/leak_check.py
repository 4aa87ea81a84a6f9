"""The leak check every test runs (autouse, tests/conftest.py): no test may leave an engine dirty.

"Dirty" is what a later test, or a long-running server, would trip over:
- requests still waiting or running in a scheduler, or still tracked by an LLMEngine's output processor;
- KV blocks not back in the free queue (prefix-cached blocks in the free queue count as free);
- runner state (`ModelRunner.requests`) for a request the scheduler no longer knows, other than the
  finished ones the runner is told about at the next step (`Scheduler.finished_req_ids`, as in vLLM);
- a live `tokenloom serve` (tests/test_server_harness.py) whose /metrics still shows running or
  waiting requests or used KV blocks (polled briefly: a client's abort travels through two processes).

Engines are found by wrapping EngineCore.__init__ and LLMEngine.__init__ for the session, through weak
references: what is checked is every engine still alive after the test — a fixture's, or one kept in
module state — which is the state a later test (or a long-running server) would inherit. An engine the
test dropped is garbage, not a leak (the explorer's scenarios stop simulations mid-run on purpose). The
check costs a few attribute reads per live engine; the server check one GET per live server. An engine
reported once is dropped from the registry, so one leak fails one test, not every test after it.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

_engine_cores: weakref.WeakSet = weakref.WeakSet()
_llm_engines: weakref.WeakSet = weakref.WeakSet()
_installed = False


def install() -> None:
    """Register every EngineCore and LLMEngine built from now on (idempotent)."""
    global _installed
    if _installed:
        return
    from tokenloom.engine.core import EngineCore
    from tokenloom.engine.llm_engine import LLMEngine

    for cls, registry in ((EngineCore, _engine_cores), (LLMEngine, _llm_engines)):
        original = cls.__init__

        def wrapped(self: Any, *args: Any, __original=original, __registry=registry, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            __registry.add(self)

        cls.__init__ = wrapped
    _installed = True


def core_leaks(core: Any) -> list[str]:
    """What an idle EngineCore (scheduler + runner) still holds; [] when clean."""
    problems = []
    sched = core.scheduler
    if sched.has_unfinished_requests() or sched.requests:
        problems.append(f"{len(sched.waiting)} waiting / {len(sched.running)} running requests "
                        f"({sorted(sched.requests)[:5]}) were never finished or aborted")
    pool = sched.kv_cache_manager.block_pool
    if pool.get_num_free_blocks() != pool.num_blocks:
        problems.append(f"{pool.num_blocks - pool.get_num_free_blocks()} of {pool.num_blocks} KV blocks "
                        "are still allocated")
    runner = getattr(getattr(core, "executor", None), "runner", None) or getattr(core, "runner", None)
    runner_requests = getattr(runner, "requests", None)
    if isinstance(runner_requests, dict):
        stale = set(runner_requests) - set(sched.requests) - set(sched.finished_req_ids)
        if stale:
            problems.append(f"the runner keeps state for {len(stale)} requests the scheduler has dropped "
                            f"without telling it: {sorted(stale)[:5]}")
    return problems


def engine_leaks(engine: Any) -> list[str]:
    """An LLMEngine: its core, plus requests its output processor still tracks."""
    problems = []
    if engine.output_processor.num_unfinished():
        problems.append(f"the output processor still tracks {engine.output_processor.num_unfinished()} requests")
    return problems


def server_leaks(server: Any, wait_s: float = 3.0) -> list[str]:
    """A live tokenloom serve: /metrics must come back to idle within `wait_s`."""
    from tests.test_server_harness import metric

    deadline = time.monotonic() + wait_s
    while True:
        try:
            if server.health_status() != 200:  # stopping, or its engine was killed on purpose
                return []
            m = server.metrics()
        except Exception:  # the server is gone: nothing to check
            return []
        running = metric(m, "tokenloom:num_requests_running")
        waiting = metric(m, "tokenloom:num_requests_waiting")
        # usage is 1 - free/total once the engine has reported (free counts cached-but-unused blocks),
        # and 0 before its first step (when the free-blocks gauge still reads 0)
        usage = metric(m, "tokenloom:kv_cache_usage_perc")
        if running == waiting == usage == 0:
            return []
        if time.monotonic() > deadline:
            free, total = metric(m, "tokenloom:kv_cache_free_blocks"), metric(m, "tokenloom:kv_cache_total_blocks")
            return [f"server {server.url}: {running:g} running / {waiting:g} waiting requests and "
                    f"{total - free:g} of {total:g} KV blocks in use {wait_s:g} s after the test"]
        time.sleep(0.05)


def _dirty_engines() -> list[tuple[Any, list[str]]]:
    found = []
    for core in list(_engine_cores):
        if problems := core_leaks(core):
            found.append((core, [f"EngineCore {id(core):#x}: {p}" for p in problems]))
    for engine in list(_llm_engines):
        if problems := engine_leaks(engine):
            found.append((engine, [f"LLMEngine {engine.model_name}: {p}" for p in problems]))
    return found


def collect_leaks() -> list[str]:
    """Check every live engine and server; report each dirty one once."""
    from tests.test_server_harness import live_servers

    if _dirty_engines():
        # Only then pay for a full collection: a dropped engine caught in a reference cycle (say, through
        # a traceback) is garbage, not a leak, and must not be reported just because gc has not run yet.
        gc.collect()
    problems = []
    for engine, found in _dirty_engines():
        problems += found
        _engine_cores.discard(engine)
        _llm_engines.discard(engine)
    for server in live_servers():
        problems += server_leaks(server)
    return problems
