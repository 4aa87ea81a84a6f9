"""How an engine-core process starts: spawned (a fresh interpreter), or forked from a forkserver that has
imported torch and tokenloom's engine once.

A spawned engine imports torch and tokenloom's model code before it can load a model: 2-3 s of CPU on a
2-core machine, paid again by every engine a process starts (a notebook or a test suite building engine
after engine, an RL loop restarting its engine). multiprocessing's forkserver pays it once: a single-threaded
process, started at the first engine, that imports those modules and then forks each engine from itself (no
torch threads exist there yet, no sockets, no model: a clean fork). `tokenloom serve` starts one engine (or
its data-parallel engines at once) per process, so it spawns, and its engine processes stay what `ps` and its
supervisor know (a child of the server, `spawn_main`).

The rule that keeps a forked engine the same as a spawned one: its first step takes the environment of the
process that started it, but what was read when the forkserver loaded its modules stays the forkserver's
(the interpreter's own variables; OpenMP's, oneDNN's and torch's; TOKENLOOM_CPU_ISA's caps and the OpenMP spin
set in tokenloom/__init__.py), as do the CPU affinity and where standard output and error go. So an engine is
forked only while those are what they were when the forkserver started (else the forkserver is restarted
with them, or the engine spawned while engines forked from it still run), and only from a forkserver this
module started. TOKENLOOM_ENGINE_START_METHOD overrides the choice.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import weakref
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from tokenloom import envs

logger = logging.getLogger(__name__)

# tokenloom first: it sets OpenMP's and oneDNN's variables before torch loads them (tokenloom/__init__.py).
FORKSERVER_PRELOAD = ["tokenloom", "torch", "tokenloom.engine.core_proc", "tokenloom.engine.core_host"]

# Variables read when the interpreter starts or a library loads (the forkserver has imported torch, and with it
# libgomp, oneDNN and MKL; tokenloom/__init__.py has set its own), by name prefix: a forked engine sees the
# forkserver's, so one of these changed means a new forkserver. Any other variable is read lazily, from the
# environment the engine takes from its starter.
LOAD_TIME_VARIABLES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH",
                       "PYTORCH_", "LRU_CACHE_CAPACITY", "MALLOC_", "TOKENLOOM_CPU_ISA", "CUDA_", "NVIDIA_")

# What this process's children inherited when its forkserver started (what_a_child_inherits); None until then.
_forkserver_started_with: tuple[object, ...] | None = None
# The engine processes forked from it (a WeakSet: a finished client's process is dropped with it).
_forked: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


def start_engine_process(target: Callable[..., None], args: tuple[Any, ...], name: str,
                         preferred: str = "forkserver") -> BaseProcess:
    """Start a daemon process running `target(*args)`, forked from the forkserver or spawned
    (engine_process_context)."""
    ctx = engine_process_context(preferred)
    if ctx.get_start_method() != "forkserver":
        return _start(ctx, target, args, name)
    try:  # the child takes this process's environment as it is now, not the forkserver's
        process = _start(ctx, _run_in_environment, (envs.child_environment(), target, *args), name)
    except OSError as exc:  # no forkserver here (its socket or pipe refused: a sandbox, no file descriptors)
        logger.warning("could not fork the engine from a forkserver (%s); spawning it", exc)
        return _start(mp.get_context("spawn"), target, args, name)
    _forked.add(process)
    return process


def main_module_rerun_hint() -> str:
    """What to tell the caller when an engine process died before it ran any of tokenloom's code: both start
    methods run the program's main script again in the child (multiprocessing's `prepare`), so a script that
    starts an engine at its top level starts one again there, and Python refuses that inside a child that is
    still starting ("bootstrapping phase"). vLLM's spawned processes need the same guard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return ""  # an interactive session: nothing is run again
    name = getattr(getattr(main, "__spec__", None), "name", None) or os.path.basename(path)
    return (f" before it reached tokenloom's code. The engine process runs {name} again as it starts: a program "
            'that starts an engine must do so under `if __name__ == "__main__":`')


def _start(ctx: BaseContext, target: Callable[..., None], args: tuple[Any, ...], name: str) -> BaseProcess:
    process = ctx.Process(target=target, args=args, name=name, daemon=True)
    process.start()
    return process


def _run_in_environment(environment: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """A forked engine's first step: the environment of the process that started it (what a spawned engine
    inherits), so the variables tokenloom and its libraries read from here on are that process's."""
    envs.set_environment(environment)
    target(*args)


def engine_process_context(preferred: str = "forkserver") -> BaseContext:
    """The multiprocessing context to start an engine-core process with: `preferred` ("forkserver" or
    "spawn") unless TOKENLOOM_ENGINE_START_METHOD says otherwise, and spawn whenever a fork could differ
    from a fresh interpreter (the module docstring). When what a child inherits has changed since the
    forkserver started and no engine forked from it is alive, the forkserver is restarted with the new state
    (a restart costs what one spawn does; an engine forked from a stopped forkserver would look dead to its
    client, multiprocessing learning a forked child's exit from the forkserver)."""
    global _forkserver_started_with
    chosen = envs.TOKENLOOM_ENGINE_START_METHOD
    method = preferred if chosen == "auto" else chosen
    if method == "spawn":
        return mp.get_context("spawn")
    now = what_a_child_inherits()
    if _forkserver_started_with is None and _forkserver_pid() is not None:
        logger.debug("a forkserver this module did not start is running: spawning the engine")
        return mp.get_context("spawn")
    if _forkserver_started_with is not None and now != _forkserver_started_with:
        stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
        if stop is None or any(p.is_alive() for p in _forked):
            logger.debug("what an engine inherits changed since the forkserver started: spawning the engine")
            return mp.get_context("spawn")
        logger.debug("what an engine inherits changed since the forkserver started: restarting it")
        stop()
        _forkserver_started_with = None
    ctx = mp.get_context("forkserver")
    if _forkserver_started_with is None:
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        _forkserver_started_with = now  # it starts, with this state, at the engine's Process.start()
    return ctx


def what_a_child_inherits() -> tuple[object, ...]:
    """What a forked engine would take from the forkserver instead of from the process that starts it: the
    variables libraries read when they load (LOAD_TIME_VARIABLES; the others the child takes from its
    starter, _run_in_environment), the CPU affinity, and the files standard output and error write to (a
    child's log lines go where the parent's would: a redirected stream, pytest's capture)."""
    streams = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            streams.append((st.st_dev, st.st_ino))
        except OSError:  # closed
            streams.append(None)
    load_time = {k: v for k, v in envs.child_environment().items() if k.startswith(LOAD_TIME_VARIABLES)}
    return load_time, frozenset(os.sched_getaffinity(0)), tuple(streams)


def _forkserver_pid() -> int | None:
    """The running forkserver's pid, None when none has started (multiprocessing's own record)."""
    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)
