"""The engine-core process: model, scheduler and executor (EngineCoreHost builds them), stepping as fast
as there is work.

    loop: handle every message waiting in the inbox (add / abort / shutdown; block when idle)
          → one EngineCore.step() if any request is unfinished
          → send one EngineCoreOutputs (the step's token ids, scheduler stats, timestamps)

Text never reaches this process: tokenization, detokenization, stop strings and HTTP live in the
API process (AsyncLLM), so they never stall a step. Messages are read between steps only, which
keeps the scheduler single-threaded. The process ends on Shutdown, or when its inbox reaches EOF
(the API process is gone), so it can never outlive its parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.engine.core_messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    EngineProgress,
    EngineReady,
    Shutdown,
    StepInfo,
)
from tokenloom.engine.exceptions import INIT_FAILED
from tokenloom.process_exit import exit_without_teardown

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore
    from tokenloom.engine.core_host import EngineCoreHost

logger = logging.getLogger(__name__)


def run_engine_core(
    config: EngineConfig,
    inbox: Connection,
    outbox: Connection,
    log_level: str = "INFO",
    engine_index: int = 0,
    cpus: list[int] | None = None,
) -> None:
    """Entry point of the spawned process (or of a Ray actor's thread, tokenloom/engine/ray_engine.py).

    `engine_index` is the data-parallel rank, stamped on every batch; `cpus`, when given, are the
    cores this engine may use (data-parallel engines split the machine's cores between them, so N
    engines never run more torch threads than there are cores)."""
    # Ctrl-C (and a SIGTERM sent to the process group) reach this process too, but the API process
    # decides when it stops: it drains requests first, then sends Shutdown. Should the API process
    # die instead, the inbox reaches EOF and this process exits.
    if threading.current_thread() is threading.main_thread():  # a Ray actor may run this elsewhere
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The short OpenMP spin (GOMP_SPINCOUNT) was set when this process imported the tokenloom package,
    # before torch: see tokenloom/__init__.py.
    tag = "engine" if engine_index == 0 and cpus is None else f"engine {engine_index}"
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s")
    heartbeat = LoadHeartbeat(outbox)
    try:
        if cpus:
            pin_cpus(cpus)
        engine, ready = _load(config)
    except Exception as exc:  # report any start-up failure to the API process, which prints it
        heartbeat.stop()
        # vLLM's words ("Engine core initialization failed"), with the cause (vLLM's points at its log).
        _send_quietly(outbox, EngineFailed(f"{INIT_FAILED}: {type(exc).__name__}: {exc}"))
        sys.exit(1)
    heartbeat.stop()  # before `ready`: one thread at a time on the pipe
    orphaned = False
    try:
        outbox.send(ready)
        EngineCoreProc(engine.engine_core, inbox, outbox, engine_index).run()
    except (EOFError, OSError):
        logger.info("the API process is gone; engine core exiting")
        orphaned = True
    except Exception as exc:
        logger.exception("engine core loop failed")
        _send_quietly(outbox, EngineFailed(f"engine core loop failed: {type(exc).__name__}: {exc}"))
        sys.exit(1)
    finally:
        engine.close()  # flushes the step trace
    if orphaned:
        # Nobody is left to serve: skip the interpreter's teardown (torch, thread joins, finalizers),
        # which takes seconds on a busy machine, so the process is gone within a second of its parent.
        logging.shutdown()
        os._exit(0)


def run_engine_core_process(
    config: EngineConfig,
    inbox: Connection,
    outbox: Connection,
    log_level: str = "INFO",
    engine_index: int = 0,
    cpus: list[int] | None = None,
) -> None:
    """The spawned engine process's target (MPClient): run_engine_core, then, the engine closed and its step
    trace flushed, leave without the interpreter's teardown: the API process waits for this process at every
    shutdown (a server's stop, an AsyncLLM's), and unloading torch would add 0.5-1.5 s to each."""
    run_engine_core(config, inbox, outbox, log_level, engine_index, cpus)
    exit_without_teardown(0)


class LoadHeartbeat(logging.Handler):
    """While the model loads, every `interval_s` an EngineProgress to the API process: the CPU seconds this
    process and its children have used (a kernel build runs in compiler processes) and the last message
    logged here, so the API process can tell a slow load on a busy machine from a stuck one."""

    def __init__(self, outbox: Connection, interval_s: float = 1.0) -> None:
        super().__init__(level=logging.INFO)
        self.outbox = outbox
        self.interval_s = interval_s
        self.stage = "starting"
        self._stop = threading.Event()
        logging.getLogger().addHandler(self)
        self._thread = threading.Thread(target=self._run, name="engine-load-heartbeat", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stage = record.getMessage()[:200]
        except Exception:  # a malformed record is logging's problem, never the load's
            self.handleError(record)

    def stop(self) -> None:
        logging.getLogger().removeHandler(self)
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.outbox.send(EngineProgress(process_tree_cpu_s(), self.stage))
            except OSError:  # the API process is gone; the main thread finds out on its own
                return


def process_tree_cpu_s() -> float:
    """CPU seconds used by this process and its descendants, live (Linux /proc) and reaped."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    todo = _children(os.getpid())
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile, or no /proc
            continue
        total += sum(int(v) for v in fields[11:15]) / ticks  # utime stime cutime cstime
        todo += _children(pid)
    return total


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def pin_cpus(cpus: list[int]) -> None:
    """Run on `cpus` only, with one torch thread per core less VLLM_CPU_NUM_OF_RESERVED_CPU (the runner
    sizes its pool from the affinity, tokenloom/model/platform.py configure_cpu_threads; OMP_NUM_THREADS,
    when the user set it, still wins)."""
    os.sched_setaffinity(0, cpus)
    import torch

    from tokenloom.model.platform import model_threads

    if not envs.OMP_NUM_THREADS:
        torch.set_num_threads(model_threads(len(cpus)))


def _load(config: EngineConfig) -> tuple[EngineCoreHost, EngineReady]:
    """The engine core alone (EngineCoreHost): no OutputProcessor, since no text reaches this process."""
    from tokenloom.engine.core_host import EngineCoreHost
    from tokenloom.engine.fault_injection import install_from_env

    t0 = time.perf_counter()
    engine = EngineCoreHost(config)
    if engine.runner is not None:  # (tensor-parallel workers: no runner in this process)
        install_from_env(engine.runner)  # chaos tests only: off unless TOKENLOOM_FAULT_INJECT is set
    return engine, engine.engine_ready(time.perf_counter() - t0)


def _send_quietly(outbox: Connection, msg: object) -> None:
    with contextlib.suppress(OSError):  # the API process may be gone already
        outbox.send(msg)


class EngineCoreProc:
    def __init__(self, core: EngineCore, inbox: Connection, outbox: Connection, engine_index: int = 0) -> None:
        self.core = core
        self.engine_index = engine_index
        self.scheduler = core.scheduler
        self.inbox = inbox
        self.outbox = outbox
        self.num_received = 0
        self.stopping = False
        # Requests this process holds, so their timestamps can be read after the scheduler drops them.
        self._live: dict[str, Request] = {}
        self._unscheduled: set[str] = set()
        # Adds the scheduler refused, answered with an error output in the next batch.
        self._rejected: list[EngineCoreOutput] = []
        # Messages read while a step ran, to apply (in order) once it is done.
        self._read_mid_step: deque[object] = deque()
        core.pending_aborts = self._aborts_arrived_mid_step

    def run(self) -> None:
        while not self.stopping:
            busy = self.core.has_work()
            handled = self._handle_inbox(block=not busy)
            if self.stopping:
                break
            step: StepInfo | None = None
            outputs: list[EngineCoreOutput] = []
            if self.core.has_work():
                outputs, step = self.core.step_reported()
            if step is not None or handled:
                self.outbox.send(self._batch(outputs, step))

    def _handle_inbox(self, block: bool) -> bool:
        """Apply every waiting message (those read during the last step first); when `block`, wait for the
        first one. True if any was handled."""
        handled = bool(self._read_mid_step)
        while self._read_mid_step:
            self._apply(self._read_mid_step.popleft())
            if self.stopping:
                return True
        if not self.inbox.poll(None if block and not handled else 0):
            return handled
        while True:
            self._apply(self.inbox.recv())  # EOFError when the API process is gone: ends the loop
            if self.stopping or not self.inbox.poll(0):
                return True

    def _apply(self, msg: object) -> None:
        if isinstance(msg, EngineCoreRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                self._forget(rid)
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def _aborts_arrived_mid_step(self) -> list[str]:
        """The ids of the aborts that arrived while a step ran (vLLM's aborts queue, which its input thread fills):
        every message waiting is read now and kept, in order, for after the step (an abort is applied again
        then, in its place: a request added after the step would otherwise miss an abort that came behind its
        add; aborting twice is harmless)."""
        aborted: list[str] = []
        while self.inbox.poll(0):
            try:
                msg = self.inbox.recv()
            except EOFError:  # the API process is gone: the loop finds out at its next read
                break
            self._read_mid_step.append(msg)
            if isinstance(msg, AbortRequests):
                aborted.extend(msg.request_ids)
        return aborted

    def _add(self, msg: EngineCoreRequest) -> None:
        self.num_received += 1
        try:
            request = self.core.preprocess_add_request(msg)
        except Exception as exc:  # vLLM's: this request ends with "error", the engine goes on
            self._rejected.append(self.core.preprocess_error_output(msg.request_id, exc))
            return
        try:
            self.core.add_request(request)
        except ValueError as exc:  # RequestRejected: the API process validates first, so this is rare
            self._rejected.append(EngineCoreOutput(msg.request_id, [], finish_reason="error", error=str(exc)))
            return
        self._live[msg.request_id] = request
        self._unscheduled.add(msg.request_id)

    def _batch(self, outputs: list[EngineCoreOutput], step: StepInfo | None) -> EngineCoreOutputs:
        if self._rejected:
            outputs = self._rejected + outputs
            self._rejected = []
        first_scheduled = {}
        for rid in list(self._unscheduled):
            t = self._live[rid].first_scheduled_time
            if t is not None:
                first_scheduled[rid] = t
                self._unscheduled.discard(rid)
        num_preemptions = {}
        for out in outputs:
            if out.finished:
                request = self._live.get(out.request_id)
                if request is not None and request.num_preemptions:
                    num_preemptions[out.request_id] = request.num_preemptions
                self._forget(out.request_id)
        return EngineCoreOutputs(
            outputs=outputs,
            timestamp=time.monotonic(),
            stats=self.scheduler.make_stats(),
            num_requests_received=self.num_received,
            step=step,
            first_scheduled=first_scheduled,
            num_preemptions=num_preemptions,
            engine_index=self.engine_index,
        )

    def _forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._unscheduled.discard(request_id)
