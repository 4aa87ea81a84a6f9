"""`use_beam_search: true` on /v1/completions and /v1/chat/completions (vLLM's extension): `n` is the
beam width and the response has n choices, best first. The search runs over the engine
(tokenloom/engine/beam_search_async.py).

What vLLM does and tokenloom does too: `temperature` (default 1.0, or the model's generation_config),
`max_tokens`, `ignore_eos`, `length_penalty`, `include_stop_str_in_output`, `skip_special_tokens`;
`logprobs` / `top_logprobs` report the beams' own logprobs; `echo` (without logprobs), chat `stream`
(one chunk per beam once the search is done, as vLLM's), `return_token_ids`,
`return_tokens_as_token_ids`. Refused as vLLM refuses them: a streamed completion, `echo` with
`logprobs`, `logprob_token_ids`, beam search on the batch chat endpoint.

Where tokenloom departs from vLLM: vLLM accepts and silently ignores the sampling fields beam search
does not apply (top_p, stop, penalties, ...) — here each is a 400 naming it; `seed` seeds each step's
draw; `priority` is each step request's priority.
"""

from __future__ import annotations

from typing import Any

from tokenloom.engine.beam_search_async import BeamSearchStream
from tokenloom.engine.outputs import Logprob, RequestOutput
from tokenloom.sampling_params import BeamSearchParams, StructuredOutputsParams
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import SamplingRequest
from tokenloom.server.unsupported import Unsupported, reject_unsupported


def _ignored(field: str, neutral: tuple[Any, ...]) -> Unsupported:
    return Unsupported(f"{field} is not applied by beam search (vLLM ignores it; tokenloom refuses it)", neutral)


# Sampling fields beam search does not apply, with the values that ask for nothing.
NOT_APPLIED: dict[str, Unsupported] = {
    "top_p": _ignored("top_p", (1, 1.0)),
    "top_k": _ignored("top_k", (0, -1)),
    "min_p": _ignored("min_p", (0, 0.0)),
    "presence_penalty": _ignored("presence_penalty", (0, 0.0)),
    "frequency_penalty": _ignored("frequency_penalty", (0, 0.0)),
    "repetition_penalty": _ignored("repetition_penalty", (1, 1.0)),
    "stop": _ignored("stop", ([],)),
    "stop_token_ids": _ignored("stop_token_ids", ([],)),
    "min_tokens": _ignored("min_tokens", (0,)),
    "logit_bias": _ignored("logit_bias", ({},)),
    "allowed_token_ids": _ignored("allowed_token_ids", ()),
    "bad_words": _ignored("bad_words", ([],)),
    "prompt_logprobs": _ignored("prompt_logprobs", ()),
    "vllm_xargs": _ignored("vllm_xargs", ({},)),
    "thinking_token_budget": _ignored("thinking_token_budget", (-1,)),
    "repetition_detection": _ignored("repetition_detection", ()),
}


def check_beam_search(obj: dict[str, Any], req: SamplingRequest, structured: StructuredOutputsParams | None,
                      completion: bool) -> None:
    """400s, before anything runs, for what beam search cannot do with this request."""
    if completion and req.stream:
        # vLLM's message (its chat endpoint streams the finished beams; its completions endpoint refuses).
        raise APIError(400, "Streaming is not currently supported with beam search", "stream")
    if getattr(req, "logprob_token_ids", None):
        raise APIError(400, "`logprob_token_ids` is not supported with beam search.", "logprob_token_ids")
    if completion and getattr(req, "echo", False) and getattr(req, "logprobs", None) is not None:
        raise APIError(400, "`echo` with `logprobs` is not supported with beam search because beam search does "
                            "not compute prompt logprobs.", "echo")
    if completion and getattr(req, "max_tokens", None) == 0:
        raise APIError(400, "max_tokens must be at least 1 with beam search", "max_tokens")
    reject_unsupported(obj, NOT_APPLIED)
    if structured is not None:
        # Offline beam search applies them (vLLM 0.32's rule, engine/beam_search.py); vLLM's online beam search
        # drops them (to_beam_search_params does not carry them), which would be a silent 200 here.
        raise APIError(400, "structured outputs are not supported with beam search", "structured_outputs")


def reject_beam_only_fields(req: SamplingRequest) -> None:
    """length_penalty without use_beam_search asks for nothing that happens (vLLM ignores it): a 400."""
    if not req.use_beam_search and req.length_penalty != 1.0:
        raise APIError(400, "length_penalty only applies with use_beam_search", "length_penalty")


def beam_search_params(req: SamplingRequest, max_tokens: int | None, defaults: dict[str, Any]) -> BeamSearchParams:
    """vLLM's `to_beam_search_params` (the request's): n is the beam width; temperature defaults as for sampling."""
    if max_tokens is None:
        raise APIError(400, "max_tokens must be set with beam search", "max_tokens")
    try:
        return req.to_beam_search_params(max_tokens, defaults)
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        # vLLM's words name beam_width; the client sent it as n.
        raise APIError(400, message.replace("beam_width", "n (the beam width)"),
                       "n" if field == "beam_width" else field) from None


def shape_logprobs(out: RequestOutput, top_n: int | None) -> RequestOutput:
    """The beams carry each step's 2 * beam_width logprobs; a response shows what the request asked for:
    nothing (top_n None), or each token's own logprob plus the top_n by rank."""
    for comp in out.outputs:
        if comp.logprobs is None:
            continue
        if top_n is None:
            comp.logprobs = comp.delta_logprobs = None
            continue
        trimmed = [_trim(entry, tid, top_n) for tid, entry in zip(comp.token_ids, comp.logprobs)]
        comp.logprobs = comp.delta_logprobs = trimmed
    return out


def _trim(entry: dict[int, Logprob], token_id: int, top_n: int) -> dict[int, Logprob]:
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    kept = {token_id: entry[token_id]} if token_id in entry else {}
    kept.update(ranked[:top_n])
    return kept


class ShapedStream:
    """A BeamSearchStream whose outputs carry the logprobs the request asked for (shape_logprobs)."""

    def __init__(self, inner: BeamSearchStream, top_n: int | None) -> None:
        self._inner = inner
        self._top_n = top_n

    @property
    def pending(self) -> set[str]:
        return self._inner.pending

    def __aiter__(self) -> ShapedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return shape_logprobs(await self._inner.__anext__(), self._top_n)

    def close(self) -> None:
        self._inner.close()
