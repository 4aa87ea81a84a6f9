"""LLMEngine: the text side over an engine-core client that it steps (vLLM's v1 LLMEngine).

    add_request(text or token ids) → InputProcessor → Request(s) → client.add_request
    step() → client.get_output() → OutputProcessor → RequestOutputs (text, tokens, finish reasons, metrics)

The client is make_client's (engine/clients.py) with asyncio_mode off: an InprocClient (the engine core
built here by EngineCoreHost, engine/core_host.py, and stepped by get_output()) unless the config needs
engine-core processes (data parallelism, engine cores placed by Ray), then a SyncMPClient over them.
`LLM` drives both the same way.

With stats on (`disable_log_stats=False`, vLLM's rule: LLMEngine's default, off by default under `LLM`) each
step also builds an IterationStats, counted by the same helpers as AsyncLLM's (engine/iteration_stats.py),
and hands it to `stat_loggers`: by default the server's Prometheus figures (engine/metrics.py) in a registry of
this engine's own, which `get_metrics()` reads back as vLLM's reader types (engine/metrics_reader.py).

The in-process engine core's parts (scheduler, runner, executor, engine_core, configs) are readable as
attributes of this engine, through the properties below: benchmarks and tests inspect them. They raise
a clear error when the engine core lives in another process.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from tokenloom.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config_from_kwargs
from tokenloom.core.request import Request
from tokenloom.core.structured_output import NO_TOKENIZER_ERROR, GrammarBackend
from tokenloom.engine.clients import make_client, needs_engine_processes
from tokenloom.engine.core_client import SyncEngineCoreClient
from tokenloom.engine.core_host import EngineCoreHost
from tokenloom.engine.generation_config import GenerationDefaults
from tokenloom.engine.inproc_client import InprocClient
from tokenloom.engine.input_processor import (
    NO_TOKENIZER,
    TEXT_PROMPT_WITHOUT_TOKENIZER,
    InputProcessor,
    InvalidRequestError,
    PromptType,
    check_lora_request,
    truncate_prompt_ids,
)
from tokenloom.engine.iteration_stats import (
    IterationStats,
    StatLogger,
    count_new_tokens,
    count_pooled_prompt,
    log_stats,
    record_finished,
)
from tokenloom.engine.metrics import PrometheusMetrics
from tokenloom.engine.metrics_reader import Metric, get_metrics_snapshot
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.outputs import RequestOutput
from tokenloom.engine.parallel_sampling import fan_out
from tokenloom.engine.pooling import prepare_pooling_params
from tokenloom.engine.sleep import PauseMode, SleepState
from tokenloom.engine.tokenize_params import TokenizeParams
from tokenloom.exceptions import ValidationError
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _in_process(name: str, what: str) -> property:
    """A read-only view of the in-process engine core's `name` (EngineCoreHost's attribute)."""

    def get(self: LLMEngine) -> Any:
        return getattr(self.core_host(f"LLMEngine.{name}"), name)

    return property(get, doc=f"{what} (the in-process engine core's; an error with engine-core processes).")


class LLMEngine:
    """The front end (InputProcessor in, OutputProcessor out) over a SyncEngineCoreClient (self.client)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 multiprocess_mode: bool | None = None, log_level: str = "warning",
                 max_logprobs: int = 20) -> None:  # fmt: skip
        """`multiprocess_mode`: run the engine core(s) in processes of their own (None: only where the config
        needs it, data parallelism or engine cores placed by Ray). `clock`: the in-process scheduler's.
        `max_logprobs`: vLLM's engine argument, the most logprobs / prompt_logprobs a request may ask for (-1:
        the whole vocabulary); the server's --max-logprobs is its own option, checked where it parses requests."""
        self.max_logprobs = max_logprobs
        # Beam search compiles its grammar in this process (grammar_backend) whether or not the engine core is.
        self.structured_outputs_config = config.structured_outputs_config
        self._grammar_backend: Any = None
        if multiprocess_mode is None:
            multiprocess_mode = needs_engine_processes(config)
        client: Any = make_client(config, log_level, multiprocess_mode=multiprocess_mode, asyncio_mode=False,
                                  clock=clock)
        self.client: SyncEngineCoreClient = client
        try:
            if isinstance(client, InprocClient):
                self.tokenizer = client.host.tokenizer
                self.generation_defaults = client.host.generation_defaults
            elif config.skip_tokenizer_init:  # vLLM's: token ids in and out, no tokenizer anywhere
                self.tokenizer = None
            else:  # load the tokenizer here while the engine processes load the model
                from tokenloom.model.tokenizer import load_tokenizer

                self.tokenizer = load_tokenizer(config.tokenizer_source)
            ready = client.engine_ready()
        except BaseException:
            client.shutdown()
            raise
        if not isinstance(client, InprocClient):
            # The engines' generation_config defaults (their extra EOS ids join every request's stop ids).
            self.generation_defaults = GenerationDefaults(dict(ready.sampling_defaults),
                                                          list(ready.extra_eos_token_ids))
        self.model_name = ready.model_name
        self.eos_token_id = ready.eos_token_id
        self.pooling_info = ready.pooling
        self.input_processor = InputProcessor(self.tokenizer, ready)
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        self._ids = itertools.count()
        # Metrics (vLLM's log_stats): only with stats on, so the default LLM pays nothing for them.
        self.log_stats = not config.disable_log_stats
        self.stat_loggers: list[StatLogger] = []
        self.metrics: PrometheusMetrics | None = None
        if self.log_stats:
            # vLLM's names only: get_metrics() reads `vllm:` figures, as vLLM's reader does.
            self.metrics = PrometheusMetrics(self.model_name, ready.num_blocks, prefix="vllm", info=ready)
            self.stat_loggers.append(self.metrics.record)
        # LLM.sleep() / wake_up() without sleep mode (engine/sleep.py): the pause, the requests added meanwhile
        # (sent to the engine core on wake-up), and outputs made while sleep() drained or aborted requests (the
        # next step() returns them).
        self._sleep = SleepState(str(ready.device).split(":")[0])
        self._held: list[Request] = []
        self._pending_outputs: list[RequestOutput] = []
        self._stat_parents: dict[str, list[Request]] = {}  # request id -> its core requests, while unfinished
        self._stat_cores: dict[str, Request] = {}  # core request id -> Request, until its finish is counted
        self._token_times: dict[str, float] = {}  # core request id -> when its latest counted tokens came

    @classmethod
    def from_args(cls, model: str | None = None, max_logprobs: int = 20, **kwargs: Any) -> LLMEngine:
        return cls(engine_config_from_kwargs(model=model, **kwargs), max_logprobs=max_logprobs)

    @classmethod
    def from_engine_args(cls, engine_args: Any, usage_context: Any = None, stat_loggers: Any = None,
                         enable_multiprocessing: bool = False) -> LLMEngine:
        """vLLM's LLMEngine.from_engine_args(EngineArgs(...)) (tokenloom/engine/args.py). vLLM's other arguments
        change nothing here: the engine core runs in this process unless the config needs processes."""
        if stat_loggers:
            raise ValueError("stat_loggers: vLLM's stat logger classes do not apply to tokenloom's LLMEngine "
                             "(its RequestOutputs carry each request's metrics)")
        return cls(engine_args.create_engine_config())

    # The in-process engine core ---------------------------------------------------------------------
    def core_host(self, what: str = "this") -> EngineCoreHost:
        """The EngineCoreHost the InprocClient owns; RuntimeError naming `what` when the engine core runs in
        another process (its scheduler, runner and KV cache are not in this one)."""
        if not isinstance(self.client, InprocClient):
            raise RuntimeError(f"{what} needs the engine core in this process; this LLMEngine's engine cores run in "
                               "engine-core processes (data parallelism, Ray or multiprocess_mode=True)")
        return self.client.host

    scheduler = _in_process("scheduler", "The Scheduler")
    engine_core = _in_process("engine_core", "The EngineCore (schedule, execute, update)")
    executor = _in_process("executor", "The Executor the engine core steps")
    runner = _in_process("runner", "The ModelRunner (None with tensor/pipeline-parallel workers)")
    config = _in_process("config", "The EngineConfig in force (quantization resolved)")
    model_config = _in_process("model_config", "The model's config")
    scheduler_config = _in_process("scheduler_config", "The SchedulerConfig in force (max_model_len resolved)")
    cache_config = _in_process("cache_config", "The CacheConfig in force (num_blocks sized)")
    speculative_config = _in_process("speculative_config", "The SpeculativeConfig, or None")
    lora_config = _in_process("lora_config", "The LoRAConfig, or None")
    kv_connector = _in_process("kv_connector", "The KV connector's scheduler side, or None")
    structured_output_manager = _in_process("structured_output_manager", "The grammars of structured outputs")
    tracer = _in_process("tracer", "The StepTracer (--trace-steps), or None")
    runner_type = _in_process("runner_type", "'generate' or 'pooling'")
    dtype = _in_process("dtype", "The model's torch dtype")
    device = _in_process("device", "The torch device the model runs on")
    kv_cache_held = _in_process("kv_cache_held", "(block_size, num_blocks) the runner allocated")
    _model_thread = _in_process("_model_thread", "The thread that owns the model under async scheduling, or None")

    def engine_ready(self, load_time_s: float = 0.0) -> Any:
        """What the in-process engine core is (EngineCoreHost.engine_ready)."""
        return self.core_host("LLMEngine.engine_ready").engine_ready(load_time_s)

    @property
    def clock(self) -> Callable[[], float]:
        """Arrival times' clock: the in-process scheduler's, else time.monotonic (every process's one clock)."""
        return self.client.host.clock if isinstance(self.client, InprocClient) else time.monotonic

    # vLLM's LLMEngine.add_lora / remove_lora / list_loras.
    def add_lora(self, lora_request: Any) -> bool:
        check_lora_request(lora_request, self.input_processor.info.lora)
        return self.client.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.client.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.client.list_loras()

    # Requests in ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> str:
        """Queue a request. Raises ValueError (incl. RequestRejected) with a clear message for bad input.
        `lora_request`: a tokenloom.lora.request.LoRARequest (the adapter to run it with), or None."""
        self.input_processor.check_generation_model()
        params = self.generation_defaults.apply_eos(params or self.generation_defaults.sampling_params())
        if params.structured_outputs is not None:
            from tokenloom.model.grammar import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs, self.structured_outputs_config)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.input_processor.tokenize(prompt)
        token_ids = truncate_prompt_ids(token_ids, params.truncate_prompt_tokens,
                                        self.input_processor.info.max_model_len)
        self.input_processor.check_prompt(token_ids, params, max_tokens_in_context=False)
        self.input_processor.check_logprobs(params, self.max_logprobs)
        params = self.input_processor.process_params(params, len(token_ids))
        arrival = self.clock() if arrival_time is None else arrival_time
        if lora_request is not None:
            check_lora_request(lora_request, self.input_processor.info.lora)
        cores = fan_out(request_id, token_ids, params, self.eos_token_id, arrival, priority, lora_request)
        added = []
        try:
            for core in cores:
                self._submit(core)
                added.append(core.request_id)
        except ValueError:
            self._abort_cores(added)
            raise
        self.output_processor.add_request(request_id, text, token_ids, cores, arrival)
        self._track(request_id, cores)
        return request_id

    def _submit(self, core: Request) -> None:
        """Send a core request to the engine core, or hold it while the engine sleeps (vLLM queues adds then)."""
        if self._sleep.paused:
            self._held.append(core)
        else:
            self.client.add_request(core)

    def _abort_cores(self, core_ids: list[str]) -> None:
        held = {c.request_id for c in self._held} & set(core_ids)
        if held:
            self._held = [c for c in self._held if c.request_id not in held]
        rest = [i for i in core_ids if i not in held]
        if rest:
            self.client.abort_requests(rest)

    def _track(self, request_id: str, cores: list[Request]) -> None:
        """Keep `cores` for the metrics: the engine writes their timestamps (the scheduler in process, the
        SyncMPClient's mirrors across processes), which the figures are counted from."""
        if self.log_stats:
            self._stat_parents[request_id] = cores
            self._stat_cores.update((core.request_id, core) for core in cores)

    def add_pooling_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Queue a pooling request (params.task: embed, classify, token_embed, token_classify; None: the model's
        pooling task); it finishes with a PoolingRequestOutput once its prompt is computed. The prompt is
        truncated and bounded as `tokenization_kwargs` (vLLM's) and params.truncate_prompt_tokens say
        (tokenize_params). ValueError for bad input."""
        if not isinstance(self.client, InprocClient):
            raise ValueError("pooling models run on one engine in this process: data_parallel_size > 1 (engine-core "
                             "processes) is not supported with them")
        self.input_processor.check_pooling_model()
        params = prepare_pooling_params(params, self.pooling_info)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        tok_params = self.tokenize_params(params.truncate_prompt_tokens, tokenization_kwargs)
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if text is not None and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            if self.tokenizer is None:
                raise InvalidRequestError(TEXT_PROMPT_WITHOUT_TOKENIZER, "prompt")
            if not isinstance(text, str):
                raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
            token_ids = tok_params.encode_text(self.tokenizer, text)
        else:
            text, token_ids = self.input_processor.tokenize(prompt)
            token_ids = tok_params.validate_tokens(self.tokenizer, token_ids)
        arrival = self.clock() if arrival_time is None else arrival_time
        core = Request(request_id, token_ids, None, arrival_time=arrival, priority=priority, pooling_params=params)
        self._submit(core)
        self.output_processor.add_request(request_id, text, token_ids, [core], arrival)
        self._track(request_id, [core])
        return request_id

    def tokenize_params(self, truncate_prompt_tokens: int | None = None,
                        tokenization_kwargs: dict[str, Any] | None = None) -> TokenizeParams:
        """How a pooling prompt is tokenized here (vLLM's TokenizeParams within max_model_len): its
        tokenization_kwargs, truncate_prompt_tokens (tokenloom's) where they do not say."""
        kwargs = dict(tokenization_kwargs or {})
        if truncate_prompt_tokens is not None:
            kwargs.setdefault("truncate_prompt_tokens", truncate_prompt_tokens)
        return TokenizeParams.from_kwargs(self.input_processor.info.max_model_len, kwargs)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        results = []
        for rid in ids:
            core_ids = self.output_processor.core_ids(rid)
            self._abort_cores(core_ids)
            out = self.output_processor.finish_aborted(rid)
            if out is not None:
                results.append(out)
        if results and self.log_stats:  # aborts count as vLLM's request_success{finished_reason="abort"}
            stats = IterationStats(self.clock())
            self._record_finished(results, stats)
            log_stats(self.stat_loggers, stats)
        return results

    # The step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step's outputs (vLLM's). While the engine sleeps (sleep()), no step runs: the outputs its
        sleep() made come first, then none until wake_up()."""
        if self._pending_outputs:
            outputs, self._pending_outputs = self._pending_outputs, []
            return outputs
        if self._sleep.paused:
            return []
        return self._step()

    def _step(self) -> list[RequestOutput]:
        core_outputs = self.client.get_output()
        stats = self._count_outputs(core_outputs) if self.log_stats else None
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:  # a stop string ended these: free their blocks now
            self.client.abort_requests(to_abort)
        if stats is not None:
            self._record_finished(outputs, stats)
            log_stats(self.stat_loggers, stats)
            for step in self.client.steps[1:]:  # batches of several engine steps (engine processes)
                log_stats(self.stat_loggers, IterationStats(stats.timestamp, step=step))
        return outputs

    # Metrics (stats on) ------------------------------------------------------------------------------
    def _count_outputs(self, core_outputs: list[Any]) -> IterationStats:
        """The step's IterationStats: the scheduler's report and step figures, and the tokens of `core_outputs`
        counted as AsyncLLM counts them (count_new_tokens), at the times the engine stamped on the Requests."""
        steps = self.client.steps
        stats = IterationStats(self.clock(), self.client.scheduler_stats, steps[0] if steps else None)
        for out in core_outputs:
            core = self._stat_cores.get(out.request_id)
            if core is None:  # finished here already (stop string, abort): late tokens are not counted
                continue
            if out.new_token_ids:
                ts = core.last_token_time or stats.timestamp
                count_new_tokens(stats, core, len(out.new_token_ids), ts, self._token_times.get(out.request_id))
                self._token_times[out.request_id] = ts
            if out.finished and core.pooling_params is not None and out.finish_reason == "stop":
                count_pooled_prompt(stats, core)
        return stats

    def _record_finished(self, outputs: list[Any], stats: IterationStats) -> None:
        for out in outputs:
            cores = self._stat_parents.get(out.request_id)
            if cores is None:
                continue
            record_finished(out, cores, stats, self._take)
            if out.finished:
                del self._stat_parents[out.request_id]

    def _take(self, core: Request) -> bool:
        """True the first time `core`'s finish is counted (record_finished's guard)."""
        self._token_times.pop(core.request_id, None)
        return self._stat_cores.pop(core.request_id, None) is not None

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLMEngine.get_metrics(): this engine's Prometheus figures as vLLM's reader types (Counter,
        Gauge, Histogram, Vector). vLLM asserts stats are on; so does this."""
        if self.metrics is None:
            raise AssertionError("Stat logging disabled: build the engine with disable_log_stats=False "
                                 "(the LLM's default is True, as vLLM's)")
        return get_metrics_snapshot(self.metrics.registry)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished() > 0 or self.client.has_unfinished_requests()

    # vLLM's LLMEngine getters.
    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished (a request with n > 1 counts once)."""
        return self.output_processor.num_unfinished()

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer; vLLM's ValueError when it was built with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValidationError(NO_TOKENIZER, parameter="skip_tokenizer_init", value=True)
        return self.tokenizer

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output grammar backend for grammars used in this process (beam search's): the in-process
        engine core's own (StructuredOutputManager.get_backend(): its vocabulary table is built once, and xgrammar's
        compile cache is shared), else one built here as the engine cores build theirs, once."""
        if self.tokenizer is None:  # skip_tokenizer_init: a grammar is compiled against the vocabulary
            raise ValueError(NO_TOKENIZER_ERROR)
        if isinstance(self.client, InprocClient):
            return self.client.host.structured_output_manager.get_backend()
        if self._grammar_backend is None:
            from tokenloom.model.grammar import make_xgrammar_backend

            self._grammar_backend = make_xgrammar_backend(self.tokenizer, self.input_processor.info.vocab_size,
                                                          self.structured_outputs_config)
        return self._grammar_backend

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: drop every cached prefix block. False when blocks are still in use by requests, unless
        `reset_running_requests` (they are then preempted and recompute). `reset_connector`: the KV connector's
        cache too (a connector without a reset counts as reset, as in vLLM). The engine core must run in this
        process (the server's engine processes are reset through their own API)."""
        # With a step in flight (async scheduling) the scheduler drops its late output for the requests the
        # reset preempted (the next step may resume them and sample those positions again), and the worker
        # runs steps in order (as abort relies on).
        return self.core_host("reset_prefix_cache").scheduler.reset_prefix_cache(reset_running_requests,
                                                                                 reset_connector)

    # Sleep (vLLM's, without sleep mode: engine/sleep.py) -------------------------------------------------
    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """vLLM's LLMEngine.sleep on a platform without sleep mode: scheduling pauses (requests added meanwhile
        wait); `mode` abort ends every unfinished request now, wait lets the running ones finish first (the next
        step() calls return their outputs), keep leaves them paused; level >= 1 also drops the prefix cache
        (running requests recompute) and puts the executor's weights / kv_cache tags to sleep, freeing nothing
        ("sleep mode is not supported on CPU, ignore it.", vLLM's CPU worker's warning)."""
        SleepState.check(level, mode)
        self._sleep.paused = True  # adds from here on are held (vLLM's PAUSED_NEW / PAUSED_ALL)
        if mode == "abort":
            self._pending_outputs += self.abort_request(self.output_processor.request_ids())
        elif mode == "wait":
            while self.client.has_unfinished_requests():
                self._pending_outputs += self._step()
        self._sleep.fall_asleep(level)
        if level >= 1:
            self._clear_caches()

    def _clear_caches(self) -> None:
        """vLLM's _reset_caches on sleep: the prefix cache (running requests preempted) and the KV connector's."""
        if not isinstance(self.client, InprocClient):  # engine processes keep theirs (no reset across processes)
            logger.info("sleep: the engine cores run in their own processes; their prefix caches are kept")
            return
        if not self.client.host.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            raise RuntimeError("Failed to reset the KV connector cache.")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: wake the executor's tags (all with None; "scheduling" resumes a level-0 pause) and, once none
        sleeps, resume scheduling with the requests added meanwhile. Returns whether the engine is fully awake."""
        fully_awake = self._sleep.wake_up(tags)
        if fully_awake and self._held:
            held, self._held = self._held, []
            for core in held:
                self.client.add_request(core)
        return fully_awake

    def is_sleeping(self) -> bool:
        """vLLM's: paused at any level, or the executor's tags asleep."""
        return self._sleep.is_sleeping

    def reset_scheduler(
        self,
        scheduler_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """A fresh scheduler (new knobs, empty prefix cache) over the same loaded model, for
        benchmarks that compare configurations side by side without reloading weights."""
        host = self.core_host("LLMEngine.reset_scheduler")
        if self.output_processor.num_unfinished() == 0 and not host.scheduler.has_unfinished_requests():
            host.engine_core.drain()  # async scheduling: a trailing step may still be in flight
        if self.has_unfinished_requests():
            raise RuntimeError("reset_scheduler needs an idle engine")
        host.reset_scheduler(scheduler_config, cache_config, clock)
        self.input_processor = InputProcessor(self.tokenizer, self.client.engine_ready())  # the new limits

    def close(self) -> None:
        """Stop the engine core(s): the in-process core's threads, or the engine processes."""
        self.client.shutdown()
