"""Streaming benchmark client for OpenAI-compatible servers (asyncio + aiohttp).

Each request is sent at its `arrival_s` (open loop: it never waits for earlier requests, only for a
`max_concurrency` slot), streamed with `stream_options.include_usage`, and every chunk's arrival
time is taken as soon as its bytes are read.

Counting tokens in a stream
  A chunk carries tokens when its text (completions) or delta content or reasoning (chat, a server with a
  reasoning parser: the model is decoding while it thinks, so the thinking is not time to first token, as
  vLLM's benchmark counts it) is non-empty, or when it lists `token_ids`; the generated text is the content.
  How many: len(token_ids), else len(logprobs.tokens), else the growth of a per-chunk
  `usage.completion_tokens` (servers with continuous usage stats), else 1. A role-only or
  finish-only chunk carries none. TTFT is the first chunk that carries a token. One exception: a
  stream whose only output is a textless finish chunk (EOS sampled first) while usage reports
  completion tokens counts that chunk as its token, so it is a success with TTFT = E2E.

ITL when a chunk carries several tokens
  The gap since the previous token chunk is split evenly over its k tokens (k gaps of gap/k), so the
  pooled ITL counts one gap per token and averages to the true per-token pace (vLLM's default client
  records one gap per chunk instead, which overstates ITL when the server coalesces tokens). Extra
  tokens in the *first* chunk add no gaps: they have no measurable spacing. When the server
  coalesces without saying so (k unknown), ITL falls back to one gap per chunk; TPOT is unaffected
  because output_tokens comes from the final usage chunk.

Queue time
  Only known when the server reports it: a `queue_time_s` field at the top level of a chunk, or under
  its `metrics` or `usage`, or an `X-Queue-Time-Ms` / `X-Queue-Time` (seconds) response header.
  vLLM's OpenAI server reports none, so queue-time stats are empty (null) against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from tokenloom.workload.datasets import BenchRequest, assign_arrivals
from tokenloom.workload.metrics import (
    DEFAULT_PERCENTILES,
    RequestRecord,
    compute_metrics,
    parse_goodput,
)
from tokenloom.workload.progress import Progress
from tokenloom.workload.result import BenchResult

COMPLETIONS = "/v1/completions"
DEFAULT_TIMEOUT_S = 600.0


# -------------------------------------------------------------------------------------- request bodies


def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    # OpenAI SDK users write base URLs ending in /v1; don't send /v1/v1/completions
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_body(
    req: BenchRequest, model: str, chat: bool, extra_body: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.ignore_eos:
        body["ignore_eos"] = True  # vLLM extension; the output length is then exactly max_tokens
    if chat:
        if not isinstance(req.prompt, str):
            raise ValueError(f"request {req.id}: chat endpoints take text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(extra_body or {})
    return body


# -------------------------------------------------------------------------------------- stream parsing


@dataclass
class StreamState:
    """Everything read from one response stream so far."""

    token_times: list[float] = field(default_factory=list)  # seconds after send, one per token chunk
    token_counts: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    queue_time_s: float | None = None
    error: str = ""
    finish_s: float | None = None  # when a choice carried finish_reason
    _usage_tokens_seen: int = 0


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _choice_reasoning(choice: dict[str, Any], chat: bool) -> str:
    """A chat delta's reasoning (vLLM 0.32's `reasoning`, its older `reasoning_content`)."""
    if not chat:
        return ""
    delta = choice.get("delta") or {}
    return delta.get("reasoning") or delta.get("reasoning_content") or ""


def _queue_time_from(obj: dict[str, Any]) -> float | None:
    for holder in (obj, obj.get("metrics"), obj.get("usage")):
        if isinstance(holder, dict) and isinstance(holder.get("queue_time_s"), int | float):
            return float(holder["queue_time_s"])
    return None


def queue_time_from_headers(headers: Any) -> float | None:
    with contextlib.suppress(TypeError, ValueError):
        if headers.get("X-Queue-Time-Ms") is not None:
            return float(headers["X-Queue-Time-Ms"]) / 1000.0
        if headers.get("X-Queue-Time") is not None:
            return float(headers["X-Queue-Time"])
    return None


def tokens_in_chunk(obj: dict[str, Any], chat: bool, usage_seen: int) -> tuple[int, str]:
    """(tokens this chunk carries, its text); see the module docstring for the rules."""
    choices = obj.get("choices") or []
    if not choices:
        return 0, ""
    choice = choices[0]
    text = _choice_text(choice, chat)
    token_ids = choice.get("token_ids")
    if token_ids:
        return len(token_ids), text
    if not text and not _choice_reasoning(choice, chat):
        return 0, ""
    logprobs = choice.get("logprobs") or {}
    if isinstance(logprobs, dict) and logprobs.get("tokens"):
        return len(logprobs["tokens"]), text
    usage = obj.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > usage_seen:
        return usage["completion_tokens"] - usage_seen, text
    return 1, text


def feed_event(state: StreamState, payload: bytes, now_s: float, chat: bool) -> None:
    """One SSE `data:` payload arrived `now_s` seconds after send."""
    if payload == b"[DONE]":
        return
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        state.error = state.error or f"bad SSE payload: {payload[:200]!r}"
        return
    if not isinstance(obj, dict):
        return
    if obj.get("error"):
        err = obj["error"]
        state.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
        return
    queue = _queue_time_from(obj)
    if queue is not None:
        state.queue_time_s = queue
    n, text = tokens_in_chunk(obj, chat, state._usage_tokens_seen)
    choices = obj.get("choices") or []
    if choices and choices[0].get("finish_reason") is not None:
        state.finish_s = now_s
    if obj.get("usage"):
        state.usage = obj["usage"]
        if isinstance(state.usage.get("completion_tokens"), int):
            state._usage_tokens_seen = state.usage["completion_tokens"]
    if n > 0:
        state.token_times.append(now_s)
        state.token_counts.append(n)
        state.text.append(text)


def split_sse(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete `data:` payloads in buffer, and the unfinished tail to keep."""
    *lines, rest = buffer.split(b"\n")
    payloads = [ln.strip()[5:].strip() for ln in lines if ln.strip().startswith(b"data:")]
    return payloads, rest


