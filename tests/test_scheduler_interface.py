"""The engine core talks to its scheduler through SchedulerInterface (core/sched_interface.py, vLLM's
sched/interface.py) only: every attribute tokenloom/engine/core.py reads from a scheduler is one the interface
declares, and every scheduler class a configuration can get implements all of it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tokenloom.core.async_scheduler import AsyncScheduler
from tokenloom.core.sched_interface import SchedulerInterface
from tokenloom.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]


def declared(cls: type) -> set[str]:
    names = {n for n, _ in inspect.getmembers(cls, callable) if not n.startswith("_")}
    return names | set(getattr(cls, "__annotations__", {}))


def scheduler_reads(source: str) -> set[str]:
    """The attributes read from `self.scheduler` or a `scheduler` variable."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Attribute) and base.attr == "scheduler") or \
                    (isinstance(base, ast.Name) and base.id == "scheduler"):
                found.add(node.attr)
    return found


def test_the_engine_core_reads_only_what_the_interface_declares() -> None:
    reads = scheduler_reads((ROOT / "tokenloom" / "engine" / "core.py").read_text())
    assert {"schedule", "update_from_output", "add_request"} <= reads  # the reader sees the step's calls
    assert sorted(reads - declared(SchedulerInterface)) == []


def test_the_reader_catches_a_private_read() -> None:
    assert scheduler_reads("def f(self):\n    return len(self.scheduler.waiting)\n") == {"waiting"}


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_every_scheduler_class_implements_the_interface(cls) -> None:
    assert issubclass(cls, SchedulerInterface) and not inspect.isabstract(cls)
