"""Response pieces shared by the endpoints: usage, logprobs (both OpenAI shapes), SSE framing."""

from __future__ import annotations

import json
from typing import Any

from tokenloom.engine.outputs import Logprob, RequestOutput

# vLLM's floor for log-probabilities: -inf is not JSON.
_MIN_LOGPROB = -9999.0
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


class UsageCounter:
    """Token counts of one HTTP request, over all its prompts and their `n` completions."""

    def __init__(self) -> None:
        self._prompt: dict[str, int] = {}
        self._cached: dict[str, int] = {}
        self._completion: dict[tuple[str, int], int] = {}

    def update(self, out: RequestOutput) -> None:
        self._prompt[out.request_id] = len(out.prompt_token_ids)
        self._cached[out.request_id] = out.num_cached_tokens
        for comp in out.outputs:
            self._completion[(out.request_id, comp.index)] = len(comp.token_ids)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self._prompt.values())
        completion = sum(self._completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached.values())},
        }


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int
) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (str → logprob), text_offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(_lp(chosen.logprob))
        ranked: dict[str, float] = {}
        for lp in _by_rank(entry):  # tokens that decode alike (e.g. partial UTF-8) keep the best
            ranked.setdefault(lp.decoded_token or "", _lp(lp.logprob))
        top.append(ranked)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        content.append({
            **_chat_token(chosen),
            "top_logprobs": [_chat_token(lp) for lp in _by_rank(entry)[:top_n]],
        })
    return {"content": content}


def _chat_token(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode("utf-8"))}


def _by_rank(entry: dict[int, Logprob]) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)



def queue_time_header(out: RequestOutput) -> dict[str, str]:
    """Server-side queue time of a whole (non-streamed) response, for benchmark clients."""
    queued = out.metrics.queue_time
    return {} if queued is None else {"X-Queue-Time-Ms": f"{queued * 1000:.3f}"}
