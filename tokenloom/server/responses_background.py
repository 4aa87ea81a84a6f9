"""Background responses (`background: true`), as vLLM 0.32 runs them (responses/serving.py: the response is
stored `queued` and returned at once, the generation runs in a task of the server, the final response replaces the
stored one unless it was cancelled meanwhile; a streamed one keeps its events for GET ?stream=true, vLLM's
event_store, replayed from `starting_after`).

The runs are held here by response id until their task ends (the event loop keeps only weak references to tasks);
their events live with the stored response (response_store.py), so they are as bounded as the store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


class EventLog:
    """The SSE frames of a streamed background response, in order (a frame's index is its sequence_number)."""

    def __init__(self) -> None:
        self.frames: list[str] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, frame: str) -> None:
        self.frames.append(frame)
        self._changed.set()

    def close(self) -> None:
        """No frame comes after this (the run ended, was cancelled or failed)."""
        self.closed = True
        self._changed.set()

    async def replay(self, starting_after: int | None = None) -> AsyncIterator[str]:
        """The frames after sequence number `starting_after` (all: None), then each new one until the log closes."""
        index = 0 if starting_after is None else starting_after + 1
        while True:
            self._changed.clear()
            while index < len(self.frames):
                yield self.frames[index]
                index += 1
            if self.closed:
                return
            await self._changed.wait()


class BackgroundRuns:
    """The background responses being generated, by response id."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    def start(self, response_id: str, work: Coroutine[Any, Any, Any], end: Callable[[], None]) -> None:
        """Run `work`; `end` runs after it however it ends, even when cancelled before it started (a coroutine
        cancelled then never runs its own `finally`)."""
        task = asyncio.create_task(work, name=f"background-{response_id}")
        self._tasks[response_id] = task

        def ended(_: asyncio.Task[Any]) -> None:
            self._tasks.pop(response_id, None)
            end()

        task.add_done_callback(ended)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> None:
        """Stop a run (its engine request is aborted as its task unwinds); nothing if it already ended."""
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    async def cancel_all(self) -> None:
        """At shutdown: every run stopped before the engine goes."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if tasks:
                await asyncio.wait(tasks)
