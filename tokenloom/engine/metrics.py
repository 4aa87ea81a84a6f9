"""Prometheus figures under vLLM's names: `vllm:x`, and `tokenloom:x` for the same figure.

`--metrics-prefix both` (the default) exports each figure under both names, so dashboards and
autoscalers written for vLLM work unchanged and tokenloom's own dashboards keep theirs; `vllm` or
`tokenloom` exports one set.

Fed by the IterationStats AsyncLLM (the server's /metrics) or LLMEngine (the offline LLM.get_metrics(),
with disable_log_stats=False) builds: one per batch from the engine (scheduler gauges, step figures,
tokens, latencies) and one per abort. Counters from the engine (preemptions, prefix-cache queries
and hits) arrive as running totals and are added as differences. A private registry per instance keeps
several servers or LLMs in one process apart. It lives in the engine room so the offline engine can
record the same figures; the server imports it from here.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.iteration_stats import IterationStats
from tokenloom.metric_buckets import histogram_buckets

# tokenloom's own histograms (no vLLM family: --custom-histogram-buckets leaves them as they are).
_STEP = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
_IPC = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

PREFIXES = {"both": ("vllm", "tokenloom"), "vllm": ("vllm",), "tokenloom": ("tokenloom",)}


class _Fanout:
    """One figure exported under several names: every update goes to each."""

    def __init__(self, children: list) -> None:
        self.children = children

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class PrometheusMetrics:
    def __init__(self, model_name: str, num_blocks: int, prefix: str = "both", info: Any = None,
                 data_parallel_size: int = 1) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        prefixes = PREFIXES[prefix]
        self.last_kv_usage = 0.0  # for ORCA load headers
        self.lora_info: Any = None  # vllm:lora_requests_info, created at the first LoRA report
        lora = getattr(info, "lora", None)
        self.max_loras = lora["max_loras"] if isinstance(lora, dict) else 0
        self.last_num_waiting = 0

        def gauge(name: str, doc: str) -> Any:
            return _Fanout([Gauge(f"{p}:{name}", doc, list(labels), registry=r).labels(**labels) for p in prefixes])

        def counter(name: str, doc: str) -> Any:
            return _Fanout([Counter(f"{p}:{name}", doc, list(labels), registry=r).labels(**labels) for p in prefixes])

        # vLLM's bucket families (tokenloom/metric_buckets.py), so histograms compare bucket for bucket, and the
        # engine's --custom-histogram-buckets in place of a family's defaults. request_tokens' 1-2-5 series runs up
        # to max_model_len (without an engine's figures, as in unit tests: the iteration_tokens series instead).
        custom = getattr(info, "custom_histogram_buckets", None)
        max_model_len = getattr(info, "max_model_len", None)

        def family(name: str) -> list[float]:
            if name == "request_tokens" and not isinstance(max_model_len, int) and not (custom or {}).get(name):
                return histogram_buckets("iteration_tokens")
            return histogram_buckets(name, max_model_len, custom)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return _Fanout([Histogram(f"{p}:{name}", doc, list(labels), buckets=buckets, registry=r).labels(**labels)
                            for p in prefixes])

        latency, tokens = family("request_latency"), family("request_tokens")

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (1 = full)")
        self.free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks free (cached-but-unused included)")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool")
        self.total_blocks.set(num_blocks)
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix-cache queries, in tokens")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens")
        # vLLM's names: tokens a KV connector (--kv-offloading-size, --kv-transfer-config) was asked for
        # (those the pool did not have) and loaded instead of computing.
        self.external_queries = counter("external_prefix_cache_queries", "KV connector prefix-cache queries, tokens")
        self.external_hits = counter("external_prefix_cache_hits", "KV connector prefix-cache hits, tokens")
        self.preemptions = counter("num_preemptions", "Preemptions (requests sent back to waiting)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced their first token")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        success = [Counter(f"{p}:request_success", "Finished requests, by finish reason",
                           ["model_name", "finished_reason"], registry=r) for p in prefixes]
        self.success = {reason: _Fanout([c.labels(model_name=model_name, finished_reason=reason) for c in success])
                        for reason in FINISH_REASONS}
        # vLLM: 'capacity' = waiting for room; 'deferred' = stepped over by admission while waiting for something
        # else (a grammar, a KV load, a LoRA slot). Their sum is num_requests_waiting.
        by_reason = [Gauge(f"{p}:num_requests_waiting_by_reason", "Waiting requests by reason",
                           ["model_name", "reason"], registry=r) for p in prefixes]
        self.waiting_capacity = _Fanout([g.labels(model_name=model_name, reason="capacity") for g in by_reason])
        self.waiting_deferred = _Fanout([g.labels(model_name=model_name, reason="deferred") for g in by_reason])
        self.waiting_deferred.set(0)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter",
                                  family("request_params_n"))
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter", tokens)
        self.inference_time = histogram("request_inference_time_seconds", "Time in the RUNNING phase", latency)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time in the PREFILL phase", latency)
        self.decode_time = histogram("request_decode_time_seconds", "Time in the DECODE phase", latency)
        if info is not None:  # vLLM's Info-as-gauge: always 1, the figures in its labels
            cache = {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_blocks)}
            if getattr(info, "kv_cache_dtype", ""):  # vLLM's label: what the cache stores
                cache["cache_dtype"] = info.kv_cache_dtype
            for p in prefixes:
                Gauge(f"{p}:cache_config_info", "Information of the LLMEngine CacheConfig", list(cache),
                      registry=r).labels(**cache).set(1)
            budget = getattr(info, "token_budget", None)
            if budget:  # tokenloom's own: which token budget runs (docs/scheduler.md, "The token budget")
                Gauge("tokenloom:token_budget_info", "The token budget in force: mode auto (bounded by step time), "
                      "fixed or slo; its ceiling", list(budget), registry=r).labels(**budget).set(1)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", family("time_to_first_token"))
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request",
                             family("inter_token_latency"))
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", latency)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled", latency)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests", tokens)
        self.gen_len = histogram("request_generation_tokens", "Generated tokens of finished requests", tokens)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens scheduled per engine step",
                                          family("iteration_tokens"))
        self.step_time = histogram("engine_step_duration_seconds", "Engine step: schedule + forward + update",
                                   _STEP)
        self.ipc_latency = histogram("engine_ipc_latency_seconds",
                                     "A step's outputs: built in the engine process → received by the API", _IPC)
        self._totals = {"preemptions": 0, "queries": 0, "hits": 0, "external_queries": 0, "external_hits": 0}
        self._labels = labels
        self._prefixes = prefixes
        # vLLM's SpecDecodingProm: with speculative decoding configured, its counters exist (at 0) from the start,
        # one per draft position among them, so a reader can take differences from before the first step.
        num_spec_tokens = getattr(info, "num_speculative_tokens", 0)
        self.spec_decode: SpecDecodeMetrics | None = (
            SpecDecodeMetrics(r, labels, prefixes, num_positions=num_spec_tokens) if num_spec_tokens else None)
        # Data parallelism: the families above are the sum over engines; these carry engine="i".
        self.engines: _EngineMetrics | None = None
        if data_parallel_size > 1:
            self.total_blocks.set(num_blocks * data_parallel_size)
            self.engines = _EngineMetrics(r, model_name, data_parallel_size)

    def record(self, stats: IterationStats) -> None:
        sched = stats.scheduler
        if sched is not None:
            self.running.set(sched.num_running_reqs)
            self.waiting.set(sched.num_waiting_total)
            self.waiting_capacity.set(sched.num_waiting_reqs)
            self.waiting_deferred.set(sched.num_skipped_waiting_reqs)
            self.last_kv_usage, self.last_num_waiting = sched.kv_cache_usage, sched.num_waiting_total
            self.kv_usage.set(sched.kv_cache_usage)
            self.free_blocks.set(sched.num_free_blocks)
            self._add_total(self.preemptions, "preemptions", sched.num_preemptions_total)
            self._add_total(self.prefix_queries, "queries", sched.prefix_cache_queries)
            self._add_total(self.prefix_hits, "hits", sched.prefix_cache_hits)
            if sched.connector_prefix_cache_totals is not None:
                self._add_total(self.external_queries, "external_queries", sched.connector_prefix_cache_totals.queries)
                self._add_total(self.external_hits, "external_hits", sched.connector_prefix_cache_totals.hits)
            if sched.prefix_cache_queries:
                self.hit_rate.set(sched.prefix_cache_hits / sched.prefix_cache_queries)
            if sched.running_lora_adapters is not None:
                self._record_lora(sched)
            if sched.spec_decoding is not None:
                if self.spec_decode is None:
                    self.spec_decode = SpecDecodeMetrics(self.registry, self._labels, self._prefixes)
                self.spec_decode.record(sched.spec_decoding)
        if self.engines is not None and stats.engine_index is not None and stats.engine_scheduler is not None:
            self.engines.record(stats.engine_index, stats.engine_scheduler)
        if stats.step is not None and stats.step.num_tokens > 0:
            self.iteration_tokens.observe(stats.step.num_tokens)
            self.step_time.observe(stats.step.duration_s)
        if stats.ipc_latency is not None:
            self.ipc_latency.observe(stats.ipc_latency)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for done in stats.finished:
            self.success[done.finish_reason].inc()
            self.e2e.observe(done.e2e_latency)
            if done.queue_time is not None:
                self.queue.observe(done.queue_time)
            self.prompt_len.observe(done.num_prompt_tokens)
            self.gen_len.observe(done.num_generation_tokens)
            for hist, value in ((self.inference_time, done.inference_time), (self.prefill_time, done.prefill_time),
                                (self.decode_time, done.decode_time), (self.params_n, done.n_param),
                                (self.params_max_tokens, done.max_tokens_param)):
                if value is not None:
                    hist.observe(value)

    def _record_lora(self, sched: Any) -> None:
        """vLLM's vllm:lora_requests_info: one sample, labelled with the adapters of running and waiting
        requests (comma-separated names) and max_lora, valued with the time of the report."""
        if self.lora_info is None:
            self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                   registry=self.registry)
        self.lora_info.clear()  # one sample: the latest state
        self.lora_info.labels(max_lora=str(self.max_loras),
                              waiting_lora_adapters=",".join(sorted(sched.waiting_lora_adapters or {})),
                              running_lora_adapters=",".join(sorted(sched.running_lora_adapters or {}))
                              ).set(time.time())

    def _add_total(self, counter: Any, key: str, total: int) -> None:
        if total > self._totals[key]:
            counter.inc(total - self._totals[key])
            self._totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineMetrics:
    """Per data-parallel engine (label engine="i"): its scheduler's gauges and prefix-cache totals."""

    def __init__(self, r: CollectorRegistry, model_name: str, num_engines: int) -> None:
        names = ["model_name", "engine"]

        def family(kind: type, name: str, doc: str) -> list:
            metric = kind(f"tokenloom:engine_{name}", doc, names, registry=r)
            return [metric.labels(model_name=model_name, engine=str(i)) for i in range(num_engines)]

        self.running = family(Gauge, "num_requests_running", "Requests in this engine's running batch")
        self.waiting = family(Gauge, "num_requests_waiting", "Requests waiting in this engine")
        self.kv_usage = family(Gauge, "kv_cache_usage_perc", "This engine's KV-cache usage (1 = full)")
        self.prefix_queries = family(Counter, "prefix_cache_queries", "This engine's prefix-cache queries, tokens")
        self.prefix_hits = family(Counter, "prefix_cache_hits", "This engine's prefix-cache hits, tokens")
        self.preemptions = family(Counter, "num_preemptions", "This engine's preemptions")
        self.alive = family(Gauge, "alive", "1 while this engine process serves, 0 once it died")
        self.routed = family(Gauge, "router_requests_in_flight",
                             "Requests the router sent to this engine and has not seen finish (its load view)")
        for gauge in self.alive:
            gauge.set(1)
        self._totals = [{"queries": 0, "hits": 0, "preemptions": 0} for _ in range(num_engines)]

    def record_health(self, engines: list[dict]) -> None:
        """/health's per-engine view (AsyncLLM.engine_health) into the alive and router gauges; a dead engine's
        running and waiting gauges drop to 0 (its requests were failed, not left running)."""
        for entry in engines:
            i = entry["engine"]
            self.alive[i].set(1 if entry["alive"] else 0)
            self.routed[i].set(entry.get("requests_in_flight", 0))
            if not entry["alive"]:
                self.running[i].set(0)
                self.waiting[i].set(0)

    def record(self, i: int, sched: SchedulerStats) -> None:
        self.running[i].set(sched.num_running_reqs)
        self.waiting[i].set(sched.num_waiting_total)
        self.kv_usage[i].set(sched.kv_cache_usage)
        totals = self._totals[i]
        for key, counter, total in (("queries", self.prefix_queries[i], sched.prefix_cache_queries),
                                    ("hits", self.prefix_hits[i], sched.prefix_cache_hits),
                                    ("preemptions", self.preemptions[i], sched.num_preemptions_total)):
            if total > totals[key]:
                counter.inc(total - totals[key])
                totals[key] = total


