"""InprocClient: the engine core in this process, behind the client protocol (vLLM's InprocClient).

It owns the EngineCoreHost (engine/core_host.py: model, KV cache, scheduler, executor, built from the
EngineConfig alone) and answers LLMEngine's SyncEngineCoreClient calls on it: `get_output()` is one
EngineCore.step(). Nothing crosses a pipe, so a request's Request object is the scheduler's own and
the OutputProcessor reads its timestamps directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.core_host import EngineCoreHost
from tokenloom.engine.core_messages import EngineReady, StepInfo


class InprocClient:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """Load the model and build the engine core here (minutes for a large model)."""
        self.host = EngineCoreHost(config, clock)
        self.steps: list[StepInfo] = []  # what the last get_output()'s step did (LLMEngine's step metrics)
        # Requests whose preprocessing failed, handed back finished with "error" by the next get_output().
        self._failed: list[EngineCoreOutput] = []

    def engine_ready(self) -> EngineReady:
        """The engine core as it is now (reset_scheduler may change its limits)."""
        return self.host.engine_ready(0.0)

    def add_request(self, request: Request) -> None:
        """A request the engine cannot take (RequestRejected) raises here; one whose preprocessing fails ends with
        "error" instead, as in vLLM's engine-core process."""
        core = self.host.engine_core
        try:
            request = core.preprocess_add_request(request)
        except Exception as exc:
            self._failed.append(core.preprocess_error_output(request.request_id, exc))
            return
        core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.host.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        outputs, step = self.host.engine_core.step_reported()
        self.steps = [] if step is None else [step]
        if self._failed:
            outputs, self._failed = self._failed + outputs, []
        return outputs

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's report now (what an engine-core process sends with each batch)."""
        return self.host.scheduler.make_stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self._failed) or self.host.engine_core.has_unfinished_requests()

    # vLLM's InprocClient.add_lora / remove_lora / list_loras (runtime adapter loading).
    def add_lora(self, lora_request: Any) -> bool:
        return self.host.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.host.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.host.engine_core.list_loras()

    def shutdown(self) -> None:
        self.host.close()
