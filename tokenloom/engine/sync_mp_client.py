"""SyncMPClient: engine cores in other processes, stepped the way LLMEngine steps its in-process one
(vLLM's SyncMPClient).

The multi-process clients (MPClient, DPEngineCoreClient and its Ray actors) deliver their batches on an
asyncio event loop; this adapter gives them a private loop and turns that push into LLMEngine's pull:
`get_output()` runs the loop until at least one batch (or a failure) has arrived and returns the core
outputs. The core Requests LLMEngine adds are kept as mirrors and updated from every batch
(engine/request_mirrors.py), so the OutputProcessor reads their timestamps as it does in process.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.core_client import AsyncEngineCoreClient
from tokenloom.engine.core_messages import EngineCoreOutputs, EngineReady, StepInfo
from tokenloom.engine.engine_stats import sum_engine_stats
from tokenloom.engine.exceptions import EngineDeadError
from tokenloom.engine.iteration_stats import IterationStats
from tokenloom.engine.request_mirrors import update_mirrors


class SyncMPClient:
    def __init__(self, client: AsyncEngineCoreClient) -> None:
        """Over `client`, whose engine processes are already starting (make_client spawned them)."""
        self.client = client
        self._ready: EngineReady | None = None
        self._mirrors: dict[str, Request] = {}  # core request id -> the front end's Request, while unfinished
        self._batches: list[EngineCoreOutputs] = []
        self._engine_stats: dict[int, SchedulerStats] = {}  # data-parallel rank -> its last report
        self._failure: str | None = None
        self._loop = asyncio.new_event_loop()
        self._arrived: asyncio.Event | None = None
        self.steps: list[StepInfo] = []  # the steps behind the last get_output()'s batches (LLMEngine's metrics)

    def engine_ready(self) -> EngineReady:
        """Waits (once) for every engine to load, then starts hearing from them. Stops them if that fails."""
        if self._ready is None:
            try:
                ready = self.client.wait_ready()
                self._loop.run_until_complete(self._attach())
            except BaseException:
                self.shutdown()
                raise
            self._ready = ready
        return self._ready

    async def _attach(self) -> None:
        self._arrived = asyncio.Event()
        self.client.attach(self._on_outputs, self._on_failure)

    def _on_outputs(self, batch: EngineCoreOutputs) -> None:
        self._batches.append(batch)
        assert self._arrived is not None
        self._arrived.set()

    def _on_failure(self, message: str, core_ids: list[str] | None = None) -> None:
        """Every engine gone (`core_ids` None), or one of several with these requests: a request of ours
        among them fails the next get_output()."""
        lost = set(self._mirrors) if core_ids is None else self._mirrors.keys() & set(core_ids)
        if core_ids is None or lost:
            self._failure = message
        for rid in lost:
            del self._mirrors[rid]
        assert self._arrived is not None
        self._arrived.set()

    # The request side -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.engine_ready()
        if (reason := self.client.failure) is not None:
            raise EngineDeadError(reason)
        self._mirrors[request.request_id] = request
        self.client.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._mirrors.pop(rid, None) is not None]
        if live and self.client.is_alive:
            self.client.abort_requests(live)

    def has_unfinished_requests(self) -> bool:
        return bool(self._mirrors)

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        """Every engine's last report, summed (as AsyncLLM's); None before the first."""
        if len(self._engine_stats) <= 1:
            return next(iter(self._engine_stats.values()), None)
        return sum_engine_stats(self._engine_stats)

    def get_output(self) -> list[EngineCoreOutput]:
        """Every batch that arrived, waiting for one when none has; [] with nothing in flight."""
        if not self._batches and self._failure is None and self._mirrors:
            self._loop.run_until_complete(self._wait())
        if self._failure is not None:
            message, self._failure = self._failure, None
            raise EngineDeadError(message)
        outputs: list[EngineCoreOutput] = []
        # LLMEngine counts tokens from the mirrors it shares with this client (the Requests it added), the same
        # way in process or not; the figures update_mirrors adds up here are not used.
        stats = IterationStats(time.monotonic())
        self.steps = [batch.step for batch in self._batches if batch.step is not None]
        for batch in self._batches:
            self._engine_stats[batch.engine_index] = batch.stats
            update_mirrors(batch, self._mirrors, stats)
            for out in batch.outputs:
                if out.finished:
                    self._mirrors.pop(out.request_id, None)
            outputs += batch.outputs
        self._batches.clear()
        return outputs

    async def _wait(self) -> None:
        assert self._arrived is not None
        await self._arrived.wait()
        self._arrived.clear()

    # LoRA adapters load in the engine processes as requests name them; nothing reaches them at run time.
    def add_lora(self, lora_request: Any) -> bool:
        raise ValueError("add_lora loads an adapter into an engine core in this process; with engine processes "
                         "(data parallelism) name the adapter in each request's lora_request instead")

    def remove_lora(self, lora_id: int) -> bool:
        raise ValueError("remove_lora needs the engine core in this process (no data parallelism)")

    def list_loras(self) -> set[int]:
        raise ValueError("list_loras needs the engine core in this process (no data parallelism)")

    def shutdown(self) -> None:
        self.client.shutdown()
        if not self._loop.is_closed():
            self._loop.close()
