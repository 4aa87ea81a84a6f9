"""SchedulerInterface: what the engine core, the simulator and the replay drivers ask of a scheduler (vLLM's
`vllm/v1/core/sched/interface.py`).

The engine core (tokenloom/engine/core.py) talks to its scheduler only through the names declared here (a test,
tests/test_scheduler_interface.py, reads the engine core's source and fails on any other): the step's three
calls (`schedule`, `update_from_output`, and for speculation `update_draft_token_ids` /
`update_draft_token_ids_in_output`; under async scheduling `fill_grammar_bitmask`), request arrival and end,
and a few read-only facts. `Scheduler` (core/scheduler.py) is the one implementation; AsyncScheduler subclasses
it as vLLM's does (core/async_scheduler.py: the placeholders of async scheduling). What varies a schedule
beyond vLLM's (budgets, reserves, preemption for waiting requests, the comparison batching modes) is a
policy behind the hooks of core/policies.py, not a subclass. Pure Python, no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
    from tokenloom.core.request import Request, RequestStatus


class SchedulerInterface(ABC):
    # Read-only facts the engine core reads once or per step.
    clock: Callable[[], float]  # the scheduler's time (a wall clock, or the simulator's virtual one)
    speculative_config: Any  # SpeculativeConfig | None: how many draft slots a step carries
    lora_config: Any  # LoRAConfig | None: whether requests may name an adapter
    num_spec_tokens: int  # draft slots per request per step (0: no speculation)
    spec_decoding_per_request: dict[str, Any]  # per request, its drafts' acceptance so far (adaptive drafts)

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide this step: which requests run how many tokens (one budget shared by prefill and decode)."""

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:  # fmt: skip
        """Take a step's sampled tokens: advance requests, check stops, free finished ones; their outputs."""

    @abstractmethod
    def update_draft_token_ids(self, req_ids: Iterable[str], draft_token_ids: Iterable[list[int]]) -> None:
        """The proposer's drafts after a step, for the next one."""

    @abstractmethod
    def update_draft_token_ids_in_output(self, req_ids: Iterable[str], draft_token_ids: Iterable[list[int]],
                                         output: SchedulerOutput) -> None:  # fmt: skip
        """Async scheduling: the drafts that replace a scheduled step's placeholders."""

    @abstractmethod
    def fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Async scheduling: the step's grammar bitmask, once the step before it has landed."""

    @abstractmethod
    def observe_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long the step took (the SLO budget corrects its predictions with it)."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request; RequestRejected (a ValueError) with the reason if it can never run."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[Request]:  # fmt: skip
        """End these requests (aborted from outside) and free their blocks; the requests it ended."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones the runner has not been told about yet (a step must run)."""

    @abstractmethod
    def has_background_work(self) -> bool:
        """A waiting request needs work on another thread first (a grammar compile, a KV load): an empty step
        now is a wait, not the end of the work."""

    @abstractmethod
    def num_running_requests(self) -> int:
        """Requests in the running batch."""

    @abstractmethod
    def make_stats(self) -> Any:
        """The scheduler's counters for metrics (SchedulerStats)."""

    @abstractmethod
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drop the prefix cache (and, with `reset_connector`, the KV connector's); False if blocks are in use
        (and `reset_running_requests` is off) or the connector could not reset."""
