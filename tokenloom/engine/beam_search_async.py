"""Beam search for the server (`use_beam_search: true`), as vLLM's BeamSearchOnlineMixin: each step's
beams are one-token requests on the AsyncLLM, awaited together; the step logic is beam_search.py's.

`BeamSearchStream` stands where a RequestStream stands in the handlers: `add` validates up front (so
errors are 400s before any response starts), iterating yields each prompt's one final RequestOutput
(its `outputs` are the best beams, best first), and `close` cancels the searches still running, which
aborts their in-flight step requests (a client that goes away frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from tokenloom.engine.async_llm import AsyncLLM, InvalidRequestError
from tokenloom.engine.beam_search import (
    BeamSearchSequence,
    create_sort_beams_key_function,
    search_is_decided,
    step_logprobs,
    step_sampling_params,
    top_by_cum_logprob,
)
from tokenloom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenloom.sampling_params import BeamSearchParams, SamplingParams


async def beam_search(engine: AsyncLLM, request_id: str, prompt_token_ids: list[int], prompt: str | None,
                      params: BeamSearchParams, max_logprobs: int = -1, seed: int | None = None,
                      priority: int = 0, lora_request: Any = None) -> RequestOutput:
    """The best `beam_width` beams of one prompt as one finished RequestOutput (vLLM's online
    beam_search): generated tokens only; an EOS-ended beam has finish_reason "stop" and stop_reason
    the EOS id, its EOS kept only with include_stop_str_in_output; the others "length"."""
    tokenizer = engine.tokenizer
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = engine.info.eos_token_id
    sort_key = create_sort_beams_key_function(eos, params.length_penalty)
    step_params = step_sampling_params(params, max_logprobs, seed)
    metrics = RequestMetrics(arrival_time=time.monotonic())
    orig = {"type": "token", "prompt_token_ids": prompt_token_ids, "prompt": prompt, "lora_request": lora_request}
    n_prompt = len(prompt_token_ids)
    beams = [BeamSearchSequence(orig, tokens=list(prompt_token_ids), logprobs=[])]
    completed: list[BeamSearchSequence] = []
    num_cached = 0
    error: str | None = None
    for step in range(params.max_tokens):
        results = await _run_step(engine, f"{request_id}-{uuid.uuid4().hex[:8]}", beams, step_params, priority)
        if step == 0:
            metrics.first_scheduled_time = results[0].metrics.first_scheduled_time
            metrics.first_token_time = time.monotonic()
            num_cached = results[0].num_cached_tokens
        failed = next((r for r in results if r.outputs[0].finish_reason == "error"), None)
        if failed is not None:
            metrics.finished_time = time.monotonic()
            return RequestOutput(request_id, prompt, prompt_token_ids, None,
                                 [CompletionOutput(0, "", [], finish_reason="error")], True, metrics,
                                 error=failed.error or "generation failed")
        aborted = next((r for r in results if r.outputs[0].finish_reason == "abort"), None)
        if aborted is not None:  # the server is shutting down: what there is, marked aborted
            for beam in beams:
                beam.finish_reason = "abort"
            error = aborted.error
            break
        candidates = []
        for beam, result in zip(beams, results):
            logprobs = step_logprobs(result)
            if logprobs is None:
                continue
            for token_id, lp in logprobs.items():
                cum = beam.cum_logprob + lp.logprob
                if token_id == eos and not params.ignore_eos:
                    tokens = beam.tokens + [eos] if params.include_stop_str_in_output else beam.tokens
                    completed.append(BeamSearchSequence(orig, tokens=tokens, logprobs=beam.logprobs + [logprobs],
                                                        cum_logprob=cum, finish_reason="stop", stop_reason=eos))
                else:
                    candidates.append(BeamSearchSequence(orig, tokens=beam.tokens + [token_id],
                                                         logprobs=beam.logprobs + [logprobs], cum_logprob=cum))
        beams = top_by_cum_logprob(candidates, params.beam_width)
        if not beams or search_is_decided(completed, beams, params.beam_width, eos, params.length_penalty,
                                          n_prompt + params.max_tokens):
            break
    completed.extend(beams)
    best = sorted(completed, key=sort_key, reverse=True)[:params.beam_width]
    outputs = []
    for i, beam in enumerate(best):
        token_ids = beam.tokens[n_prompt:]
        shown = token_ids[:-1] if token_ids and token_ids[-1] == eos and not params.ignore_eos else token_ids
        text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
        outputs.append(CompletionOutput(
            index=i, text=text, token_ids=token_ids, cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs,
            finish_reason=beam.finish_reason or "length", stop_reason=beam.stop_reason,
            delta_text=text, delta_token_ids=list(token_ids), delta_logprobs=beam.logprobs))
    metrics.finished_time = time.monotonic()
    return RequestOutput(request_id, prompt, prompt_token_ids, None, outputs, True, metrics,
                         num_cached_tokens=num_cached, error=error)


async def _run_step(engine: AsyncLLM, step_id: str, beams: list[BeamSearchSequence],
                    params: SamplingParams, priority: int) -> list[RequestOutput]:
    """One token for every beam, all in flight together; their final outputs in beam order."""
    stream = engine.open_stream()
    ids = [f"{step_id}-beam-{i}" for i in range(len(beams))]
    try:
        for rid, beam in zip(ids, beams):
            engine.add_request(rid, beam.tokens, params, stream, priority=priority, lora_request=beam.lora_request)
        finals: dict[str, RequestOutput] = {}
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
    finally:
        stream.close()  # cancelled (client gone) or failed: abort what is still running
    return [finals[rid] for rid in ids]


class BeamSearchStream:
    """The beam searches of one HTTP request (one per prompt), iterated like a RequestStream."""

    def __init__(self, engine: AsyncLLM, max_logprobs: int = -1) -> None:
        self._engine = engine
        self._max_logprobs = max_logprobs
        self._tasks: dict[asyncio.Task[RequestOutput], str] = {}
        self.pending: set[str] = set()

    def add(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
            prompt: str | None = None, seed: int | None = None, priority: int = 0, lora_request: Any = None) -> None:
        """Validate as the engine would for the whole search (raises before anything runs), then start it."""
        try:
            step_sampling_params(params, self._max_logprobs, seed)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "n") from None
        self._engine.input_processor.check_prompt(
            prompt_token_ids, SamplingParams(max_tokens=params.max_tokens, max_logprobs=-1), max_tokens_in_context=True)
        task = asyncio.ensure_future(beam_search(self._engine, request_id, prompt_token_ids, prompt, params,
                                                 self._max_logprobs, seed, priority, lora_request))
        self._tasks[task] = request_id
        self.pending.add(request_id)

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        running = [t for t, rid in self._tasks.items() if rid in self.pending]
        if not running:
            raise StopAsyncIteration
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        task = next(iter(done))
        self.pending.discard(self._tasks[task])
        return task.result()  # raises the search's error (EngineDeadError, ...)

    def close(self) -> None:
        """Cancel the searches still running (idempotent); their step requests are aborted."""
        for task, rid in self._tasks.items():
            if rid in self.pending:
                task.cancel()
        self.pending.clear()
