"""AsyncLLM: the engine for an asyncio server, with the engine core in its own process.

    API process (this)                                   engine-core process (core_proc.py)
    tokenizer, validation ──EngineCoreRequest/Abort──▶   Scheduler + ModelRunner, stepping
    OutputProcessor (text, stop strings, logprobs) ◀──EngineCoreOutputs──  (token ids, stats)
    per-request asyncio queues → HTTP handlers

`add_request` validates and enqueues at once (errors raise before any response is started), and
returns nothing to await: outputs arrive on a RequestStream, which can carry several requests (a
batch of prompts) and aborts whatever is unfinished when closed — that is how a client that goes
away frees its KV blocks. The engine's per-request timestamps come back with the outputs and are
written into local mirror Requests (engine/request_mirrors.py), so the OutputProcessor works exactly as in
LLMEngine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from tokenloom.core.request import Request
from tokenloom.core.scheduler import SchedulerStats
from tokenloom.engine.core_client import AsyncEngineCoreClient
from tokenloom.engine.core_messages import EngineCoreOutputs, EngineReady
from tokenloom.engine.engine_stats import sum_engine_stats
from tokenloom.engine.exceptions import EngineDeadError, EngineGenerateError
from tokenloom.engine.generation_config import GenerationDefaults
from tokenloom.engine.input_processor import (
    NO_TOKENIZER,
    InputProcessor,
    InvalidRequestError,
    check_lora_request,
    truncate_prompt_ids,
)
from tokenloom.engine.iteration_stats import IterationStats, StatLogger, log_stats, record_finished
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.outputs import RequestOutput
from tokenloom.engine.parallel_sampling import fan_out
from tokenloom.engine.request_mirrors import update_mirrors
from tokenloom.exceptions import ValidationError
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # the tokenizer module imports torch; the API process loads it only with the tokenizer
    from tokenloom.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)



class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (--max-waiting-requests); try again later."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class RequestStream:
    """Outputs of one or more requests, in the order they are produced; iterate until all finish.

    `merge_kind` (AsyncLLM.generate's stream): vLLM's RequestOutputCollector. An output that arrives while
    an earlier one of the same request is still unread is merged into it (RequestOutput.add, aggregating
    DELTA outputs), so a consumer that falls behind reads one output with everything new, and with n > 1 the
    children that progressed in one engine step come together. The server's streams (None) hand over every
    output as it was made."""

    def __init__(self, engine: AsyncLLM, merge_kind: RequestOutputKind | None = None) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.pending: set[str] = set()
        self._merge_kind = merge_kind
        self._unread: dict[str, RequestOutput] = {}  # request id -> its output in the queue, not read yet

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self._merge_kind is not None and isinstance(item, RequestOutput):
            unread = self._unread.get(item.request_id)
            if unread is not None:
                unread.add(item, aggregate=self._merge_kind is RequestOutputKind.DELTA)
                return
            self._unread[item.request_id] = item
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.pending:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if self._unread.get(item.request_id) is item:
            del self._unread[item.request_id]
        if item.finished:
            self.pending.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort every request of the stream that has not finished (idempotent)."""
        for request_id in list(self.pending):
            self._engine.abort_request(request_id)
        self.pending.clear()


def _weak_callback(method: Callable[..., None]) -> Callable[..., None]:
    """`method` called through a weak reference to its object: a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class _Tracked:
    __slots__ = ("stream", "cores")

    def __init__(self, stream: RequestStream, cores: list[Request]) -> None:
        self.stream = stream
        self.cores = cores


class AsyncLLM:
    def __init__(
        self,
        client: AsyncEngineCoreClient,
        ready: EngineReady,
        tokenizer: Tokenizer | None,
        max_waiting_requests: int | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`tokenizer` None: built with skip_tokenizer_init (token-id prompts, token-id outputs).
        `stream_interval`: the engine's --stream-interval (the OutputProcessor's)."""
        self.client = client
        self.info = ready
        self.tokenizer = tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.output_processor = OutputProcessor(tokenizer, stream_interval)
        self.input_processor = InputProcessor(tokenizer, ready)
        # The engines' generation_config defaults, as LLMEngine holds them for engine processes.
        self.generation_defaults = GenerationDefaults(dict(getattr(ready, "sampling_defaults", None) or {}),
                                                      list(getattr(ready, "extra_eos_token_ids", None) or []))
        self.stat_loggers: list[StatLogger] = []
        # Called once the engine process is found dead, after every request in flight was failed
        # (the server uses it to exit, as vLLM's does).
        self.failure_listeners: list[Callable[[str], None]] = []
        self.accepting = True
        self.scheduler_stats: SchedulerStats | None = None  # every engine's last report, summed
        self._engine_stats: dict[int, SchedulerStats] = {}  # data-parallel rank -> its last report
        self._requests: dict[str, _Tracked] = {}
        self._mirrors: dict[str, Request] = {}  # core request id -> local mirror, while unfinished
        self._num_sent = 0  # core requests sent to the engines
        self._num_received: dict[int, int] = {}  # ... of which each engine had seen, as of its last batch
        self._attached = False

    @classmethod
    def from_client(
        cls,
        client: AsyncEngineCoreClient,
        tokenizer_source: str | None,
        max_waiting_requests: int | None = None,
        ready_timeout_s: float | None = None,
        skip_tokenizer_init: bool = False,
        stream_interval: int = 1,
    ) -> AsyncLLM:
        """Load the tokenizer here (from `tokenizer_source`, EngineConfig.tokenizer_source: the model, or the
        tokenizer given apart; none with `skip_tokenizer_init`) while the (already spawned) engine process
        loads the model, then wait for the engine to be ready: as long as it makes progress, a stall of at most
        `ready_timeout_s` (default $TOKENLOOM_ENGINE_READY_TIMEOUT; MPClient.wait_ready). Stops the engine process
        if anything fails."""
        from tokenloom.model.tokenizer import load_tokenizer

        try:
            tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer_source)
            ready = client.wait_ready(ready_timeout_s)
        except BaseException:
            client.shutdown()
            raise
        return cls(client, ready, tokenizer, max_waiting_requests, stream_interval)

    def attach(self) -> None:
        """Start receiving engine outputs; call from the running event loop. The client calls back through weak
        references: it (and the event loop's reader) must not keep this engine alive, so that dropping the last
        reference to it stops the engine process (__del__, as vLLM's AsyncLLM)."""
        self.client.attach(_weak_callback(self._on_outputs), _weak_callback(self._on_engine_failure))
        self._attached = True

    def shutdown(self) -> None:
        self.accepting = False
        self.client.shutdown()

    def __del__(self) -> None:
        # vLLM's: an engine dropped without shutdown() still stops its engine process (which holds the model).
        if getattr(self, "client", None) is not None:
            self.shutdown()

    # State ----------------------------------------------------------------------------------------
    @property
    def dead_reason(self) -> str | None:
        """Why nothing can be served (with data parallelism: why every engine is gone), or None."""
        return self.client.failure

    @property
    def num_waiting(self) -> int:
        """Core requests waiting in the engine, counting those still in the pipe."""
        waiting = self.scheduler_stats.num_waiting_total if self.scheduler_stats else 0
        return waiting + self._num_sent - sum(self._num_received.values())

    @property
    def data_parallel_size(self) -> int:
        return self.client.data_parallel_size

    def engine_health(self) -> list[dict] | None:
        """Per data-parallel engine: alive, and the error of a dead one (None without data parallelism)."""
        return self.client.engine_health()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # Requests in ----------------------------------------------------------------------------------
    def open_stream(self, merge_kind: RequestOutputKind | None = None) -> RequestStream:
        return RequestStream(self, merge_kind)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: RequestStream,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: Any = None,
        max_tokens_in_context: bool = True,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Validate and enqueue; raises InvalidRequestError, EngineOverloadedError, EngineDeadError or
        EngineDrainingError before anything is sent. Outputs arrive on `stream`. `lora_request`: the
        LoRA adapter to run it with (tokenloom.lora.request.LoRARequest), or None. `max_tokens_in_context`:
        refuse a max_tokens past the context, as vLLM's serving layer (the server); False lets the request
        stop at max_model_len ("length"), as vLLM's engine does for AsyncLLM.generate and LLM.
        `reasoning_ended` / `reasoning_parser_kwargs` (vLLM's EngineCoreRequest fields): whether the prompt already
        ended the reasoning, so a grammar applies from the first token (None: the engine's reasoning parser reads
        the prompt), and the request's parser's arguments (its chat_template_kwargs)."""
        self._check_can_take(request_id)
        self.input_processor.check_generation_model()
        prompt_token_ids = truncate_prompt_ids(prompt_token_ids, params.truncate_prompt_tokens, self.info.max_model_len)
        self.input_processor.check_prompt(prompt_token_ids, params, max_tokens_in_context=max_tokens_in_context)
        params = self.input_processor.process_params(params, len(prompt_token_ids))
        self.check_admission(params.n)
        arrival = time.monotonic()
        params = self.generation_defaults.apply_eos(params)  # the model's generation_config EOS ids (as vLLM)
        if lora_request is not None:
            check_lora_request(lora_request, self.info.lora)
        cores = fan_out(request_id, prompt_token_ids, params, self.info.eos_token_id, arrival, priority, lora_request,
                        reasoning_ended=reasoning_ended, reasoning_parser_kwargs=reasoning_parser_kwargs)
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, cores, arrival)
        self._requests[request_id] = _Tracked(stream, cores)
        stream.pending.add(request_id)
        for core in cores:
            self._mirrors[core.request_id] = core
            self.client.add_request(core)
        self._num_sent += len(cores)

    def _check_can_take(self, request_id: str) -> None:
        """What every new request needs, generation or pooling: a live engine that still accepts work,
        and an id not in use."""
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(reason)
        if not self.accepting:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        stream: RequestStream,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        """A pooling request (params verified, the task set: engine/pooling.py prepare_pooling_params);
        its PoolingRequestOutput arrives on `stream`. Raises as add_request does."""
        self._check_can_take(request_id)
        self.input_processor.check_pooling_model()
        self.input_processor.check_token_ids(prompt_token_ids, "input")
        # Admission (--max-waiting-requests) is checked once per batch by the caller (check_admission).
        arrival = time.monotonic()
        core = Request(request_id, prompt_token_ids, None, arrival_time=arrival, priority=priority,
                       pooling_params=params)
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, [core], arrival)
        self._requests[request_id] = _Tracked(stream, [core])
        stream.pending.add(request_id)
        self._mirrors[core.request_id] = core
        self.client.add_request(core)
        self._num_sent += 1

    def check_admission(self, num_sequences: int) -> None:
        """Whether `num_sequences` more sequences (a request's n, times its prompts for a batch) may wait:
        a request larger than the whole limit can never be admitted (InvalidRequestError, 400: retrying
        cannot help); one that does not fit now is EngineOverloadedError (429, retry later). A batch
        checks once before adding any, so it is never half admitted."""
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_sequences > limit:
            raise InvalidRequestError(
                f"the request asks for {num_sequences} sequences (prompts x n), more than the server lets wait "
                f"at once ({limit}, --max-waiting-requests): split it into smaller requests", "n"
            )
        if self.num_waiting + num_sequences > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting} requests are waiting "
                f"(limit {limit}); retry later"
            )

    # vLLM's public API: from_engine_args, generate, abort, check_health ------------------------------
    @classmethod
    def from_engine_args(cls, engine_args: Any, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: list[StatLogger] | None = None, **_: Any) -> AsyncLLM:
        """vLLM's AsyncLLM.from_engine_args(AsyncEngineArgs(...)): start the engine core in its process (as
        `tokenloom serve` does: tokenloom/engine/clients.py's make_client) and wait until it is ready.
        `stat_loggers`: callables given each IterationStats (tokenloom's loggers, not vLLM's classes);
        `start_engine_loop` and `usage_context` are vLLM's and change nothing here (outputs are received
        from the first `generate` on, in its event loop)."""
        from tokenloom.engine.clients import make_client

        config = engine_args.create_engine_config()
        engine = cls.from_client(make_client(config), config.tokenizer_source,
                                 skip_tokenizer_init=config.skip_tokenizer_init, stream_interval=config.stream_interval)
        engine.stat_loggers.extend(stat_loggers or [])
        return engine

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request: Any = None, priority: int = 0,
                       reasoning_ended: bool | None = None, reasoning_parser_kwargs: dict[str, Any] | None = None,
                       **_: Any) -> AsyncGenerator[RequestOutput, None]:  # fmt: skip
        """vLLM's AsyncLLM.generate: one request's RequestOutputs as they come (as `sampling_params.output_kind`
        says: every step's cumulative state, only what is new, or the final one), until it finishes. With n > 1,
        a streamed output carries the children that progressed since the last one read (their `index` says
        which), a finished child is not sent again, and `finished` comes once the last child is done;
        FINAL_ONLY gives all n in one output. The
        prompt is text, token ids or vLLM's prompt dict; a bad request raises here, before any output.
        Leaving the loop early (break, cancellation) aborts the request and frees its KV blocks.
        `reasoning_ended` / `reasoning_parser_kwargs`: vLLM's, for structured outputs behind a reasoning parser
        (add_request). vLLM's other keywords (trace_headers, data_parallel_rank, ...) are accepted and ignored.
        Errors, as vLLM's: the request's own (a ValueError or TypeError: VLLMValidationError and the other refusals),
        EngineDeadError and the admission errors (overloaded, draining) as they are; anything else aborts the request
        and raises EngineGenerateError from it, the engine going on."""
        stream: RequestStream | None = None
        try:
            self._receive_outputs()
            if request_id is None:
                request_id = uuid.uuid4().hex
            if sampling_params is None:  # the model's generation_config defaults, as the server's
                sampling_params = self.generation_defaults.sampling_params()
            if sampling_params.structured_outputs is not None:
                from tokenloom.model.grammar import validate_structured_outputs

                validate_structured_outputs(sampling_params.structured_outputs)
            text, token_ids = self.input_processor.tokenize(prompt)
            stream = self.open_stream(merge_kind=sampling_params.output_kind)
            self.add_request(request_id, token_ids, sampling_params, stream, prompt=text, priority=priority,
                             lora_request=lora_request, max_tokens_in_context=False, reasoning_ended=reasoning_ended,
                             reasoning_parser_kwargs=reasoning_parser_kwargs)
            async for out in stream:
                yield out
        except (ValueError, TypeError, EngineDeadError, EngineOverloadedError, EngineDrainingError):
            raise
        except Exception as exc:  # vLLM's "unexpected error in the generate() task (possibly recoverable)"
            logger.info("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
            raise EngineGenerateError(f"generate failed: {type(exc).__name__}: {exc}") from exc
        finally:  # finished: nothing pending; left early or failed: the engine drops the request
            if stream is not None:
                stream.close()

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """vLLM's AsyncLLM.abort: stop these requests now (unknown or finished ids are ignored); each one's
        `generate` ends with a final output, finish_reason "abort", holding what was generated (vLLM's)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._finish(rid, "abort", None, deliver=True)

    async def check_health(self) -> None:
        """vLLM's: raises EngineDeadError once the engine core is gone."""
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's ValueError when built with skip_tokenizer_init)."""
        if self.tokenizer is None:
            raise ValidationError(NO_TOKENIZER, parameter="skip_tokenizer_init", value=True)
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self.dead_reason is None and self.accepting

    @property
    def errored(self) -> bool:
        return self.dead_reason is not None

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(self.dead_reason or "the engine core is gone")

    def _receive_outputs(self) -> None:
        """Attach to the running event loop once (the server attaches at start-up; vLLM-style callers
        reach here first through generate)."""
        if not self._attached:
            self.attach()

    # Requests out ---------------------------------------------------------------------------------
    def abort_request(self, request_id: str) -> None:
        """The client is gone: free its blocks in the engine now; nobody reads the final output."""
        self._finish(request_id, "abort", None, deliver=False)

    def stop_accepting(self) -> None:
        self.accepting = False

    def abort_all(self, message: str) -> None:
        """Cut every unfinished request (shutdown grace period over): finish_reason "abort" + `message`."""
        for request_id in list(self._requests):
            self._finish(request_id, "abort", message, deliver=True)

    def _finish(self, request_id: str, reason: str, error: str | None, deliver: bool) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        live = [c.request_id for c in tracked.cores if c.request_id in self._mirrors]
        if live and self.client.is_alive:
            self.client.abort_requests(live)
        out = self.output_processor.finish_aborted(request_id, reason, error)
        stats = IterationStats(time.monotonic())
        if out is not None:
            self._record_finished(out, tracked, stats)
            if deliver:
                tracked.stream._put(out)
        self._log(stats)
        if not deliver:
            tracked.stream.pending.discard(request_id)

    # Engine messages (on the event loop) ------------------------------------------------------------
    def _on_outputs(self, batch: EngineCoreOutputs) -> None:
        ts = batch.timestamp
        self._num_received[batch.engine_index] = batch.num_requests_received
        self._engine_stats[batch.engine_index] = batch.stats
        self.scheduler_stats = batch.stats if len(self._engine_stats) == 1 else sum_engine_stats(self._engine_stats)
        stats = IterationStats(ts, self.scheduler_stats, batch.step, ipc_latency=time.monotonic() - ts)
        if self.data_parallel_size > 1:
            stats.engine_index, stats.engine_scheduler = batch.engine_index, batch.stats
        update_mirrors(batch, self._mirrors, stats)
        outputs, to_abort = self.output_processor.process_outputs(batch.outputs)
        if to_abort:  # stop strings ended these: free their blocks now
            self.client.abort_requests(to_abort)
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            self._record_finished(out, tracked, stats)
            if out.finished:
                del self._requests[out.request_id]
            tracked.stream._put(out)
        self._log(stats)

    def _on_engine_failure(self, message: str, core_ids: list[str] | None = None) -> None:
        """Fail every request in flight at once (503), rather than leave it hanging. With data
        parallelism and engines left (`core_ids` given), only the requests the dead engine owned fail."""
        if core_ids is None:
            self.accepting = False
            doomed = list(self._requests)
        else:
            lost = set(core_ids)
            doomed = [rid for rid, t in self._requests.items() if any(c.request_id in lost for c in t.cores)]
        stats = IterationStats(time.monotonic())
        for request_id in doomed:
            tracked = self._requests.pop(request_id)
            out = self.output_processor.finish_aborted(request_id, "error", message)
            if out is not None:
                self._record_finished(out, tracked, stats)
            tracked.stream._put(EngineDeadError(message))
        self._log(stats)
        if core_ids is None:  # every engine is gone (one data-parallel engine dying is not the server's end)
            for listener in self.failure_listeners:
                listener(message)

    # Figures --------------------------------------------------------------------------------------
    def _record_finished(self, out: RequestOutput, tracked: _Tracked, stats: IterationStats) -> None:
        """Stats for each completion of `out` that just finished; its mirror is dropped."""
        record_finished(out, tracked.cores, stats, lambda core: self._mirrors.pop(core.request_id, None) is not None)

    def _log(self, stats: IterationStats) -> None:
        log_stats(self.stat_loggers, stats)
