"""MultiprocExecutor: tensor / pipeline-parallel ranks as worker processes on this node (vLLM's
v1/executor/multiproc_executor.py); the RayExecutor (ray_executor.py) places the same ranks as Ray actors.

The executor starts `tensor_parallel_size x pipeline_parallel_size` workers
(tokenloom/engine/worker.py), forked from an interpreter that imported torch and the worker code once, this
process's ranks' forkserver (tokenloom/engine/worker_forkserver.py); each connects back over an
authenticated localhost socket (multiprocessing.connection). Every step it sends the SchedulerOutput to every
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

Steps in flight: `max_concurrent_batches` is the number of pipeline stages (vLLM's: the engine core's
batch queue keeps one micro-batch per stage), else 2 with --async-scheduling, else 1. A step is sent to
every worker when it is scheduled; the answers are gathered in send order on one thread (the step's
future), reading any worker's answer as soon as it is there, so a stage that is ahead is never held up.
Under PP the earlier stages get the last stage's sampled tokens with the next step sent to them
(docs/parallelism.md "Pipeline parallel").
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from tokenloom import envs
from tokenloom.config import ConfigError
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.engine.executor import Executor, ExecutorDeadError
from tokenloom.engine.worker import WorkerInit, recv, send
from tokenloom.engine.worker_forkserver import forkserver

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


class MultiprocExecutor(Executor):
    """Ranks as worker processes on this node. Subclasses place them elsewhere (RayExecutor: Ray actors
    on the cluster's nodes) by overriding `listen_host`, `_launch` and `_rank_cpus`."""

    # Where the workers connect back to: this node only.
    listen_host = "127.0.0.1"

    def __init__(self, inits: list[WorkerInit], async_scheduling: bool = False, ready_timeout_s: float = 0.0) -> None:
        """`inits`: one WorkerInit per rank (their `rank`, `dist_init_method`, `cpus` and `same_node` are
        filled here)."""
        self.world_size = len(inits)
        self.output_rank = inits[0].output_rank
        self.pipeline_parallel_size = inits[0].pipeline_parallel_size
        self.tensor_parallel_size = inits[0].tensor_parallel_size
        self.async_scheduling = async_scheduling
        self._dead: str | None = None
        self._drafts: Any = None
        self._send_lock = threading.Lock()  # a message to every worker, and its gather queued, as one
        self.procs: list[Any] = []  # worker_forkserver.ForkedRank, or anything with pid / poll / kill / wait
        self.conns: list[Connection] = []
        self.worker_info: list[dict[str, Any]] = []
        # Answers read but not yet gathered, per rank, with the wait round they arrived in: a rank that
        # is ahead (an early pipeline stage) answers later steps before the last stage answers this one.
        self._answers: list[deque[tuple[int, Any]]] = []
        self._round = 0
        # What each message sent and not gathered yet was: a step's scheduled tokens, or None (a call).
        self._sent: deque[int | None] = deque()
        self._num_steps = 0
        # Pipeline parallel: tokens the last stage sampled that the earlier stages have not received.
        self._tokens_lock = threading.Lock()
        self._pipeline_tokens: list[tuple[int, dict[str, list[int]]]] = []
        # Counted, not timed: steps handed to the workers while others were still running, and steps
        # whose first stage finished before the last stage finished the step before (two micro-batches
        # in the pipe at once).
        self.max_steps_in_flight = 0
        self.pipeline_overlaps = 0
        authkey = secrets.token_bytes(16)
        listener = Listener((self.listen_host, 0), authkey=authkey)
        host, port = listener.address
        try:
            self.procs = self._launch(host, port, authkey)
            by_rank = self._accept(listener)
            self.conns = [by_rank[r][0] for r in range(self.world_size)]
            nodes = {by_rank[r][1] for r in range(self.world_size)}
            _, _, rank0_ip, rank0_port = by_rank[0]
            init_method = f"tcp://{rank0_ip}:{rank0_port}"  # rank 0 hosts the gloo rendezvous
            cpus = self._rank_cpus()
            for rank, (conn, init) in enumerate(zip(self.conns, inits)):
                init.rank, init.dist_init_method, init.cpus = rank, init_method, cpus[rank]
                init.same_node = len(nodes) == 1
                send(conn, init)
            self._answers = [deque() for _ in self.conns]
            self.worker_info = [v for _, v in self._gather(timeout_s=ready_timeout_s or None)]
        except BaseException:
            self._kill_all()
            raise
        finally:
            listener.close()
        # vLLM's max_concurrent_batches: the pipeline's depth (one micro-batch per stage), else 2 with
        # async scheduling (the next step scheduled while this one runs), else 1.
        if self.pipeline_parallel_size > 1:
            self.max_concurrent_batches = self.pipeline_parallel_size
        else:
            self.max_concurrent_batches = 2 if async_scheduling else 1
        # Gathers run on one thread, in the order the messages went out (every worker answers in order).
        self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-mp-gather")
        logger.info("%d worker processes ready: %s", self.world_size,
                    ", ".join(f"rank {i['rank']} pid {i['pid']} {i['threads']} thread(s)" for i in self.worker_info))

    # ----------------------------------------------------------------- start-up

    def _rank_cpus(self) -> list[list[int] | None]:
        cpus, _ = rank_cpus(self.world_size, envs.VLLM_CPU_OMP_THREADS_BIND, sorted(os.sched_getaffinity(0)))
        return cpus

    def _launch(self, host: str, port: int, authkey: bytes) -> list[Any]:
        """Fork one worker per rank, from the ranks' forkserver, that connects back to host:port; their process
        handles."""
        _, threads = rank_cpus(self.world_size, envs.VLLM_CPU_OMP_THREADS_BIND, sorted(os.sched_getaffinity(0)))
        # Each rank's OpenMP threads, unless the user set them (then theirs win, as on one rank).
        return forkserver().fork_ranks([
            {"address": f"{host}:{port}", "authkey": authkey.hex(), "rank": rank,
             "omp_threads": None if envs.OMP_NUM_THREADS else threads[rank]} for rank in range(self.world_size)])

    def _accept(self, listener: Listener) -> dict[int, tuple[Connection, str, str, int]]:
        """Every worker's connection and where it runs (node id, node address, a free port there), by
        rank; fails if a worker exits before connecting."""
        got: dict[int, tuple[Connection, str, str, int]] = {}
        error: list[BaseException] = []

        def accept() -> None:
            try:
                while len(got) < self.world_size:
                    conn = listener.accept()
                    _, rank, _, node_id, node_ip, port = recv(conn)
                    got[rank] = (conn, node_id, node_ip, port)
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

    def _read_ready(self, timeout_s: float) -> bool:
        """Read every answer that is waiting, from any worker, into its rank's queue (one wait round)."""
        try:
            ready = wait(self.conns, timeout=timeout_s)
        except (OSError, ValueError):  # the connections were closed: another thread found the executor dead
            if self._dead is not None:
                raise ExecutorDeadError(self._dead) from None
            raise
        self._round += 1
        for conn in ready:
            rank = self.conns.index(conn)  # type: ignore[arg-type]
            try:
                answer = recv(conn)  # type: ignore[arg-type]
            except (EOFError, OSError):
                self._fail(f"worker rank {rank} closed its connection (it died)")
            self._answers[rank].append((self._round, answer))
        return bool(ready)

    def _gather(self, timeout_s: float | None = None) -> list[tuple[int, Any]]:
        """Every worker's answer to the oldest message not gathered yet, by rank, with the round it
        arrived in; an error answer raises RuntimeError (that call failed), a dead worker
        ExecutorDeadError (the engine is done)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(self._answers):
            if self._dead is not None:
                raise ExecutorDeadError(self._dead)
            if not self._read_ready(_POLL_S) or not all(self._answers):
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    late = [r for r, q in enumerate(self._answers) if not q]
                    self._fail(f"worker rank(s) {late} did not answer within {timeout_s:.0f} s")
        got = [q.popleft() for q in self._answers]
        errors = [value for _, (status, value) in got if status != "ok"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [(arrived, value) for arrived, (_, value) in got]

    def _submit(self, messages: list[Any], kind: int | None, then: Any) -> Future[Any]:
        """Send messages[r] to rank r, and queue `then` (run on the gather thread, in send order)."""
        with self._send_lock:
            if self._dead is not None:
                raise ExecutorDeadError(self._dead)
            try:
                for conn, message in zip(self.conns, messages):
                    send(conn, message)
            except (OSError, ValueError):
                self._check_alive()
                self._fail("a worker's connection broke")
            self._sent.append(kind)
            if kind is not None:
                self.max_steps_in_flight = max(self.max_steps_in_flight, sum(k is not None for k in self._sent))
            return self._gatherer.submit(then)

    def _gathered(self) -> list[tuple[int, Any]]:
        try:
            return self._gather()
        finally:
            with self._send_lock:
                self._sent.popleft()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every worker (vLLM's collective_rpc); their results by rank."""
        return self._submit([(method, args)] * self.world_size, None,
                            lambda: [value for _, value in self._gathered()]).result()

    # ----------------------------------------------------------------- the Executor interface

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        step_index = self._num_steps
        self._num_steps += 1
        with self._tokens_lock:  # what the earlier stages need before they run this step
            tokens, self._pipeline_tokens = self._pipeline_tokens, []
        first_of_last_stage = self.output_rank
        messages = [("execute_model", (scheduler_output, tokens) if rank < first_of_last_stage and tokens
                     else (scheduler_output,)) for rank in range(self.world_size)]
        t_sent = time.monotonic()
        future = self._submit(messages, scheduler_output.total_num_scheduled_tokens,
                              lambda: self._finish_step(step_index, t_sent))
        return future if non_block else future.result()

    def _finish_step(self, step_index: int, t_sent: float) -> ModelRunnerOutput:
        """On the gather thread: the step's answers; the sampled tokens kept for the earlier stages."""
        got = self._gathered()
        arrived, (out, drafts) = got[self.output_rank]
        self._drafts = drafts
        if self.pipeline_parallel_size > 1:
            tokens = {r: t for r, t in zip(out.req_ids, out.sampled_token_ids) if t}
            if tokens:
                with self._tokens_lock:
                    self._pipeline_tokens.append((step_index, tokens))
            with self._send_lock:
                next_kind = self._sent[0] if self._sent else None
            ahead = self._answers[0]
            if next_kind and ahead and ahead[0][0] < arrived:
                self.pipeline_overlaps += 1  # the first stage finished the next batch before this one ended
        out.execute_start, out.execute_end = t_sent, time.monotonic()
        return out

    def take_draft_token_ids(self) -> Any:
        drafts, self._drafts = self._drafts, None
        return drafts

    def reset(self) -> None:
        self.collective_rpc("reset")
        with self._tokens_lock:
            self._pipeline_tokens = []

    def shutdown(self) -> None:
        gatherer = getattr(self, "_gatherer", None)
        if gatherer is not None:
            gatherer.shutdown(wait=True)
            self._gatherer = None
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