def inter_token_gaps(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Gaps between token chunks; a chunk of k tokens contributes k gaps of gap/k."""
    gaps: list[float] = []
    for i in range(1, len(times)):
        k = max(1, counts[i])
        gaps.extend([(times[i] - times[i - 1]) / k] * k)
    return gaps


def finish_record(rec: RequestRecord, state: StreamState) -> RequestRecord:
    rec.queue_time_s = state.queue_time_s if state.queue_time_s is not None else rec.queue_time_s
    rec.generated_text = "".join(state.text)
    rec.num_chunks = len(state.token_times)
    if state.usage and isinstance(state.usage.get("prompt_tokens"), int):
        rec.prompt_len = state.usage["prompt_tokens"]  # exact, where the workload only estimated
    reported = (state.usage or {}).get("completion_tokens")
    if not state.token_times and state.finish_s is not None and isinstance(reported, int) and reported > 0:
        # the only output was a textless stop (EOS sampled first): its finish chunk is that token
        state.token_times, state.token_counts = [state.finish_s], [reported]
    if state.token_times:
        rec.ttft_s = state.token_times[0]
        rec.e2e_s = state.token_times[-1]
        rec.itl_s = inter_token_gaps(state.token_times, state.token_counts)
        rec.output_tokens = reported if isinstance(reported, int) else sum(state.token_counts)
    rec.error = rec.error or state.error or ("" if state.token_times else "no tokens received")
    rec.success = not rec.error
    return rec


# ------------------------------------------------------------------------------------------ one request


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    req: BenchRequest,
    *,
    model: str,
    chat: bool,
    headers: dict[str, str],
    extra_body: dict[str, Any] | None,
    timeout_s: float,
    t0: float,
) -> RequestRecord:
    """Send one streaming request and measure it; never raises (errors land in the record)."""
    rec = RequestRecord(
        id=req.id, prompt_len=req.prompt_len, max_tokens=req.max_tokens, arrival_s=req.arrival_s
    )
    state = StreamState()
    body = build_body(req, model, chat, extra_body)
    start = time.perf_counter()
    rec.send_s = start - t0
    try:
        async with asyncio.timeout(timeout_s), session.post(url, json=body, headers=headers) as resp:
            rec.queue_time_s = queue_time_from_headers(resp.headers)
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                buf = b""
                async for data in resp.content.iter_any():
                    now = time.perf_counter() - start
                    payloads, buf = split_sse(buf + data)
                    for payload in payloads:
                        feed_event(state, payload, now, chat)
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.finish_s = time.perf_counter() - t0
    return finish_record(rec, state)


# ------------------------------------------------------------------------------------------- the run


def warmup_request(req: BenchRequest) -> BenchRequest:
    """A short request shaped like `req` but with its prompt reversed, so that with prefix caching
    the warm-up leaves no cached prefix behind for the timed run."""
    prompt = req.prompt[::-1] if isinstance(req.prompt, list) else " ".join(req.prompt.split()[::-1])
    return BenchRequest(f"warmup-{req.id}", prompt, req.prompt_len, min(req.max_tokens, 16), req.ignore_eos)


def _rate_for_json(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


async def arun_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    endpoint: str = COMPLETIONS,
    api_key: str | None = None,
    seed: int = 0,
    disable_tqdm: bool = False,
    request_timeout_s: float = DEFAULT_TIMEOUT_S,
    extra_body: dict[str, Any] | None = None,
    goodput: dict[str, float] | Iterable[str] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    num_warmups: int = 0,
    label: str | None = None,
) -> BenchResult:
    """Async form of `run_benchmark`, for callers already inside an event loop."""
    slos = dict(goodput) if isinstance(goodput, dict) else parse_goodput(goodput)
    reqs = list(requests)
    if request_rate is not None:  # None: keep the workload's own arrival_s (e.g. a jsonl replay)
        reqs = assign_arrivals(reqs, request_rate, burstiness, seed)
    chat = is_chat(endpoint)
    for r in reqs:
        build_body(r, model, chat, None)  # fail fast on prompts the endpoint cannot take
    url = endpoint_url(base_url, endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    send = dict(model=model, chat=chat, headers=headers, extra_body=extra_body, timeout_s=request_timeout_s)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore, not the pool, bounds concurrency
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        for i in range(min(num_warmups, len(reqs))):
            warm = await send_request(session, url, warmup_request(reqs[i]), t0=time.perf_counter(), **send)
            if not warm.success:
                raise ValueError(f"warm-up request failed: {warm.error}")
        bar = progress_bar(len(reqs), disable_tqdm)
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestRecord:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem or contextlib.nullcontext():
                rec = await send_request(session, url, req, t0=t0, **send)
            bar.update(1)
            return rec

        try:
            records = list(await asyncio.gather(*(one(r) for r in reqs)))
        finally:
            bar.close()
    percentiles = tuple(percentiles)
    config = {
        "base_url": base_url,
        "endpoint": endpoint,
        "model_id": model,
        "label": label,
        "num_prompts": len(reqs),
        "request_rate": _rate_for_json(request_rate),
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "seed": seed,
        "request_timeout_s": request_timeout_s,
        "goodput_slos_ms": slos or None,
        "percentiles": list(percentiles),
    }
    metrics = compute_metrics(records, slos_ms=slos or None, percentiles=percentiles)
    return BenchResult(config=config, records=records, metrics=metrics)


def progress_bar(total: int, disable: bool = False) -> Any:
    """tqdm's bar on a terminal; elsewhere (a log file, a pipe) a plain line every few seconds, which a
    file shows as it comes (tqdm's carriage returns make one line of it). Both go to stderr."""
    if disable:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc="bench", unit="req")
    return Progress("bench serve", total)


def run_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    endpoint: str = COMPLETIONS,
    api_key: str | None = None,
    seed: int = 0,
    disable_tqdm: bool = False,
    **kwargs: Any,
) -> BenchResult:
    """Replay `requests` against `base_url` and measure them.

    request_rate: None keeps each request's arrival_s; a number re-draws arrivals (inf: all at once;
    else gamma gaps with `burstiness`, 1 = Poisson), deterministically from `seed`.
    Further keywords: request_timeout_s, extra_body, goodput ({"ttft": ms} or ["ttft:ms"]),
    percentiles, num_warmups, label — see `arun_benchmark`.
    """
    return asyncio.run(
        arun_benchmark(
            base_url,
            model,
            requests,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            endpoint=endpoint,
            api_key=api_key,
            seed=seed,
            disable_tqdm=disable_tqdm,
            **kwargs,
        )
    )
