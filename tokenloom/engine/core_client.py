"""The front ends' handle on their engine cores (vLLM's core_client.py): the client protocols, and the client
that spawns, feeds and hears from one engine-core process (MPClient).

Three protocols, one request side:

    EngineCoreClient        every client: add_request(core Request), abort_requests, shutdown
    ├─ SyncEngineCoreClient  LLMEngine's: get_output() (one step's outputs, blocking), has_unfinished_requests,
    │                        engine_ready, LoRA adapters. InprocClient (engine/inproc_client.py: the core in
    │                        this process, get_output() steps it) or SyncMPClient (engine/sync_mp_client.py:
    │                        an asynchronous client below, driven on a private event loop)
    └─ AsyncEngineCoreClient AsyncLLM's: wait_ready, attach (outputs delivered on the running event loop),
                             liveness. MPClient (one process), DPEngineCoreClient (engine/dp_client.py: N
                             processes behind the router, spawned or Ray actors)

A request goes in as the core `Request` the front end built (engine/parallel_sampling.py fan_out): in
process it is the scheduler's own object; across a pipe the client sends an EngineCoreRequest made from it
and the front end keeps the Request as a mirror that each batch updates (engine/request_mirrors.py).
Which client a config gets is make_client's choice (tokenloom/engine/clients.py): the factory sits above
the clients it picks, so none of them imports it back.

MPClient: two one-way pipes. Messages to the engine go through a writer thread, so a full pipe (the engine
is in the middle of a long step) never blocks the event loop. Messages from the engine are read on the
event loop itself (`loop.add_reader`): a batch is one small pickle, and handling it there keeps every
per-request structure single-threaded. EOF on the engine's pipe means the process died.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
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
from tokenloom.engine.core_proc import run_engine_core_process
from tokenloom.engine.exceptions import INIT_FAILED, EngineStartError
from tokenloom.engine.process_start import main_module_rerun_hint, start_engine_process

logger = logging.getLogger(__name__)

_now = time.monotonic  # the start-up wait's clock (tests drive a fake one)
WAIT_NOTE_EVERY_S = 30.0  # how often a long start-up says what the engine is doing


class EngineCoreClient(Protocol):
    """The request side every client has, in process or not (vLLM's EngineCoreClient)."""

    def add_request(self, request: Request) -> None:
        """Queue a core request (one of a fan-out's); in process a bad one raises RequestRejected here, an
        engine process answers it with an error output."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Free these core requests' blocks now; their engine reports nothing more for them."""
        ...

    def shutdown(self) -> None:
        """Stop the engine core(s) and free what they hold. Idempotent."""
        ...


class SyncEngineCoreClient(EngineCoreClient, Protocol):
    """What LLMEngine steps (vLLM's InprocClient / SyncMPClient): outputs are pulled, one step at a time."""

    def engine_ready(self) -> EngineReady:
        """What the engine core is (model, context, KV pool, pooling, LoRA); waits for it to load."""
        ...

    def get_output(self) -> list[EngineCoreOutput]:
        """The next step's outputs: in process, one EngineCore.step(); across processes, the batches that
        arrived, waiting for one if none has. Raises EngineDeadError when the engine is gone."""
        ...

    def has_unfinished_requests(self) -> bool:
        ...

    # For LLMEngine's metrics (disable_log_stats=False): the steps behind the last get_output() and the
    # scheduler's latest report (every engine's, summed); None before the first across processes.
    steps: list[StepInfo]

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        ...

    def add_lora(self, lora_request: Any) -> bool:
        ...

    def remove_lora(self, lora_id: int) -> bool:
        ...

    def list_loras(self) -> set[int]:
        ...


class AsyncEngineCoreClient(EngineCoreClient, Protocol):
    """What AsyncLLM (the server) asks of its engine cores, one process or N: outputs are pushed, delivered on
    the running event loop (vLLM's AsyncMPClient / DPAsyncMPClient)."""

    def wait_ready(self, timeout_s: float | None = None) -> EngineReady:
        """Block until the engine cores are loaded; what they are (model, context, KV pool, pooling, LoRA)."""
        ...

    def attach(self, on_outputs: Callable[[EngineCoreOutputs], None], on_failure: Callable[..., None]) -> None:
        """Deliver engine messages on the running event loop from now on."""
        ...

    def shutdown(self, timeout_s: float = 5.0) -> None:
        ...

    @property
    def is_alive(self) -> bool:
        ...

    @property
    def failure(self) -> str | None:
        ...

    @property
    def data_parallel_size(self) -> int:
        ...

    def engine_health(self) -> list[dict[str, Any]] | None:
        """Per engine: alive, and a dead one's error; None with a single engine (no per-engine view)."""
        ...


class MPClient:
    """One engine-core process (vLLM's MPClient)."""

    def __init__(
        self,
        config: EngineConfig,
        log_level: str = "info",
        engine_index: int = 0,
        cpus: list[int] | None = None,
        *,
        connections: tuple[Any, Connection, Connection] | None = None,
        start_method: str = "forkserver",
    ) -> None:
        """Spawn an engine-core process (`engine_index`: its data-parallel rank, `cpus`: the cores it may
        use), or take over one started elsewhere: `connections` = (a handle with the Process methods
        is_alive/exitcode/join/kill, the connection to it, the connection from it), as the Ray backend does.
        `start_method`: "forkserver" or "spawn" (tokenloom/engine/process_start.py decides, from it)."""
        self.engine_index = engine_index
        if connections is not None:
            self.process, self._to_engine, self._from_engine = connections
        else:
            # A fresh interpreter, or a fork of one that has only imported torch and tokenloom: no forked
            # torch threads, no inherited sockets either way.
            engine_inbox, self._to_engine = mp.Pipe(duplex=False)
            self._from_engine, engine_outbox = mp.Pipe(duplex=False)
            name = "tokenloom-engine-core" if cpus is None else f"tokenloom-engine-core-{engine_index}"
            self.process = start_engine_process(
                run_engine_core_process, (config, engine_inbox, engine_outbox, log_level, engine_index, cpus), name,
                start_method)
            # Drop our copies of the child's ends, or EOF would never show when the child dies.
            engine_inbox.close()
            engine_outbox.close()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="engine-core-writer", daemon=True)
        self._writer.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: Callable[[EngineCoreOutputs], None] | None = None
        self._on_failure: Callable[[str], None] | None = None
        self.dead_reason: str | None = None
        self._closed = False

    # Start-up (synchronous: before the server binds) ---------------------------------------------
    def wait_ready(self, timeout_s: float | None = None) -> EngineReady:
        """Wait for EngineReady for as long as the engine makes progress: its heartbeats (EngineProgress)
        show CPU used or a new log line. Fails when the process dies, reports a failure, or goes
        `timeout_s` (default $TOKENLOOM_ENGINE_READY_TIMEOUT, 600 s; 0: no limit) without progress. A
        load that takes minutes on a busy machine is slow, not stuck, and is not cut."""
        if timeout_s is None:
            timeout_s = envs.TOKENLOOM_ENGINE_READY_TIMEOUT
        start = last_progress = _now()
        next_note = start + WAIT_NOTE_EVERY_S
        cpu_s, stage = -1.0, "starting the engine process"
        while not timeout_s or _now() - last_progress <= timeout_s:
            if self._from_engine.poll(0.05):
                try:
                    msg = self._from_engine.recv()
                except EOFError:
                    break
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    raise EngineStartError(msg.message)
                if isinstance(msg, EngineProgress) and (msg.cpu_s > cpu_s + 0.01 or msg.stage != stage):
                    cpu_s, stage, last_progress = msg.cpu_s, msg.stage, _now()
            elif not self.process.is_alive():
                break
            if _now() >= next_note:
                logger.info("engine %d still loading after %.0f s (%.0f CPU s so far; last: %s)",
                            self.engine_index, _now() - start, max(cpu_s, 0.0), stage)
                next_note += WAIT_NOTE_EVERY_S
        if self.process.is_alive():
            raise EngineStartError(
                f"{INIT_FAILED}: the engine made no progress for {timeout_s:g} s (no CPU used, nothing logged; "
                f"last: {stage}); it was still running after {_now() - start:.0f} s. "
                f"TOKENLOOM_ENGINE_READY_TIMEOUT sets how long a stall may last (0: no limit)")
        self.process.join(1.0)
        # No EngineProgress ever came (cpu_s unset): the child died before any of tokenloom's code ran.
        hint = main_module_rerun_hint() if cpu_s < 0 else ""
        raise EngineStartError(f"{INIT_FAILED}: the engine process exited during start-up (exit code "
                               f"{self.process.exitcode}){hint}")

    # Running ------------------------------------------------------------------------------------
    def attach(self, on_outputs: Callable[[EngineCoreOutputs], None], on_failure: Callable[[str], None]) -> None:
        """Start delivering engine messages on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._loop.add_reader(self._from_engine.fileno(), self._on_readable)

    def add_request(self, request: Request) -> None:
        self.send(EngineCoreRequest.from_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.send(AbortRequests(request_ids))

    def send(self, msg: Any) -> None:
        """Any message to the engine process, through the writer thread."""
        if not self._closed:
            self._outbox.put(msg)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.process.is_alive()

    @property
    def data_parallel_size(self) -> int:
        return 1

    def engine_health(self) -> None:
        return None  # one engine: its health is the server's

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve, or None while it runs."""
        if self.is_alive:
            return None
        return self.dead_reason or f"the engine process is not running (exit code {self.process.exitcode})"

    def _on_readable(self) -> None:
        try:
            while self._from_engine.poll():
                msg = self._from_engine.recv()
                if isinstance(msg, EngineCoreOutputs):
                    assert self._on_outputs is not None
                    self._on_outputs(msg)
                elif isinstance(msg, EngineFailed):
                    self._fail(msg.message)
                    return
        except (EOFError, OSError):
            if not self._closed:
                self.process.join(0.2)  # the exit code, when the kernel has it already
                self._fail(f"the engine process died (exit code {self.process.exitcode})")
        except Exception as exc:  # a bug handling outputs: fail loudly (503s, /health) rather than hang streams
            logger.exception("handling engine outputs failed")
            self._fail(f"internal error while handling engine outputs: {type(exc).__name__}: {exc}")

    def _fail(self, message: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = message
        logger.error("engine failure: %s", message)
        self._detach()
        if self._on_failure is not None:
            self._on_failure(message)

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._from_engine.fileno())
        self._loop = None

    def _write_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._to_engine.send(msg)
            except OSError:  # the engine is gone; the reader reports it
                return

    # Stopping -----------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the engine to stop, and kill it if it has not within `timeout_s`. Idempotent."""
        if self._closed:
            return
        if self.process.is_alive():
            self._outbox.put(Shutdown())
        self._outbox.put(None)
        self._closed = True
        self._writer.join(timeout_s)
        self.process.join(timeout_s)
        if self.process.is_alive():  # it ignores SIGTERM (see core_proc), so straight to SIGKILL
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.join()
        self._detach()
        self._to_engine.close()
        self._from_engine.close()
