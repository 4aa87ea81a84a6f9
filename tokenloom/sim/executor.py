"""SimulatedExecutor: the engine core's Executor over the cost-model SimulatedRunner.

Each step runs in the calling thread and advances the virtual clock by its modelled time, so every
timestamp the scheduler reads is simulated time; with non_block the Future comes back already done,
as from the in-process executor.
"""

from __future__ import annotations

from typing import Any

from tokenloom.core.cost_model import CostModel
from tokenloom.engine.executor import UniProcExecutor
from tokenloom.sim.runner import SIM_TOKEN_ID, SimulatedRunner
from tokenloom.workload.clock import VirtualClock


class SimulatedExecutor(UniProcExecutor):
    runner: SimulatedRunner

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = SIM_TOKEN_ID,
                 **spec_kwargs: Any) -> None:
        """spec_kwargs: SimulatedRunner's speculative-decoding options (num_spec_tokens, spec_acceptance,
        max_model_len, seed)."""
        super().__init__(SimulatedRunner(cost_model, clock, token_id, **spec_kwargs))

    def reset(self) -> None:
        self.runner.tracker.lengths.clear()
