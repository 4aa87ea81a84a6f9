"""Every data-parallel engine's last SchedulerStats report as one (what /metrics and the offline front end
show for N engines): AsyncLLM and SyncMPClient keep each engine's last report and sum them here."""

from __future__ import annotations

from tokenloom.core.kv_cache_manager import PrefixCacheStats
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.core.spec_decode_stats import SpecDecodingStats


def sum_engine_stats(per_engine: dict[int, SchedulerStats]) -> SchedulerStats:
    """Every data-parallel engine's last report as one: counts and totals add up, KV usage is the mean
    (the engines' pools are equal, so it is the fraction of all blocks in use)."""
    reports = list(per_engine.values())
    return SchedulerStats(
        num_running_reqs=sum(r.num_running_reqs for r in reports),
        num_waiting_reqs=sum(r.num_waiting_reqs for r in reports),
        num_skipped_waiting_reqs=sum(r.num_skipped_waiting_reqs for r in reports),
        kv_cache_usage=sum(r.kv_cache_usage for r in reports) / len(reports),
        num_free_blocks=sum(r.num_free_blocks for r in reports),
        num_preemptions_total=sum(r.num_preemptions_total for r in reports),
        prefix_cache_queries=sum(r.prefix_cache_queries for r in reports),
        prefix_cache_hits=sum(r.prefix_cache_hits for r in reports),
        running_lora_adapters=_sum_counts([r.running_lora_adapters for r in reports]),
        waiting_lora_adapters=_sum_counts([r.waiting_lora_adapters for r in reports]),
        connector_prefix_cache_totals=_sum_prefix_stats([r.connector_prefix_cache_totals for r in reports]),
        spec_decoding=_sum_spec_decoding([r.spec_decoding for r in reports]),
    )


def _sum_counts(parts: list[dict[str, int] | None]) -> dict[str, int] | None:
    if all(p is None for p in parts):
        return None
    out: dict[str, int] = {}
    for part in parts:
        for name, n in (part or {}).items():
            out[name] = out.get(name, 0) + n
    return out


def _sum_prefix_stats(parts: list[PrefixCacheStats | None]) -> PrefixCacheStats | None:
    """The engines' KV connector hit totals as one (None when no engine runs a connector)."""
    if all(p is None for p in parts):
        return None
    total = PrefixCacheStats()
    for p in parts:
        if p is not None:
            total.merge(p)
    return total


def _sum_spec_decoding(parts: list[SpecDecodingStats | None]) -> SpecDecodingStats | None:
    """The engines' speculative-decoding totals as one (None without speculative decoding). Every engine
    drafts the same number of tokens a step (one config); the per-position counts add up position by position."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    total = SpecDecodingStats.new(max(p.num_spec_tokens for p in present))
    for p in present:
        total.num_drafts += p.num_drafts
        total.num_draft_tokens += p.num_draft_tokens
        total.num_accepted_tokens += p.num_accepted_tokens
        for i, n in enumerate(p.num_accepted_tokens_per_pos):
            total.num_accepted_tokens_per_pos[i] += n
    return total
