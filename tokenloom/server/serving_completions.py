"""POST /v1/completions: text or token-id prompts, one or a batch, streamed or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenloom.engine.async_llm import RequestStream
from tokenloom.engine.beam_search_async import BeamSearchStream
from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.server.beam_search import (
    beam_search_params,
    check_beam_search,
    reject_beam_only_fields,
    shape_logprobs,
)
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import generation_error
from tokenloom.server.headers import base_request_id, request_priority, response_headers
from tokenloom.server.params import check_completion_request, completion_params, completion_prompts
from tokenloom.server.protocol import CompletionRequest
from tokenloom.server.responses import JSONResponse, UsageCounter, completion_logprobs, prompt_logprobs_json
from tokenloom.server.state import get_state
from tokenloom.server.streaming import SSEResponse, collect, sse_events, usage_flags
from tokenloom.server.structured import structured_outputs_of
from tokenloom.server.unsupported import reject_unsupported_completion


async def create_completion(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    reject_unsupported_completion(obj)
    req = parse_model(CompletionRequest, obj)
    if req.return_tokens_as_token_ids is None:  # --return-tokens-as-token-ids: the server's default
        req.return_tokens_as_token_ids = state.config.return_tokens_as_token_ids
    model = state.model_name(req.model)
    state.check_generates()
    check_completion_request(req, state.vocab_size)
    structured = await state.in_tokenizer_thread(structured_outputs_of, obj)  # off the event loop
    if req.use_beam_search:
        check_beam_search(obj, req, structured, completion=True)
    else:
        reject_beam_only_fields(req)
    prompts = await state.in_tokenizer_thread(completion_prompts, req, state.engine.tokenizer, state.max_model_len)
    params = [completion_params(req, len(ids), state.max_model_len, state.vocab_size,
                                 state.config.max_logprobs, state.sampling_defaults, structured) for _, ids in prompts]
    base_id = base_request_id(raw, req.request_id)
    request_id = f"cmpl-{base_id}"
    priority = request_priority(raw, req.priority)
    # Engine ids stay unique even when a client reuses its X-Request-Id.
    ids = [f"{request_id}-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(prompts))]
    engine = state.engine
    stream: RequestStream | BeamSearchStream
    stream = BeamSearchStream(engine, state.config.max_logprobs) if req.use_beam_search else engine.open_stream()
    if not req.use_beam_search:  # the whole batch, before any of it is queued
        engine.check_admission(sum(p.n for p in params))
    lora = state.lora_request(req.model)
    try:
        for rid, (text, token_ids), p in zip(ids, prompts, params):
            if isinstance(stream, BeamSearchStream):
                stream.add(rid, token_ids, beam_search_params(req, p.max_tokens, state.sampling_defaults),
                           prompt=text, seed=req.seed, priority=req.priority, lora_request=lora)
            else:
                engine.add_request(rid, token_ids, p, stream, prompt=text, priority=priority, lora_request=lora)
    except BaseException:
        stream.close()
        raise
    position = {rid: i for i, rid in enumerate(ids)}
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    as_ids = bool(req.return_tokens_as_token_ids)
    echo_only = bool(req.echo) and req.max_tokens == 0  # the prompt alone: the one generated token is dropped

    def echoed(out: RequestOutput, comp: CompletionOutput, text: str, token_ids: list[int],
               logprobs: list | None) -> tuple[str, list[int], list | None]:
        """Prepend the prompt (echo): its text, ids and (with logprobs) its prompt_logprobs."""
        prompt_text = "" if req.return_token_ids else (out.prompt or "")
        prompt_lps = out.prompt_logprobs if logprobs is not None else None
        if echo_only:
            return prompt_text, list(out.prompt_token_ids), prompt_lps
        lps = None if logprobs is None else [*(prompt_lps or [None] * len(out.prompt_token_ids)), *logprobs]
        return prompt_text + text, [*out.prompt_token_ids, *token_ids], lps

    if req.stream:
        offsets: dict[int, int] = {}
        started: set[int] = set()

        def choice(index: int, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
            first = index not in started
            text, token_ids, lps = comp.delta_text, comp.delta_token_ids, comp.delta_logprobs
            if echo_only and not first:
                if comp.finish_reason is None:
                    return None
                text, token_ids, lps = "", [], [] if lps is not None else None
            elif req.echo and first:
                text, token_ids, lps = echoed(out, comp, text, token_ids, lps)
            wants_tokens = token_ids and (req.logprobs is not None or req.return_token_ids)
            if not (text or comp.finish_reason or wants_tokens or (first and req.return_token_ids)):
                return None
            started.add(index)
            body: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if lps is not None:
                body["logprobs"] = completion_logprobs(token_ids, lps, offsets.get(index, 0), as_ids)
                if body["logprobs"]["tokens"]:
                    offsets[index] = body["logprobs"]["text_offset"][-1] + len(body["logprobs"]["tokens"][-1])
            if req.return_token_ids:
                body["token_ids"] = comp.delta_token_ids
                if first:  # vLLM: the prompt's ids ride on each choice's first chunk
                    body["prompt_token_ids"] = out.prompt_token_ids
            return body

        def index_of(out: RequestOutput, comp: CompletionOutput) -> int:
            return position[out.request_id] * req.n + comp.index

        usage_on = usage_flags(req.stream_options, state.config.enable_force_include_usage)
        events = sse_events(stream, head, index_of, choice, None, usage_on,
                            state.config.usage_details("completion", req.use_beam_search))
        return SSEResponse(events, stream)

    finals = await collect(raw, stream)
    if finals is None:  # the client went away; its requests were aborted
        return Response(status_code=499)
    usage = UsageCounter(state.config.usage_details("completion", req.use_beam_search))
    choices = []
    for rid in ids:
        out = finals[rid]
        if req.use_beam_search:
            shape_logprobs(out, req.logprobs)
        usage.update(out)
        for comp in out.outputs:
            if comp.finish_reason == "error":
                raise generation_error(out.error)
            text, token_ids, lps = comp.text, comp.token_ids, comp.logprobs
            if req.echo:
                text, token_ids, lps = echoed(out, comp, text, token_ids, lps)
            body = {"index": position[rid] * req.n + comp.index, "text": text, "logprobs": None,
                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
                    "token_ids": None, "prompt_token_ids": None}
            if lps is not None:
                body["logprobs"] = completion_logprobs(token_ids, lps, 0, as_ids)
            if req.return_token_ids:
                body["token_ids"] = comp.token_ids
                body["prompt_token_ids"] = out.prompt_token_ids
            choices.append(body)
    # vLLM's kv_transfer_params: the KV connector's, for the (first) prompt (disaggregated prefill).
    response = {**head, "choices": choices, "usage": usage.as_dict(),
                "kv_transfer_params": finals[ids[0]].kv_transfer_params}
    return JSONResponse(response, headers=response_headers(state, raw, finals[ids[0]]))