class SpecDecodeMetrics:
    """vLLM's SpecDecodingProm counters (vllm/v1/spec_decode/metrics.py), fed with running totals, under each
    prefix in force (vLLM's test_llm_engine.py reads vllm:spec_decode_num_accepted_tokens_per_pos)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str],
                 prefixes: tuple[str, ...] = ("tokenloom",), num_positions: int = 0) -> None:  # fmt: skip
        def counter(name: str, doc: str) -> _Fanout:
            return _Fanout([Counter(f"{p}:{name}", doc, list(labels), registry=registry).labels(**labels)
                            for p in prefixes])

        self.drafts = counter("spec_decode_num_drafts", "Verified drafts (requests x steps with drafts)")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.per_pos = [Counter(f"{p}:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by position in the draft", [*labels, "position"],
                                registry=registry) for p in prefixes]
        self._labels = labels
        self._seen = [0, 0, 0]
        self._seen_pos: list[int] = []
        for _ in range(num_positions):  # the draft positions known up front (K), exported from 0 on
            self._add_position()

    def _add_position(self) -> None:
        self._seen_pos.append(0)
        self._pos(len(self._seen_pos) - 1)  # exported from 0 on

    def _pos(self, pos: int) -> _Fanout:
        return _Fanout([c.labels(**self._labels, position=str(pos)) for c in self.per_pos])

    def record(self, totals) -> None:
        for i, (counter, total) in enumerate(((self.drafts, totals.num_drafts),
                                              (self.draft_tokens, totals.num_draft_tokens),
                                              (self.accepted, totals.num_accepted_tokens))):
            if total > self._seen[i]:
                counter.inc(total - self._seen[i])
                self._seen[i] = total
        for pos, total in enumerate(totals.num_accepted_tokens_per_pos):
            if pos == len(self._seen_pos):
                self._add_position()
            if total > self._seen_pos[pos]:
                self._pos(pos).inc(total - self._seen_pos[pos])
                self._seen_pos[pos] = total
