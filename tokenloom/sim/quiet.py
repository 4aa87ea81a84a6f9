"""Is anything else using the CPU? Profiling waits until it is not.

On a 2-core machine, torch's two threads slow down several times over (up to 50x measured here) as
soon as a third process competes, because they wait for each other at every op. Timings taken then
describe the neighbours, not the model. /proc/stat counts all CPUs; the profiler sleeps while it
samples, so what it sees busy is other work. Off Linux, it cannot tell and does not wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

_STAT = Path("/proc/stat")


def cpu_times() -> tuple[int, int] | None:
    """(busy, idle) clock ticks of all CPUs since boot."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values[:8]) - idle, idle


def others_busy(interval: float = 0.3) -> float | None:
    """Fraction of all CPUs busy during `interval` seconds while this process sleeps (None: unknown)."""
    before = cpu_times()
    time.sleep(interval)
    after = cpu_times()
    if before is None or after is None:
        return None
    busy, idle = after[0] - before[0], after[1] - before[1]
    return busy / (busy + idle) if busy + idle > 0 else 0.0


def wait_for_quiet(max_wait_s: float, threshold: float = 0.1,
                   on_busy: Callable[[float], None] | None = None) -> bool:
    """Block until the CPUs are (nearly) idle twice in a row, or max_wait_s passes. True when quiet.
    `on_busy(fraction)`: called once, when the first look finds the CPUs busy (a wait is coming)."""
    deadline = time.monotonic() + max_wait_s
    calm = 0
    first = True
    while True:
        busy = others_busy()
        if busy is None:
            return True
        if first and busy > threshold and on_busy is not None:
            on_busy(busy)
        first = False
        calm = calm + 1 if busy <= threshold else 0
        if calm >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
