"""DPEngineCoreClient: N independent engine cores (data parallelism) behind one API process.

It is an AsyncEngineCoreClient (engine/core_client.py), as the single engine's MPClient is, so AsyncLLM and
the server do not change with N:

    AsyncLLM ──add_request(Request)──▶ Router.route ──▶ engine i's pipe   (its owner is recorded)
             ──abort_requests(ids)──────────▶ split by owner ──▶ each owner's pipe
             ◀──EngineCoreOutputs (engine_index = i)── engine i   (its stats feed the router's load view)

Each engine is a full engine core (scheduler, KV cache, runner), as vLLM's dense-model DP ranks are
(`core.py`: "Non-MoE DP ranks are completely independent"); KV options apply per engine. The
machine's cores are split between them (`split_cpus`). An engine that dies fails only the requests
it owned: the router stops choosing it and AsyncLLM fails those requests with the engine's error;
the server stays up until every engine is gone.

With `data_parallel_prefill_engines` N the client is also the disaggregated-serving proxy
(`tokenloom pd-proxy`'s flow, docs/kv_offload.md): engines [0, N) prefill and the others decode, the
SocketConnector between them. A request goes to a prefill engine with max_tokens 1 and
kv_transfer_params {"do_remote_decode": true}; that output is not passed on: when it finishes, the
request goes, with the kv_transfer_params it returned, to a decode engine, whose outputs AsyncLLM sees.
A prefill that fails fails the request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.core.block_hash import DEFAULT_HASH_ALGO
from tokenloom.core.request import Request
from tokenloom.engine.core_client import MPClient
from tokenloom.engine.core_messages import EngineCoreOutputs, EngineCoreRequest, EngineReady, Shutdown
from tokenloom.engine.exceptions import EngineStartError
from tokenloom.engine.kv_connectors import data_parallel_kv_transfer
from tokenloom.router import NoEngineAvailable, Router, RouterConfig

logger = logging.getLogger(__name__)

FailureCallback = Callable[[str, "list[str] | None"], None]


def split_cpus(num_engines: int, cpus: list[int] | None = None) -> list[list[int]]:
    """The usable cores dealt out in contiguous runs, one run per engine. With fewer cores than
    engines, engines share cores (one each, round robin): oversubscribed, and said so in the log."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if num_engines > len(cpus):
        logger.warning("%d data-parallel engines on %d cores: engines share cores", num_engines, len(cpus))
        return [[cpus[i % len(cpus)]] for i in range(num_engines)]
    per = len(cpus) // num_engines
    return [cpus[i * per:(i + 1) * per] for i in range(num_engines)]


class DPEngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        router_config: RouterConfig | None = None,
        log_level: str = "info",
        clients: list[MPClient] | None = None,
        on_close: Callable[[], None] | None = None,
        start_method: str = "forkserver",
    ) -> None:
        """Spawn `data_parallel_size` engine processes on disjoint cores (or adopt `clients`, started
        by another backend such as Ray)."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        self.router_config = router_config or RouterConfig()
        # The engines' block hash, for the router's prefix index (its keys are their block hashes).
        self.hash_algo = config.cache.prefix_caching_hash_algo if config.cache else DEFAULT_HASH_ALGO
        if clients is None:
            cpu_sets = split_cpus(data_parallel_size)
            clients = []
            try:
                for i, cpus in enumerate(cpu_sets):
                    # A disk KV tier per engine: each its own subdirectory (engine/kv_connectors.py).
                    engine_config = data_parallel_kv_transfer(config, i, self.router_config.num_prefill_engines)
                    clients.append(MPClient(engine_config, log_level, engine_index=i, cpus=cpus,
                                           start_method=start_method))
            except BaseException:
                for c in clients:
                    c.shutdown()
                raise
        self.clients = clients
        self._on_close = on_close  # frees what another backend holds (Ray: actors, placement group)
        self.router: Router | None = None
        self._on_outputs: Callable[[EngineCoreOutputs], None] | None = None
        self._on_failure: FailureCallback | None = None
        # Prefill/decode hand-off: the requests whose prefill runs, as AsyncLLM sent them (their decode phase).
        self.num_prefill_engines = self.router_config.num_prefill_engines
        self._prefilling: dict[str, EngineCoreRequest] = {}

    @property
    def data_parallel_size(self) -> int:
        return len(self.clients)

    # Start-up -----------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float | None = None) -> EngineReady:
        """Every engine ready (they load in parallel); returns engine 0's report. Engines must agree."""
        readies = []
        for i, client in enumerate(self.clients):
            try:
                readies.append(client.wait_ready(timeout_s))
            except EngineStartError as exc:
                raise EngineStartError(f"engine {i}: {exc}") from exc
        first = readies[0]
        for i, r in enumerate(readies[1:], 1):
            if (r.block_size, r.max_model_len, r.vocab_size) != (first.block_size, first.max_model_len,
                                                                    first.vocab_size):
                raise EngineStartError(f"engine {i} disagrees with engine 0 on block size, context or vocabulary")
        # The smallest pool decides what a request may need (InputProcessor.check_prompt), as any engine may get it.
        ready = replace(first, num_blocks=min(r.num_blocks for r in readies),
                        load_time_s=max(r.load_time_s for r in readies))
        lora = getattr(ready, "lora", None)
        self.router = Router(self.router_config, len(self.clients), ready.block_size, ready.num_blocks,
                             lora_capacity=lora["max_cpu_loras"] if lora else 0, hash_algo=self.hash_algo)
        return ready

    # Running ------------------------------------------------------------------------------------
    def attach(self, on_outputs: Callable[[EngineCoreOutputs], None], on_failure: FailureCallback) -> None:
        self._on_outputs, self._on_failure = on_outputs, on_failure
        for i, client in enumerate(self.clients):
            client.attach(self._outputs_from, lambda message, i=i: self._engine_failed(i, message))

    def add_request(self, core_request: Request) -> None:
        """To the engine the router picks for it (its owner is recorded, for aborts and the load view)."""
        request = EngineCoreRequest.from_request(core_request)
        router = self.router
        assert router is not None, "wait_ready() first"
        phase = self._prefill_phase if self.num_prefill_engines and request.pooling_params is None else None
        try:
            lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
            # (With prefill engines every request enters at one: a pooling one is served there whole.)
            engine = router.route(request.request_id, request.prompt_token_ids, lora_id,
                                  range(self.num_prefill_engines) if self.num_prefill_engines else None)
        except NoEngineAvailable:
            return  # AsyncLLM has seen every engine die and fails the request itself
        if phase is not None:
            self._prefilling[request.request_id] = request
            request = phase(request)
        self.clients[engine].send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each id to the engine that owns it; ids that finished already are dropped (nothing to free)."""
        router = self.router
        assert router is not None, "wait_ready() first"
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            self._prefilling.pop(rid, None)  # aborted before its decode phase: there is none
            engine = router.finish(rid)
            if engine is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, rids in by_engine.items():
            self.clients[engine].abort_requests(rids)

    @staticmethod
    def _prefill_phase(msg: EngineCoreRequest) -> EngineCoreRequest:
        """The request as the prefill engine gets it (the proxy's first request)."""
        extra = dict(msg.sampling_params.extra_args or {}, kv_transfer_params={"do_remote_decode": True})
        params = replace(msg.sampling_params, max_tokens=1, min_tokens=0, extra_args=extra)
        return replace(msg, sampling_params=params)

    def _hand_over(self, batch: EngineCoreOutputs) -> EngineCoreOutputs:
        """Prefill/decode hand-off: a prefill engine's outputs stop here; a finished prefill sends the request
        on to a decode engine with its kv_transfer_params (a failed one is passed on: the request fails)."""
        router = self.router
        assert router is not None
        kept = []
        for out in batch.outputs:
            original = self._prefilling.get(out.request_id)
            if original is None:
                kept.append(out)
                continue
            if not out.finished:
                continue  # (max_tokens 1: the prefill's one token comes with its finish)
            del self._prefilling[out.request_id]
            router.finish(out.request_id)
            if out.finish_reason in ("error", "abort") or out.kv_transfer_params is None:
                kept.append(out)
                continue
            extra = dict(original.sampling_params.extra_args or {}, kv_transfer_params=out.kv_transfer_params)
            decode_request = replace(original, sampling_params=replace(original.sampling_params, extra_args=extra))
            lora_id = original.lora_request.lora_int_id if original.lora_request is not None else None
            try:
                engine = router.route(original.request_id, original.prompt_token_ids, lora_id,
                                      range(self.num_prefill_engines, len(self.clients)))
            except NoEngineAvailable:
                kept.append(replace(out, new_token_ids=[], finish_reason="error",
                                    error="no decode engine is alive to continue the request"))
                continue
            self.clients[engine].send(decode_request)
        # AsyncLLM counts each request once (sent, then received): decode engines' receipts are the hand-offs.
        received = batch.num_requests_received if batch.engine_index < self.num_prefill_engines else 0
        return replace(batch, outputs=kept, num_requests_received=received)

    def _outputs_from(self, batch: EngineCoreOutputs) -> None:
        router = self.router
        assert router is not None and self._on_outputs is not None
        s = batch.stats
        router.update_load(batch.engine_index, s.num_waiting_reqs, s.num_running_reqs, s.kv_cache_usage)
        if self.num_prefill_engines:
            batch = self._hand_over(batch)
        for out in batch.outputs:
            if out.finished:
                router.finish(out.request_id)
        self._on_outputs(batch)

    def _engine_failed(self, engine: int, message: str) -> None:
        assert self.router is not None and self._on_failure is not None
        lost = self.router.mark_dead(engine)
        for rid in lost:
            self._prefilling.pop(rid, None)
        message = f"data-parallel engine {engine} failed: {message}"
        if self.is_alive:
            logger.error("%s; %d of its requests fail, %d engines still serve", message, len(lost),
                         sum(c.is_alive for c in self.clients))
            self._on_failure(message, lost)
        else:
            self._on_failure(message, None)

    # State --------------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while at least one engine serves."""
        return any(c.is_alive for c in self.clients)

    @property
    def failure(self) -> str | None:
        if self.is_alive:
            return None
        return "; ".join(f"engine {i}: {c.failure}" for i, c in enumerate(self.clients))

    def engine_health(self) -> list[dict[str, Any]]:
        """Per engine: alive (a dead one's error), and the requests the router has sent it and not yet seen
        finish (the count its balance test reads: one that never comes back to 0 when idle is a leak)."""
        loads = self.router.loads if self.router is not None else None
        return [{"engine": i, "alive": c.is_alive, "requests_in_flight": loads[i].num_in_flight if loads else 0}
                | ({} if c.is_alive else {"error": c.failure}) for i, c in enumerate(self.clients)]

    # Stopping -----------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        for client in self.clients:  # ask them all first, so they stop in parallel
            if client.process.is_alive():
                client.send(Shutdown())
        for client in self.clients:
            client.shutdown(timeout_s)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

