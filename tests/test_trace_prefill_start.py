"""The step trace's prefill_start: where each prefill chunk starts (its context before the chunk)."""

from __future__ import annotations

from tokenloom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.engine.trace import _chunk_starts
from tokenloom.sampling_params import SamplingParams


def test_prefill_start_per_chunk() -> None:
    new = NewRequestData("a", [1] * 40, [1] * 40, SamplingParams(), ([0, 1, 2],), 16)  # a 16-token prefix hit
    out = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData(req_ids=["b", "c"], new_block_ids=[([],), ([],)],
                                                num_computed_tokens=[2048, 77]),
        num_scheduled_tokens={"a": 24, "b": 512, "c": 1},
        total_num_scheduled_tokens=537,
        num_prefill_tokens={"a": 24, "b": 512},  # c decodes
    )
    assert _chunk_starts(out, dict(out.num_prefill_tokens)) == {"a": 16, "b": 2048}
