"""Clocks for driving a workload: virtual seconds for the simulator, wall seconds for the real engine.

Both are callables the scheduler reads (like time.monotonic), with `wait_until(t)`: what the driver
does when nothing is in flight and the next request arrives at t.
"""

from __future__ import annotations

import time


class VirtualClock:
    """Simulated seconds; the SimulatedRunner advances it by each step's modelled time."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def wait_until(self, t: float) -> None:
        """Idle until t: jump (never backwards)."""
        if t > self.now:
            self.now = t


class WallClock:
    """Seconds since construction (perf_counter); waiting really sleeps."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        delay = t - self()
        if delay > 0:
            time.sleep(delay)
