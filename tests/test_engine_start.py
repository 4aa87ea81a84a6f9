"""How engine-core processes start (tokenloom/engine/process_start.py): forked from a forkserver that has
imported torch once while nothing a child inherits has changed, spawned otherwise, and the same tokens
either way."""

from __future__ import annotations

import asyncio
import os
from multiprocessing import forkserver
from pathlib import Path

import pytest

from tokenloom.engine import process_start
from tokenloom.engine.args import AsyncEngineArgs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.sampling_params import SamplingParams


class _Alive:
    def is_alive(self) -> bool:
        return True


@pytest.fixture
def fresh_forkserver_record(monkeypatch):
    """The module as in a process that has not started a forkserver; multiprocessing's own is left alone
    (its stop recorded instead of done). Yields the list of stops."""
    monkeypatch.setattr(process_start, "_forkserver_started_with", None)
    monkeypatch.setattr(process_start, "_forkserver_pid", lambda: None)
    monkeypatch.setattr(process_start, "_forked", set())
    server = forkserver._forkserver
    stops: list[bool] = []
    monkeypatch.setattr(server, "_stop", lambda: stops.append(True))
    preload = server._preload_modules
    yield stops
    server.set_forkserver_preload(preload)


def test_the_choice(fresh_forkserver_record, monkeypatch) -> None:
    monkeypatch.delenv("TOKENLOOM_ENGINE_START_METHOD", raising=False)
    assert process_start.engine_process_context("spawn").get_start_method() == "spawn"  # tokenloom serve's
    first = process_start.engine_process_context()
    assert first.get_start_method() == "forkserver"
    assert forkserver._forkserver._preload_modules[0] == "tokenloom"  # before torch
    assert process_start.engine_process_context().get_start_method() == "forkserver"
    # What a forked engine would not see: a variable set (or changed) since the forkserver started. While an
    # engine forked from it runs, the next one is spawned; once none is, the forkserver restarts with it.
    stops = fresh_forkserver_record
    process_start._forked.add(_Alive())
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert process_start.engine_process_context().get_start_method() == "spawn" and not stops
    process_start._forked.clear()
    assert process_start.engine_process_context().get_start_method() == "forkserver" and stops == [True]
    assert process_start.engine_process_context().get_start_method() == "forkserver" and stops == [True]
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert process_start.engine_process_context().get_start_method() == "forkserver" and stops == [True, True]
    # A variable read lazily (every TOKENLOOM_* but the ISA cap) travels with the engine instead.
    monkeypatch.setenv("TOKENLOOM_GGUF_PREFETCH", "none")
    assert process_start.engine_process_context().get_start_method() == "forkserver" and stops == [True, True]
    monkeypatch.setenv("TOKENLOOM_ENGINE_START_METHOD", "spawn")
    assert process_start.engine_process_context().get_start_method() == "spawn"
    monkeypatch.setenv("TOKENLOOM_ENGINE_START_METHOD", "fork")
    with pytest.raises(ValueError, match="TOKENLOOM_ENGINE_START_METHOD must be one of auto, spawn, forkserver"):
        process_start.engine_process_context()


def test_another_forkserver_already_running_means_spawn(fresh_forkserver_record, monkeypatch) -> None:
    monkeypatch.delenv("TOKENLOOM_ENGINE_START_METHOD", raising=False)
    monkeypatch.setattr(process_start, "_forkserver_pid", lambda: 12345)
    assert process_start.engine_process_context().get_start_method() == "spawn"


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def _greedy_and_parent() -> tuple[str, int]:
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(max_model_len=256))
    try:
        parent = _parent_of(engine.client.process.pid)
        text = ""
        async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0),
                                         request_id="r"):
            text = out.outputs[0].text
        return text, parent
    finally:
        engine.shutdown()


def test_forked_and_spawned_engines_give_the_same_tokens(monkeypatch) -> None:
    monkeypatch.delenv("TOKENLOOM_ENGINE_START_METHOD", raising=False)
    forked_text, forked_parent = asyncio.run(_greedy_and_parent())
    again_text, again_parent = asyncio.run(_greedy_and_parent())
    assert forked_parent != os.getpid() and again_parent == forked_parent  # one forkserver, both times
    monkeypatch.setenv("TOKENLOOM_ENGINE_START_METHOD", "spawn")
    spawned_text, spawned_parent = asyncio.run(_greedy_and_parent())
    assert spawned_parent == os.getpid()
    assert forked_text == again_text == spawned_text and forked_text


def _write_variable(path: str, name: str) -> None:
    Path(path).write_text(os.environ.get(name, "<unset>"))


def test_a_forked_engine_takes_its_starters_environment(monkeypatch, tmp_path) -> None:
    """Set after the forkserver started (pytest sets PYTEST_CURRENT_TEST per test, tests set TOKENLOOM_*),
    a variable reaches the forked process as it would a spawned one."""
    monkeypatch.delenv("TOKENLOOM_ENGINE_START_METHOD", raising=False)
    asyncio.run(_greedy_and_parent())  # the forkserver runs
    monkeypatch.setenv("TOKENLOOM_PROBE_VARIABLE", "set-after-the-forkserver-started")
    out = tmp_path / "seen"
    process = process_start.start_engine_process(_write_variable, (str(out), "TOKENLOOM_PROBE_VARIABLE"), "probe")
    process.join(60)
    assert process in process_start._forked and process.exitcode == 0  # forked, and it ran
    assert out.read_text() == "set-after-the-forkserver-started"



def test_where_no_forkserver_can_start_the_engine_is_spawned(fresh_forkserver_record, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TOKENLOOM_ENGINE_START_METHOD", raising=False)
    real_start = process_start._start

    def start(ctx, target, args, name):
        if ctx.get_start_method() == "forkserver":
            raise OSError("no sockets in this sandbox")
        return real_start(ctx, target, args, name)

    monkeypatch.setattr(process_start, "_start", start)
    monkeypatch.setenv("TOKENLOOM_PROBE_VARIABLE", "spawned")
    out = tmp_path / "seen"
    process = process_start.start_engine_process(_write_variable, (str(out), "TOKENLOOM_PROBE_VARIABLE"), "probe")
    process.join(60)
    assert process not in process_start._forked and process.exitcode == 0 and out.read_text() == "spawned"


def test_a_script_that_starts_an_engine_unguarded_is_told_why_it_failed(tmp_path) -> None:
    """Both start methods (forkserver here, the default) run the main script again in the engine process; a
    script that starts its engine at the top level (no `if __name__ == "__main__":`) then starts one inside a
    child that is still starting, which Python refuses. The caller's error said only 'exited during start-up
    (exit code 1)'; it now says why and what to do. The same script with the guard runs."""
    import subprocess
    import sys

    body = ("from tokenloom import AsyncEngineArgs, AsyncLLM\n"
            "{indent}engine = AsyncLLM.from_engine_args(AsyncEngineArgs(max_model_len=64))\n"
            "{indent}engine.shutdown()\n"
            "{indent}print('started')\n")
    env = {**os.environ, "TOKENLOOM_ENGINE_START_METHOD": "forkserver"}
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(body.format(indent=""))
    run = subprocess.run([sys.executable, str(unguarded)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode != 0 and "started" not in run.stdout
    assert 'unguarded.py again as it starts: a program that starts an engine must do so under `if __name__ == ' \
        '"__main__":`' in run.stderr, run.stderr[-3000:]
    guarded = tmp_path / "guarded.py"
    guarded.write_text("if __name__ == '__main__':\n" + body.format(indent="    ").replace("from", "    from", 1))
    run = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "started" in run.stdout, run.stderr[-3000:]
