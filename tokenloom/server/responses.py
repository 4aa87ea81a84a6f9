"""Response pieces shared by the endpoints: usage, logprobs (both OpenAI shapes), SSE framing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from starlette.responses import JSONResponse as StarletteJSONResponse

from tokenloom.engine.outputs import Logprob, RequestOutput

# vLLM's floor for log-probabilities: -inf is not JSON.
_MIN_LOGPROB = -9999.0
DONE = "data: [DONE]\n\n"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(obj: Any, allow_nan: bool = False) -> str:
    """`obj` as the server writes JSON: compact, non-ASCII as itself, and any lone UTF-16 surrogate as its JSON
    escape. A tool parser's json.loads turns a model's "\\ud800" into half a pair, which UTF-8 cannot encode:
    rendering it failed the whole answer (a valid request's tokens lost; vLLM answers 500). In JSON text such a
    character can only sit inside a string, where its escape reads back as the same string."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class JSONResponse(StarletteJSONResponse):
    """Starlette's JSONResponse written by `json_text`: every JSON answer of the server."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("utf-8")


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json_text(obj, allow_nan=True)}\n\n"


def _lp(value: float) -> float:
    # vLLM's floor for -inf; a NaN (logits that overflowed) gets it too, written this way round (max(nan, x) is
    # nan): JSON has no NaN, and rendering one failed the whole response.
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB


class UsageCounter:
    """Token counts of one HTTP request, over all its prompts and their `n` completions.

    `details` is vLLM's `prompt_tokens_details` (--enable-prompt-tokens-details), which vLLM builds
    differently per endpoint: None (off), "completion" (cached_tokens of the last prompt's output in a
    whole response, of the first output to arrive in a stream) or "chat" (cached_tokens and
    created_cache_tokens). Beam search passes None: vLLM's beam-search outputs carry no cache counts.
    `count_reasoning` (a server with --reasoning-parser): the reasoning tokens of a finished completion's
    token ids, summed into vLLM's completion_tokens_details.reasoning_tokens."""

    def __init__(self, details: str | None = None,
                 count_reasoning: Callable[[Sequence[int]], int] | None = None) -> None:
        self.details = details
        self.count_reasoning = count_reasoning
        self._prompt: dict[str, int] = {}
        self._completion: dict[tuple[str, int], int] = {}
        self._reasoning: dict[tuple[str, int], int] = {}
        self._first: RequestOutput | None = None
        self._last: RequestOutput | None = None

    def update(self, out: RequestOutput) -> None:
        self._prompt[out.request_id] = len(out.prompt_token_ids)
        for comp in out.outputs:
            self._completion[(out.request_id, comp.index)] = len(comp.token_ids)
            if self.count_reasoning is not None and comp.finish_reason is not None:
                self._reasoning[(out.request_id, comp.index)] = self.count_reasoning(comp.token_ids)
        if self._first is None:
            self._first = out
        self._last = out

    def completion_tokens_details(self) -> dict[str, int] | None:
        """vLLM's: {"reasoning_tokens": n} on a server with a reasoning parser, else None."""
        if self.count_reasoning is None:
            return None
        return {"reasoning_tokens": sum(self._reasoning.values())}

    def as_dict(self, stream: bool = False) -> dict[str, Any]:
        """A whole response's usage (vLLM's model_dump: the details keys are there, null when off), or
        a stream's final usage chunk (`stream`: vLLM dumps it without nulls)."""
        prompt = sum(self._prompt.values())
        completion = sum(self._completion.values())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        details = self._prompt_tokens_details(stream)
        completion_details = self.completion_tokens_details()
        if not stream:
            usage["prompt_tokens_details"] = details
            usage["completion_tokens_details"] = completion_details
            return usage
        if details is not None:
            usage["prompt_tokens_details"] = details
        if completion_details is not None:
            usage["completion_tokens_details"] = completion_details
        return usage

    def _prompt_tokens_details(self, stream: bool) -> dict[str, Any] | None:
        out = self._first if stream else self._last
        if self.details is None or out is None:
            return None
        if self.details == "completion":
            return {"cached_tokens": out.num_cached_tokens} if stream else \
                {"cached_tokens": out.num_cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
        details: dict[str, Any] = {"cached_tokens": out.num_cached_tokens,
                                   "created_cache_tokens": out.num_cache_creation_tokens}
        return details if stream else {**details, "multimodal_tokens": None}


def _token(lp: Logprob | None, token_id: int, as_ids: bool) -> str:
    # return_tokens_as_token_ids: "token_id:N", so tokens that are not valid UTF-8 on their own stay exact.
    if as_ids:
        return f"token_id:{token_id}"
    return (lp.decoded_token if lp is not None else None) or ""


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob] | None], text_offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (str → logprob), text_offset.

    An entry of None (the first prompt token under echo) has no log-probability: null, as in vLLM."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) if entry is not None else None
        text = _token(chosen, tid, as_ids)
        tokens.append(text)
        token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
        if entry is None:
            top.append(None)
        else:
            # vLLM's order: the chosen token first, then the top-n by rank (its sampler's layout of a position);
            # tokens that decode alike (e.g. partial UTF-8) keep the first
            ranked: dict[str, float] = {}
            for t, lp in sorted(_by_rank(entry), key=lambda kv: kv[0] != tid):
                ranked.setdefault(_token(lp, t, as_ids), _lp(lp.logprob))
            top.append(ranked)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int | None,
                  as_ids: bool = False) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}; top_n None: all
    of the entry (logprob_token_ids)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        ranked = _by_rank(entry)
        content.append({
            **_chat_token(entry[tid], tid, as_ids),
            "top_logprobs": [_chat_token(lp, t, as_ids) for t, lp in (ranked if top_n is None else ranked[:top_n])],
        })
    return {"content": content}


def _chat_token(lp: Logprob, token_id: int, as_ids: bool) -> dict[str, Any]:
    text = _token(lp, token_id, as_ids)
    return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode("utf-8"))}


def _by_rank(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def queue_time_header(out: RequestOutput) -> dict[str, str]:
    """Server-side queue time of a whole (non-streamed) response, for benchmark clients."""
    queued = out.metrics.queue_time
    return {} if queued is None else {"X-Queue-Time-Ms": f"{queued * 1000:.3f}"}
