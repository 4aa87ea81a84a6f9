"""SimulatedRunner: the runner interface with no weights. Same scheduler, modelled step times.

It follows the real runner's sampling rule: a scheduled request samples iff its computed tokens reach
its current length (start + n == length), where start comes from the SchedulerOutput and the runner
keeps each length itself (prefill_token_ids when the request arrives, +1 per sample). Every sample is
the same non-EOS token; requests stop by max_tokens (the simulator sets max_tokens to the target output
length and ignore_eos), so the scheduler needs no change.

Each step lasts what the cost model says for its shape; the runner advances the virtual clock that the
scheduler reads, so every timestamp (first_token_time, finished_time, the step trace) is simulated time.
"""

from __future__ import annotations

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.sim.cost_model import CostModel, StepShape
from tokenloom.workload.clock import VirtualClock

# Not special in any vocabulary we run (SmolLM2's specials are 0..16); never an EOS.
SIM_TOKEN_ID = 7


class SequenceTracker:
    """A runner's view of its requests: each one's current length, and which rows sample.

    The same bookkeeping as the real runner's (prefill_token_ids when a request arrives, +1 per
    sample, dropped when finished or preempted), so the step's shape can be read from any run.
    """

    def __init__(self) -> None:
        self.lengths: dict[str, int] = {}

    def step(self, scheduler_output: SchedulerOutput) -> tuple[StepShape, list[bool]]:
        """The step's shape and, in num_scheduled_tokens order, whether each request samples."""
        lengths = self.lengths
        # Finished and preempted requests lose their state; a preempted one comes back as new.
        for rid in scheduler_output.finished_req_ids:
            lengths.pop(rid, None)
        for rid in scheduler_output.preempted_req_ids:
            lengths.pop(rid, None)
        starts: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            lengths[new.req_id] = len(new.prefill_token_ids)
            starts[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        shape = StepShape()
        samples: list[bool] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            start = starts[rid]
            length = lengths[rid]
            sample = start + n == length
            shape.add_row(start, n, sample)
            if sample:
                lengths[rid] = length + 1
            samples.append(sample)
        return shape, samples


class SimulatedRunner:
    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = SIM_TOKEN_ID) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.token_id = token_id
        self.tracker = SequenceTracker()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        shape, samples = self.tracker.step(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        # An empty step runs no model (the real runner returns at once): it costs no time.
        seconds = self.cost_model.predict(shape) if req_ids else 0.0
        self.clock.advance(seconds)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[self.token_id] if sample else [] for sample in samples],
            execute_time=seconds,
        )
