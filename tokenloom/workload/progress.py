"""Progress lines for long runs (`bench serve|throughput|sweep`, `simulate`, `profile`): a user whose
output goes to a file or a pipe is not left with minutes of silence.

One line to stderr at most every `every_s` seconds, and one at the end if any was printed:

    bench throughput continuous: 40/128 requests done, 5120 output tokens, 12.1 s

The engine and simulator runs print them on a terminal too. `bench serve` keeps its tqdm bar on a
terminal and prints these lines instead elsewhere (tqdm's carriage returns make one unreadable line
in a log file).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

PROGRESS_EVERY_S = 10.0


class Progress:
    def __init__(self, label: str, total: int, *, unit: str = "requests", every_s: float | None = None,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.stream = stream
        self.clock = clock
        self.start = self.last = clock()
        self.done = 0
        self.tokens: int | None = None
        self.lines = 0

    def update(self, n: int = 1, *, done: int | None = None, tokens: int | None = None) -> None:
        """`n` more units done (or `done` in all); `tokens`: output tokens so far, when known."""
        self.done = done if done is not None else self.done + n
        if tokens is not None:
            self.tokens = tokens
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self._print(now)

    def close(self) -> None:
        if self.lines:  # a run short enough to print nothing along the way stays silent at the end too
            self._print(self.clock())

    def _print(self, now: float) -> None:
        self.lines += 1
        tokens = f", {self.tokens} output tokens" if self.tokens is not None else ""
        print(f"{self.label}: {self.done}/{self.total} {self.unit} done{tokens}, {now - self.start:.1f} s",
              file=self.stream or sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
