"""Delivering a RequestStream: as Server-Sent Events, or collected whole; either way a client that goes
away aborts its requests at once, so their KV blocks are freed.

Streaming: Starlette cancels the response when the client disconnects; SSEResponse closes the stream
(aborting what is unfinished) however the response ends. Non-streaming: `collect` races the
generation against the client's `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenloom.engine.async_llm import EngineDeadError, RequestStream
from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.server.errors import generation_error_status, sse_error
from tokenloom.server.protocol import StreamOptions
from tokenloom.server.responses import DONE, UsageCounter, sse

# (choice index, request output, completion) → the choice of a chunk, or None to send nothing now
ChoiceFn = Callable[[int, RequestOutput, CompletionOutput], dict[str, Any] | None]


class SSEResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], stream: RequestStream,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def usage_flags(options: StreamOptions | None, force: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage), as vLLM decides them: continuous_usage_stats only counts with
    include_usage, and --enable-force-include-usage turns both on."""
    if force:
        return True, True
    if options is None:
        return False, False
    include = bool(options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


def choice_usage(out: RequestOutput, comp: CompletionOutput | None,
                 count_reasoning: Callable[[Sequence[int]], int] | None = None) -> dict[str, Any]:
    """vLLM's per-chunk usage: the choice's own prompt and its completion tokens so far (and, with a reasoning
    parser, how many of them are reasoning)."""
    prompt = len(out.prompt_token_ids)
    completion = len(comp.token_ids) if comp is not None else 0
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if count_reasoning is not None:
        usage["completion_tokens_details"] = {
            "reasoning_tokens": count_reasoning(comp.token_ids) if comp is not None else 0}
    return usage


async def sse_events(
    stream: RequestStream,
    head: dict[str, Any],
    choice_index: Callable[[RequestOutput, CompletionOutput], int],
    choice: ChoiceFn,
    opening: Callable[[RequestOutput], list[dict[str, Any]]] | None,
    usage_on: tuple[bool, bool],
    details: str | None = None,
    count_reasoning: Callable[[Sequence[int]], int] | None = None,
) -> AsyncIterator[str]:
    """The chunks of a streamed completion: `opening` chunks (built from the first output), one per
    choice per step that has something to say, the usage chunk, then [DONE]. A request cut at shutdown
    gets finish_reason "abort" and then an error event; engine failures end the stream with an error event.
    `details`: the usage chunk's prompt_tokens_details, as UsageCounter says; `count_reasoning`: its
    completion_tokens_details (a server with a reasoning parser)."""
    include_usage, continuous_usage = usage_on
    usage = UsageCounter(details, count_reasoning)
    finished: set[int] = set()
    cut: str | None = None
    first = True
    try:
        async for out in stream:
            usage.update(out)
            if first and opening is not None:
                for obj in opening(out):
                    if continuous_usage:
                        obj["usage"] = choice_usage(out, None, count_reasoning)
                    yield sse(obj)
            first = False
            for comp in out.outputs:
                index = choice_index(out, comp)
                if index in finished:
                    continue
                if comp.finish_reason == "error":
                    yield sse_error(generation_error_status(out.error), out.error or "generation failed")
                    yield DONE
                    return
                body = choice(index, out, comp)
                if body is None:
                    continue
                chunk = {**head, "choices": [body]}
                if comp.finish_reason is not None:
                    finished.add(index)
                    # Server-side queue time, for benchmark clients (tokenloom bench reads it here).
                    chunk["metrics"] = {"queue_time_s": out.metrics.queue_time}
                    if comp.finish_reason == "abort" and out.error:
                        cut = out.error
                if continuous_usage:
                    chunk["usage"] = choice_usage(out, comp, count_reasoning)
                yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage.as_dict(stream=True)})
        if cut is not None:
            yield sse_error(503, cut)
        yield DONE
    except EngineDeadError as exc:
        yield sse_error(503, str(exc))
        yield DONE


async def collect(request: Request, stream: RequestStream) -> dict[str, RequestOutput] | None:
    """The final output of each request of the stream, with all its n completions (in index order); None if
    the client disconnected first."""

    async def drain() -> dict[str, RequestOutput]:
        last: dict[str, RequestOutput] = {}
        async for out in stream:
            last[out.request_id] = merge_final(last.get(out.request_id), out)
        return last

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        stream.close()
        if not work.done():
            # The client left first: end the drain too, or its task stays pending on a closed stream
            # until the GC destroys it ("Task was destroyed but it is pending!" in the log).
            work.cancel()
    # Not `work.cancelled()`: cancel() only asks, and the task is not cancelled until it next runs, so a
    # client that left first would make result() raise InvalidStateError (a 500 nobody reads; the soak
    # found it in the server log).
    return work.result() if work.done() and not work.cancelled() else None


def merge_final(earlier: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """Fold a request's newest cumulative output into what came before: with n > 1 each streamed output
    carries only the completions that progressed (vLLM's shape), so a completion that finished early is
    kept from an earlier output. The newest output's request-level fields win."""
    if earlier is None or not isinstance(out, RequestOutput):
        return out
    latest = {comp.index: comp for comp in earlier.outputs}
    latest.update((comp.index, comp) for comp in out.outputs)
    out.outputs = [latest[i] for i in sorted(latest)]
    return out
