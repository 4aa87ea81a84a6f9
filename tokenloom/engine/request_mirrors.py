"""A front end's mirrors of core requests that run in an engine-core process.

In process, the OutputProcessor reads a request's timestamps and counters (first token, preemptions,
cached tokens) from the scheduler's own Request. Across a pipe the engine process keeps that Request;
the front end keeps a local mirror (the Request it built and sent as an EngineCoreRequest) and writes
each batch's reports into it here, so the OutputProcessor works the same either way. AsyncLLM (the
server) and SyncMPClient (LLMEngine over engine processes) both do it through `update_mirrors`.
"""

from __future__ import annotations

from tokenloom.core.request import Request
from tokenloom.engine.core_messages import EngineCoreOutputs
from tokenloom.engine.iteration_stats import IterationStats, count_new_tokens, count_pooled_prompt


def update_mirrors(batch: EngineCoreOutputs, mirrors: dict[str, Request], stats: IterationStats) -> None:
    """Write one batch into the mirrors of its requests (core request id -> mirror) and count its tokens
    and latencies into `stats`. Outputs of requests with no mirror (finished here already: a stop
    string, an abort) are skipped; finished mirrors stay in `mirrors` (the caller drops them)."""
    ts = batch.timestamp
    for rid, t in batch.first_scheduled.items():
        if (mirror := mirrors.get(rid)) is not None:
            mirror.first_scheduled_time = t
    for out in batch.outputs:
        mirror = mirrors.get(out.request_id)
        if mirror is None:  # finished here already (stop string, abort): late tokens are dropped
            continue
        mirror.num_cached_tokens = out.num_cached_tokens
        mirror.num_cache_creation_tokens = out.num_cache_creation_tokens
        if out.new_token_ids:
            first = mirror.first_token_time is None
            count_new_tokens(stats, mirror, len(out.new_token_ids), ts,
                             None if first else (mirror.last_token_time or ts))
            if first:
                mirror.first_token_time = ts
            mirror.last_token_time = ts
            mirror.append_output_token_ids(out.new_token_ids)
        if out.finished:
            mirror.finished_time = ts
            mirror.num_preemptions = batch.num_preemptions.get(out.request_id, 0)
            if mirror.pooling_params is not None and out.finish_reason == "stop":
                count_pooled_prompt(stats, mirror)
