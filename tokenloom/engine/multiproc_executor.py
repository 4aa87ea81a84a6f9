"""MultiprocExecutor: tensor / pipeline-parallel ranks as worker processes on this node (vLLM's
v1/executor/multiproc_executor.py).

The executor starts `tensor_parallel_size x pipeline_parallel_size` workers
(tokenloom/engine/worker.py), each a fresh interpreter that connects back over an authenticated
localhost socket (multiprocessing.connection). Every step it sends the SchedulerOutput to every
worker (a broadcast over N pipes: the pickled SchedulerOutput is a few KB) and waits for every
worker's answer; the ModelRunnerOutput comes from the output rank (TP rank 0 of the last PP stage).

Threads: each rank gets its share of the cores. VLLM_CPU_OMP_THREADS_BIND (vLLM's variable) names
them per rank, '|' between ranks ("0-7|8-15"); "auto" (default) splits the usable cores evenly when
there are at least as many cores as ranks (one OpenMP thread per core, pinned), else leaves the
ranks unpinned with one thread each; "all" pins nothing and gives each rank cores / ranks threads.
OMP_NUM_THREADS, when the user set it, still decides the thread count.

Faults: a worker that exits (killed, crashed) or a connection that breaks fails the executor as a
whole: the pending step and every later one raise `ExecutorDeadError`, which the engine core does not
turn into a per-request error but lets through (the engine is dead: `LLM.generate` raises, the
server's engine-core process exits and `/health` answers 503), and the other workers are killed, so
nothing waits on a collective that will never complete. Waiting polls the workers' processes every
half second, so a death is seen within a second, never a hang.

Pipeline parallel runs one batch at a time (max_concurrent_batches 1; with --async-scheduling
tensor parallel keeps 2 in flight as the UniProcExecutor does): docs/parallelism.md says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from tokenloom import envs
from tokenloom.config import ConfigError
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.engine.executor import Executor, ExecutorDeadError
from tokenloom.engine.worker import WorkerInit, recv, send

logger = logging.getLogger(__name__)

_POLL_S = 0.5


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def rank_cpus(world_size: int, bind: str, usable: list[int]) -> tuple[list[list[int] | None], list[int]]:
    """Each rank's cores (None: unpinned) and OpenMP threads, from VLLM_CPU_OMP_THREADS_BIND."""
    if bind == "all":
        return [None] * world_size, [max(1, len(usable) // world_size)] * world_size
    if bind == "auto":
        if len(usable) < world_size:  # more ranks than cores: one thread each, the OS places them
            return [None] * world_size, [1] * world_size
        per = len(usable) // world_size
        cpus = [usable[i * per : (i + 1) * per] for i in range(world_size)]
        return list(cpus), [per] * world_size
    parts = bind.split("|")
    if len(parts) != world_size:
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} names {len(parts)} rank(s) for {world_size} ranks "
                          "(one core list per rank, separated by '|')")
    try:
        cpus = [parse_cpu_list(p) for p in parts]
    except ValueError:
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} is not a list of core ranges like 0-3|4-7") from None
    if any(not c for c in cpus):
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} gives a rank no core")
    return list(cpus), [len(c) for c in cpus]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, inits: list[WorkerInit], async_scheduling: bool = False, ready_timeout_s: float = 0.0) -> None:
        """`inits`: one WorkerInit per rank (their `rank`, `dist_init_method` and `cpus` are filled here)."""
        self.world_size = len(inits)
        self.output_rank = inits[0].output_rank
        self.pipeline_parallel_size = inits[0].pipeline_parallel_size
        self._dead: str | None = None
        self._drafts: Any = None
        self._lock = threading.Lock()  # one exchange with the workers at a time
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.worker_info: list[dict[str, Any]] = []
        usable = sorted(os.sched_getaffinity(0))
        cpus, threads = rank_cpus(self.world_size, envs.VLLM_CPU_OMP_THREADS_BIND, usable)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        try:
            for rank in range(self.world_size):
                # The rank's OpenMP threads, unless the user set them (then theirs win, as on one rank).
                omp = {} if envs.OMP_NUM_THREADS else {"OMP_NUM_THREADS": str(threads[rank])}
                env = envs.child_environment(**omp)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tokenloom.engine.worker", f"{host}:{port}", authkey.hex(), str(rank)],
                    env=env, stdin=subprocess.DEVNULL))
            by_rank = self._accept(listener)
            self.conns = [by_rank[r] for r in range(self.world_size)]
            for rank, (conn, init) in enumerate(zip(self.conns, inits)):
                init.rank, init.dist_init_method, init.cpus = rank, init_method, cpus[rank]
                send(conn, init)
            self.worker_info = self._gather(timeout_s=ready_timeout_s or None)
        except BaseException:
            self._kill_all()
            raise
        finally:
            listener.close()
        self.max_concurrent_batches = 2 if async_scheduling else 1
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-mp") if async_scheduling \
            else None
        logger.info("%d worker processes ready: %s", self.world_size,
                    ", ".join(f"rank {i['rank']} pid {i['pid']} {i['threads']} thread(s)" for i in self.worker_info))

    # ----------------------------------------------------------------- start-up

    def _accept(self, listener: Listener) -> dict[int, Connection]:
        """Every worker's connection, by rank; fails if a worker exits before connecting."""
        got: dict[int, Connection] = {}
        error: list[BaseException] = []

        def accept() -> None:
            try:
                while len(got) < self.world_size:
                    conn = listener.accept()
                    _, rank, _ = recv(conn)
                    got[rank] = conn
            except BaseException as exc:  # the listener closed under us: start-up failed elsewhere
                error.append(exc)

        t = threading.Thread(target=accept, name="tokenloom-mp-accept", daemon=True)
        t.start()
        while t.is_alive():
            t.join(_POLL_S)
            self._check_alive()
        if error and len(got) < self.world_size:
            raise RuntimeError(f"worker connections failed: {error[0]}")
        return got

    # ----------------------------------------------------------------- talking to the workers

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                self._fail(f"worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def _fail(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            logger.error("tensor/pipeline-parallel executor failed: %s; stopping the other workers", reason)
            self._kill_all()
        raise ExecutorDeadError(self._dead)

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for conn in self.conns:
            conn.close()

    def _gather(self, timeout_s: float | None = None) -> list[Any]:
        """Every worker's answer to the last message, by rank; an error answer raises RuntimeError
        (the step failed), a dead worker ExecutorDeadError (the engine is done)."""
        results: dict[int, Any] = {}
        errors: list[str] = []
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            for conn in wait(list(pending), timeout=_POLL_S):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    status, value = recv(conn)
                except (EOFError, OSError):
                    self._fail(f"worker rank {rank} closed its connection (it died)")
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append(value)
            if pending:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(f"worker rank(s) {sorted(pending.values())} did not answer within {timeout_s:.0f} s")
        if errors:
            raise RuntimeError("; ".join(errors))
        return [results[r] for r in range(self.world_size)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every worker (vLLM's collective_rpc); their results by rank."""
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        with self._lock:
            try:
                for conn in self.conns:
                    send(conn, (method, args))
            except (OSError, ValueError):
                self._check_alive()
                self._fail("a worker's connection broke")
            return self._gather()

    # ----------------------------------------------------------------- the Executor interface

    def _step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.monotonic()
        out, drafts = self.collective_rpc("execute_model", scheduler_output)[self.output_rank]
        self._drafts = drafts
        out.execute_start, out.execute_end = t0, time.monotonic()
        return out

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._thread is not None:
            queued = self._thread.submit(self._step, scheduler_output)
            return queued if non_block else queued.result()
        if not non_block:
            return self._step(scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self._step(scheduler_output))
        except ExecutorDeadError:
            raise
        except Exception as exc:
            future.set_exception(exc)
        return future

    def take_draft_token_ids(self) -> Any:
        drafts, self._drafts = self._drafts, None
        return drafts

    def reset(self) -> None:
        self.collective_rpc("reset")

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._dead is None:
            self._dead = "shut down"
            for conn in self.conns:  # each worker answers and exits; their exits are expected now
                with contextlib.suppress(OSError, ValueError):
                    send(conn, ("shutdown", ()))
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
