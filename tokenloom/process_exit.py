"""Leaving a process without the interpreter's teardown.

A process that has imported torch spends 0.5-1.5 s (more on a busy machine) in Python's finalization after
its last line: every module's globals cleared, torch's libraries unloaded, garbage collected. Nobody needs
that work once a command is done: `tokenloom serve` stopped by Ctrl-C or SIGTERM, and the engine process
its API process waits for at every shutdown, would each keep the caller waiting for it. What finalization
does that matters is kept: non-daemon threads are waited for (by falling back to a normal exit), the atexit
callbacks run (multiprocessing's children and finalizers, weakref.finalize, logging's flush, temporary
directories), and standard output and error are flushed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with `code` as `sys.exit(code)` would, minus the module teardown."""
    main = threading.main_thread()
    if threading.current_thread() is not main or any(
        t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main
    ):
        sys.exit(code)  # a thread the normal exit would wait for (or not the main thread): exit normally
    atexit._run_exitfuncs()  # what the interpreter runs at exit, in the same order (last registered first)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # closed, replaced or detached
            stream.flush()
    os._exit(code)
