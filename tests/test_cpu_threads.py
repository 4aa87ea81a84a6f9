"""The model's OpenMP thread count: every usable core less vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU."""

from __future__ import annotations

import os

import pytest
import torch

from tokenloom.config import ConfigError
from tokenloom.model.platform import RESERVED_CPU_ENV, configure_cpu_threads, model_threads, reserved_cpus


@pytest.fixture
def torch_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_unset_reserves_nothing(monkeypatch):
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    assert reserved_cpus() == 0
    assert model_threads(8) == 8


def test_reserved_cores_leave_the_team(monkeypatch):
    monkeypatch.setenv(RESERVED_CPU_ENV, "2")
    assert model_threads(8) == 6
    assert model_threads(3) == 1


@pytest.mark.parametrize("value, message", [("one", "whole number"), ("-1", "0 or more"), ("1.5", "whole number")])
def test_bad_values_are_refused(monkeypatch, value, message):
    monkeypatch.setenv(RESERVED_CPU_ENV, value)
    with pytest.raises(ValueError, match=message):
        model_threads(4)


def test_reserving_every_core_is_refused(monkeypatch):
    monkeypatch.setenv(RESERVED_CPU_ENV, "4")
    with pytest.raises(ValueError, match="leaves no core for the model: this process may use 4"):
        model_threads(4)


def test_configure_cpu_threads_applies_the_reservation(monkeypatch, torch_threads):
    """Three usable cores, whatever this process may use (make test pins each xdist worker to one core)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    usable = 3
    monkeypatch.setenv(RESERVED_CPU_ENV, "1")
    configure_cpu_threads()
    assert torch.get_num_threads() == usable - 1
    monkeypatch.setenv(RESERVED_CPU_ENV, "0")
    configure_cpu_threads()
    assert torch.get_num_threads() == usable


def test_omp_num_threads_wins(monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(RESERVED_CPU_ENV, "999")  # ignored, as OMP_NUM_THREADS decides
    torch.set_num_threads(1)
    configure_cpu_threads()
    assert torch.get_num_threads() == 1


def test_engine_refuses_a_bad_value_before_loading(monkeypatch):
    from tokenloom.engine.llm_engine import LLMEngine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(RESERVED_CPU_ENV, str(len(os.sched_getaffinity(0))))
    with pytest.raises(ConfigError, match=RESERVED_CPU_ENV):
        LLMEngine.from_args()
