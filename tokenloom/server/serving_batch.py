"""POST /v1/chat/completions/batch (vLLM): N conversations in one request, one choice per conversation.

As in vLLM: no streaming, n must be 1, no tools, no beam search; every other field applies to each conversation.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError
from tokenloom.server.headers import base_request_id, response_headers
from tokenloom.server.params import chat_params
from tokenloom.server.protocol import BatchChatCompletionRequest
from tokenloom.server.responses import JSONResponse, UsageCounter
from tokenloom.server.serving_chat import chat_choice, check_generated, echo_text, parse_chat
from tokenloom.server.state import get_state
from tokenloom.server.streaming import collect


async def create_batch_chat_completion(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    conversations = obj.get("messages")
    if not isinstance(conversations, list) or not conversations or not all(
            isinstance(c, list) and c for c in conversations):
        raise APIError(400, "messages must be a non-empty list of non-empty conversations (lists of messages)",
                       "messages")
    if obj.get("use_beam_search"):  # vLLM's message
        raise APIError(400, "Batch chat completions do not support beam search. Please set `use_beam_search` "
                            "to False.", "use_beam_search")
    if obj.get("stream"):
        raise APIError(400, "streaming is not supported by the batch endpoint", "stream")
    kv_transfer_params = obj.get("kv_transfer_params")
    if isinstance(kv_transfer_params, dict) and kv_transfer_params.get("prompt_token_ids") is not None:
        raise APIError(400, "Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: one "
                            "pre-tokenized prompt cannot serve several conversations.",
                       "kv_transfer_params.prompt_token_ids")
    if obj.get("n", 1) not in (1, None):  # vLLM's message
        raise APIError(400, "Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
    if obj.get("tools"):
        raise APIError(400, "tools are not supported by the batch endpoint", "tools")
    # The fields every conversation shares, checked once (the stop-string cap among them) before any is rendered.
    parse_model(BatchChatCompletionRequest, obj)
    parsed = [await parse_chat(state, {**obj, "messages": conv}) for conv in conversations]
    req0 = parsed[0][0]
    model = state.model_name(req0.model)
    base_id = base_request_id(raw, req0.request_id)
    request_id = f"chatcmpl-{base_id}"
    suffix = uuid.uuid4().hex[:8]
    ids = [f"{request_id}_{i}-{suffix}" for i in range(len(parsed))]
    engine = state.engine
    engine.check_admission(sum(req.n for req, _, _ in parsed))  # the whole batch, before any of it is queued
    stream = engine.open_stream()
    try:
        for rid, (req, prompt_ids, extras) in zip(ids, parsed):
            params = chat_params(req, len(prompt_ids), state.max_model_len, state.vocab_size,
                                 state.config.max_logprobs, state.sampling_defaults,
                                 extras.structured_outputs)
            if req.logprobs:  # -1 resolved to the whole vocabulary
                req.top_logprobs = params.logprobs
            engine.add_request(rid, prompt_ids, params, stream, priority=req.priority,
                               lora_request=state.lora_request(req.model), **extras.engine_kwargs(req, prompt_ids))
    except BaseException:
        stream.close()
        raise
    finals = await collect(raw, stream)
    if finals is None:
        return Response(status_code=499)
    usage = UsageCounter(count_reasoning=parsed[0][2].count_reasoning())
    for rid in ids:  # one conversation's failure is the batch's (they share their sampling fields)
        check_generated(finals[rid])
    choices = []
    for i, (rid, (req, _, extras)) in enumerate(zip(ids, parsed)):
        out = finals[rid]
        usage.update(out)
        body = chat_choice(req, out.outputs[0], echo_text(req), extras.tools, extras.output_parser(req))
        body["index"] = i
        choices.append(body)
    response = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}
    return JSONResponse(response, headers=response_headers(state, raw, finals[ids[0]]))
