"""The API process's wait for its engine (issue 32 items 6 and 9): as long as the engine makes progress,
never a fixed deadline that a busy machine overruns. Fake clock, no engine process: fast and timing-free."""

from __future__ import annotations

import logging
import multiprocessing as mp

import pytest

from tokenloom import envs
from tokenloom.engine import core_client
from tokenloom.engine.core_client import MPClient
from tokenloom.engine.core_messages import EngineProgress, EngineReady
from tokenloom.engine.core_proc import LoadHeartbeat, process_tree_cpu_s
from tokenloom.engine.exceptions import EngineStartError


class _Alive:
    """A Process stand-in that never exits."""

    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        pass

    def kill(self) -> None:
        pass


def _ready() -> EngineReady:
    return EngineReady(model_name="m", max_model_len=64, num_blocks=8, block_size=16, eos_token_id=2,
                       vocab_size=320, dtype="float32", device="cpu", load_time_s=1.0)


@pytest.fixture
def fake_clock(monkeypatch):
    """Every reading of the wait's clock is one second later than the last."""
    t = [0.0]

    def now() -> float:
        t[0] += 1.0
        return t[0]

    monkeypatch.setattr(core_client, "_now", now)
    return t


def _client(messages: list) -> MPClient:
    from_engine, engine_outbox = mp.Pipe(duplex=False)
    to_engine, _ = mp.Pipe(duplex=False)
    for m in messages:
        engine_outbox.send(m)
    client = MPClient(None, connections=(_Alive(), to_engine, from_engine))
    client._keep = engine_outbox  # the engine's end stays open: no EOF
    return client


def test_a_load_longer_than_the_timeout_succeeds_while_it_makes_progress(fake_clock) -> None:
    """Before: 'the engine was not ready after 5 s' at the fixed deadline, however busy the engine was."""
    beats = [EngineProgress(cpu_s=0.5 * i, stage="loading weights") for i in range(1, 40)]
    client = _client([*beats, _ready()])
    try:
        ready = client.wait_ready(timeout_s=5)
    finally:
        client.shutdown(0.1)
    assert ready.model_name == "m"
    assert fake_clock[0] > 5 * 5  # the wait lasted far longer than the timeout


def test_a_new_log_line_is_progress_too(fake_clock) -> None:
    beats = [EngineProgress(cpu_s=1.0, stage=f"stage {i}") for i in range(30)]
    client = _client([*beats, _ready()])
    try:
        assert client.wait_ready(timeout_s=5).model_name == "m"
    finally:
        client.shutdown(0.1)


def test_an_engine_that_stops_moving_fails_after_the_timeout(fake_clock) -> None:
    beats = [EngineProgress(cpu_s=2.0, stage="building kernels")] * 40  # alive, but nothing moves
    client = _client([*beats, _ready()])
    try:
        # vLLM's words first (its tests/v1/shutdown/test_startup_error.py matches "initialization fail(ed|ure)").
        with pytest.raises(EngineStartError, match=r"^Engine core initialization failed: the engine made no progress "
                                                   r"for 5 s .*last: building kernels.*TOKENLOOM_ENGINE_READY_TIMEOUT"):
            client.wait_ready(timeout_s=5)
    finally:
        client.shutdown(0.1)


def test_the_timeout_comes_from_the_environment(fake_clock, monkeypatch) -> None:
    assert envs.TOKENLOOM_ENGINE_READY_TIMEOUT == 600.0
    monkeypatch.setenv("TOKENLOOM_ENGINE_READY_TIMEOUT", "3")
    assert envs.TOKENLOOM_ENGINE_READY_TIMEOUT == 3.0
    client = _client([])
    try:
        with pytest.raises(EngineStartError, match="no progress for 3 s"):
            client.wait_ready()
    finally:
        client.shutdown(0.1)
    monkeypatch.setenv("TOKENLOOM_ENGINE_READY_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TOKENLOOM_ENGINE_READY_TIMEOUT"):
        _ = envs.TOKENLOOM_ENGINE_READY_TIMEOUT


def test_the_engine_side_heartbeat_reports_cpu_and_the_last_log_line() -> None:
    from_engine, outbox = mp.Pipe(duplex=False)
    heartbeat = LoadHeartbeat(outbox, interval_s=0.01)
    logging.getLogger("tokenloom.test").warning("compiling the CPU kernels")
    cpu0 = process_tree_cpu_s()
    while process_tree_cpu_s() <= cpu0:  # CPU time moves in clock ticks (10 ms): spend until it does
        sum(i * i for i in range(100_000))
    beats = []
    while len(beats) < 2 or beats[-1].stage != "compiling the CPU kernels":
        assert from_engine.poll(60)
        beats.append(from_engine.recv())
    heartbeat.stop()
    assert all(isinstance(b, EngineProgress) for b in beats)
    assert beats[-1].cpu_s >= beats[0].cpu_s > 0
    assert heartbeat not in logging.getLogger().handlers
    assert not heartbeat._thread.is_alive()  # stopped before EngineReady is sent: one writer on the pipe
