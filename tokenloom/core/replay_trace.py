"""The replay trace format (docs/replay_format.md): a trace's config keys and requests, parsed and checked
into a Trace, and the per-request scripts (drafts offered, drafts accepted) that the drivers cycle.
Read by the synchronous driver (core/replay.py) and the async one (core/replay_async.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig

# A trace's "config" holds SchedulerConfig and CacheConfig fields by their field names, plus the
# speculative-decoding extension's keys (shared/reference replay format).
_SCHEDULER_KEYS = {f.name for f in fields(SchedulerConfig)}
_CACHE_KEYS = {f.name for f in fields(CacheConfig)}
_SPEC_KEYS = {"num_speculative_tokens", "async_scheduling"}


@dataclass
class TraceRequest:
    id: str
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    drafts: list[int] = field(default_factory=list)  # empty: [K]
    accept: list[int] = field(default_factory=list)  # empty: [0]


@dataclass
class Trace:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: list[TraceRequest] = field(default_factory=list)
    num_speculative_tokens: int = 0
    async_scheduling: bool = False

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        k = self.num_speculative_tokens
        return SpeculativeConfig(method="ngram", num_speculative_tokens=k) if k > 0 else None


def _script(r: dict[str, Any], key: str, rid: str) -> list[int]:
    value = r.get(key) or []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ConfigError(f"trace request {rid!r}: {key} must be a list of integers >= 0, got {value!r}")
    return list(value)


def parse_trace(data: dict[str, Any]) -> Trace:
    if not isinstance(data, dict) or "config" not in data or "requests" not in data:
        raise ConfigError('a trace is a JSON object with "config" and "requests"')
    config = dict(data["config"])
    unknown = sorted(set(config) - _SCHEDULER_KEYS - _CACHE_KEYS - _SPEC_KEYS)
    if unknown:
        raise ConfigError(f"unknown config key(s) in trace: {', '.join(unknown)}")
    if "num_blocks" not in config:
        raise ConfigError("trace config needs num_blocks (usable KV blocks in the pool)")
    sched = SchedulerConfig(**{k: v for k, v in config.items() if k in _SCHEDULER_KEYS})
    cache = CacheConfig(**{k: v for k, v in config.items() if k in _CACHE_KEYS})
    k = config.get("num_speculative_tokens", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"trace config num_speculative_tokens must be an integer >= 0, got {k!r}")
    async_scheduling = config.get("async_scheduling", False)
    if not isinstance(async_scheduling, bool):
        raise ConfigError(f"trace config async_scheduling must be true or false, got {async_scheduling!r}")
    requests = []
    for i, r in enumerate(data["requests"]):
        try:
            requests.append(
                TraceRequest(
                    id=str(r["id"]),
                    arrival_step=int(r.get("arrival_step", 0)),
                    prompt_token_ids=[int(t) for t in r["prompt_token_ids"]],
                    max_tokens=int(r["max_tokens"]),
                    priority=int(r.get("priority", 0)),
                    drafts=_script(r, "drafts", str(r.get("id"))),
                    accept=_script(r, "accept", str(r.get("id"))),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"trace request #{i} is malformed: {exc!r}") from exc
        if requests[-1].arrival_step < 0:
            raise ConfigError(f"trace request {requests[-1].id!r}: arrival_step must be >= 0")
    return Trace(sched, cache, requests, num_speculative_tokens=k, async_scheduling=async_scheduling)


class ScriptCycle:
    """A per-request script, cycled; each use advances its cursor."""

    def __init__(self, values: list[int], default: int) -> None:
        self.values = values or [default]
        self.cursor = 0

    def next(self) -> int:
        value = self.values[self.cursor % len(self.values)]
        self.cursor += 1
        return value
