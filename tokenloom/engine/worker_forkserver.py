"""The tensor / pipeline-parallel ranks' forkserver: an interpreter that imports torch and tokenloom's worker code
once, then forks ranks from itself, for every executor the process that started it builds.

A rank started as its own interpreter imports torch and the model code before it reads a weight: ~2.7 s of CPU
a rank, paid by every rank of every executor (TP 3 of a 135M model on 2 cores: engine ready in 4-5 s, most of it
three imports side by side; a notebook or a test suite building TP engine after engine pays it each time).
multiprocessing's forkserver would pay it once, but an engine core that is itself a daemon process (the
server's, a data-parallel replica) may not start multiprocessing children, and the engine's own forkserver
(process_start.py) runs engines, not ranks. So the first MultiprocExecutor of a process starts this module with
subprocess (`python -m tokenloom.engine.worker_forkserver`), as it started each rank before, and every executor
of that process asks it for ranks: one JSON line per rank on its standard input; it answers `started ID PID` as
it forks each and `exited ID CODE` (Popen's returncode: -N for signal N) as each ends, on its standard output.
When its standard input closes (the process that started it is gone, or retired it) it exits after its last rank.

A forked rank is what a spawned one was. The forkserver is single-threaded Python with no OpenMP team, socket or
model when it forks (importing torch runs no parallel region). The rank takes the environment and working
directory its executor has now (envs.set_environment), sets its own OpenMP thread count (torch.set_num_threads:
libgomp read OMP_NUM_THREADS when the forkserver loaded torch) and its CPU affinity before its first parallel
region (worker.serve). What was read when the forkserver loaded its modules stays the forkserver's (the
variables libraries read at load, the CPU affinity, where standard error goes), so a forkserver serves only
while those are what they were when it started (process_start.what_a_child_inherits, the engines' rule); else a
new one starts and the old one exits after its ranks. The reports have a pipe of their own: the forkserver's and
its ranks' standard output is their standard error, so that nothing printed mixes into them; a rank's standard
input is /dev/null.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any

from tokenloom import envs

# tokenloom first: it sets OpenMP's and oneDNN's variables before torch loads them (tokenloom/__init__.py);
# then what a rank imports before it loads its cut (worker.Worker).
PRELOAD = ("tokenloom", "torch", "tokenloom.engine.worker", "tokenloom.distributed.parallel_state",
           "tokenloom.model.loader", "tokenloom.model.tp_shard", "tokenloom.model.runner")

# How often the forkserver looks for ranks that ended while no request comes in.
_REAP_S = 0.2


class ForkedRank:
    """A rank forked by the forkserver, as the executor uses a subprocess.Popen: pid, poll, kill, wait. Its exit
    code is the one the forkserver reported (the forkserver is its parent, the only process that can reap it)."""

    def __init__(self, server: WorkerForkserver, request_id: int, rank: int, pid: int) -> None:
        self.server, self.request_id, self.rank, self.pid = server, request_id, rank, pid

    def poll(self) -> int | None:
        return self.server.exit_code(self)

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.wait_exit(self, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.rank} (pid {self.pid})", timeout or 0.0)
        return code


class WorkerForkserver:
    """The executors' side: the forkserver process, the ranks asked of it and their exits."""

    def __init__(self, inherits: tuple[object, ...]) -> None:
        self.inherits = inherits  # what its ranks take from it (process_start.what_a_child_inherits)
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenloom.engine.worker_forkserver"],
                                     env=envs.child_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self._ids = itertools.count()
        self._write_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # request id -> exit code
        self._eof = False  # its output ended: it exited (or was killed)
        threading.Thread(target=self._read, name="tokenloom-rank-forkserver", daemon=True).start()

    def alive(self) -> bool:
        return not self._eof and self.proc.poll() is None

    def fork_ranks(self, ranks: list[dict[str, Any]]) -> list[ForkedRank]:
        """Fork one rank per entry ({"address", "authkey", "rank", "omp_threads"}: worker.main's arguments and the
        rank's OpenMP threads, None to keep the environment's); returns once every rank has a pid, or raises
        RuntimeError if the forkserver exits first (its imports failed: the error is on standard error)."""
        requests = [{**entry, "id": next(self._ids), "env": envs.child_environment(), "cwd": os.getcwd()}
                    for entry in ranks]
        assert self.proc.stdin is not None
        try:
            with self._write_lock:
                for request in requests:
                    self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
        except (OSError, ValueError):  # it died (or was retired) before reading them: reported below
            pass
        wanted = [r["id"] for r in requests]
        with self._cond:
            self._cond.wait_for(lambda: self._eof or all(i in self._pids for i in wanted))
            pids = {i: self._pids.get(i) for i in wanted}
        handles = [ForkedRank(self, r["id"], r["rank"], pids[r["id"]]) for r in requests if pids[r["id"]] is not None]
        if len(handles) < len(requests):
            for handle in handles:
                handle.kill()
            raise RuntimeError(f"the tensor/pipeline-parallel workers' forkserver exited with code "
                               f"{self.proc.wait()} before starting every rank (its error is on standard error)")
        return handles

    def exit_code(self, rank: ForkedRank) -> int | None:
        with self._cond:
            if rank.request_id in self._exits:
                return self._exits[rank.request_id]
            if not self._eof:
                return None
        # The forkserver is gone without a report (killed): the rank, orphaned, is reaped by init once it ends.
        try:
            os.kill(rank.pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        return None

    def wait_exit(self, rank: ForkedRank, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: rank.request_id in self._exits or self._eof, timeout)
        return self.exit_code(rank)

    def retire(self) -> None:
        """No more ranks from it: it exits once the ones it forked have (the reader reaps it)."""
        with self._write_lock, contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.proc.stdout:
                what, request_id, value = line.split()
                with self._cond:
                    (self._pids if what == "started" else self._exits)[int(request_id)] = int(value)
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()
        self.proc.wait()  # reaped here, whoever retired it


_lock = threading.Lock()
_current: WorkerForkserver | None = None


def forkserver() -> WorkerForkserver:
    """This process's ranks' forkserver: the running one while what its ranks would inherit from it is what they
    would inherit from this process now, else a new one (the old one retired)."""
    global _current
    from tokenloom.engine.process_start import what_a_child_inherits

    inherits = what_a_child_inherits()
    with _lock:
        if _current is not None and (not _current.alive() or _current.inherits != inherits):
            _current.retire()
            _current = None
        if _current is None:
            _current = WorkerForkserver(inherits)
        return _current


# ----------------------------------------------------------------- the forkserver process


# Where the reports go: the pipe that was standard output, which itself becomes standard error (main), so that
# nothing a library prints reaches the executor's reader.
_reports: Any = None


def _report(line: str) -> None:
    try:
        _reports.write(line + "\n")
        _reports.flush()
    except OSError:  # the process that started it is gone; its ranks see their connections close and exit
        pass


def _run_rank(request: dict[str, Any]) -> None:
    """In the forked child: become the rank (worker.main) and exit with its code; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(_reports.fileno())  # the executor's reader sees the end of the reports when the forkserver ends
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        threads = request.get("omp_threads")
        # The rank's threads also in its environment: what its thread planning reads (platform.py, via envs).
        envs.set_environment({**request["env"], **({"OMP_NUM_THREADS": str(threads)} if threads else {})})
        os.chdir(request["cwd"])
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        from tokenloom.engine.worker import main

        code = main([request["address"], request["authkey"], str(request["rank"])])
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, int], block: bool) -> None:
    """Report the ranks that ended (all of them, waiting, when `block`)."""
    while children:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        if pid in children:
            _report(f"exited {children.pop(pid)} {os.waitstatus_to_exitcode(status)}")


def main() -> int:
    import importlib

    # Ctrl-C reaches the whole process group: the ranks stop on it (as spawned ones did) and the forkserver
    # stays to reap them and report their exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _reports
    _reports = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    children: dict[int, int] = {}  # pid -> request id
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], _REAP_S)
        _reap(children, block=False)
        if not readable:
            continue
        data = os.read(stdin, 1 << 16)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_rank(request)
            children[pid] = request["id"]
            _report(f"started {request['id']} {pid}")
    _reap(children, block=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
