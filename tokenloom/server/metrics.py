"""Prometheus figures, named like vLLM's (`vllm:x` → `tokenloom:x`) so existing dashboards carry over.

Fed by AsyncLLM's IterationStats: one per batch from the engine (scheduler gauges, step figures,
tokens, latencies) and one per abort. Counters from the engine (preemptions, prefix-cache queries
and hits) arrive as running totals and are added as differences. A private registry keeps several
servers in one process (tests) apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenloom.engine.iteration_stats import IterationStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms compare bucket for bucket.
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0]
_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_STEP = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
_IPC = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, model_name: str, num_blocks: int) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenloom:{name}", doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenloom:{name}", doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"tokenloom:{name}", doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (1 = full)")
        self.free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks free (cached-but-unused included)")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool")
        self.total_blocks.set(num_blocks)
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix-cache queries, in tokens")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens")
        self.preemptions = counter("num_preemptions", "Preemptions (requests sent back to waiting)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced their first token")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        success = Counter("tokenloom:request_success", "Finished requests, by finish reason",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name=model_name, finished_reason=reason)
                        for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _TTFT)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request", _ITL)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _LATENCY)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled", _LATENCY)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests", _TOKENS)
        self.gen_len = histogram("request_generation_tokens", "Generated tokens of finished requests", _TOKENS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens scheduled per engine step", _TOKENS)
        self.step_time = histogram("engine_step_duration_seconds", "Engine step: schedule + forward + update",
                                   _STEP)
        self.ipc_latency = histogram("engine_ipc_latency_seconds",
                                     "A step's outputs: built in the engine process → received by the API", _IPC)
        self._totals = {"preemptions": 0, "queries": 0, "hits": 0}
        self._labels = labels
        self.spec_decode: SpecDecodeMetrics | None = None  # created with the first speculative figures

    def record(self, stats: IterationStats) -> None:
        sched = stats.scheduler
        if sched is not None:
            self.running.set(sched.num_running_reqs)
            self.waiting.set(sched.num_waiting_reqs)
            self.kv_usage.set(sched.kv_cache_usage)
            self.free_blocks.set(sched.num_free_blocks)
            self._add_total(self.preemptions, "preemptions", sched.num_preemptions_total)
            self._add_total(self.prefix_queries, "queries", sched.prefix_cache_queries)
            self._add_total(self.prefix_hits, "hits", sched.prefix_cache_hits)
            if sched.prefix_cache_queries:
                self.hit_rate.set(sched.prefix_cache_hits / sched.prefix_cache_queries)
            if sched.spec_decoding is not None:
                if self.spec_decode is None:
                    self.spec_decode = SpecDecodeMetrics(self.registry, self._labels)
                self.spec_decode.record(sched.spec_decoding)
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

    def _add_total(self, counter: Counter, key: str, total: int) -> None:
        if total > self._totals[key]:
            counter.inc(total - self._totals[key])
            self._totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpecDecodeMetrics:
    """vLLM's SpecDecodingProm counters (vllm/v1/spec_decode/metrics.py), fed with running totals."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenloom:{name}", doc, list(labels), registry=registry).labels(**labels)

        self.drafts = counter("spec_decode_num_drafts", "Verified drafts (requests x steps with drafts)")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.per_pos = Counter("tokenloom:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft", [*labels, "position"],
                               registry=registry)
        self._labels = labels
        self._seen = [0, 0, 0]
        self._seen_pos: list[int] = []

    def record(self, totals) -> None:
        for i, (counter, total) in enumerate(((self.drafts, totals.num_drafts),
                                              (self.draft_tokens, totals.num_draft_tokens),
                                              (self.accepted, totals.num_accepted_tokens))):
            if total > self._seen[i]:
                counter.inc(total - self._seen[i])
                self._seen[i] = total
        for pos, total in enumerate(totals.num_accepted_tokens_per_pos):
            if pos == len(self._seen_pos):
                self._seen_pos.append(0)
                self.per_pos.labels(**self._labels, position=str(pos))  # exported from 0 on
            if total > self._seen_pos[pos]:
                self.per_pos.labels(**self._labels, position=str(pos)).inc(total - self._seen_pos[pos])
                self._seen_pos[pos] = total
