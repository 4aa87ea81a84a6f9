"""POST /v1/chat/completions: the model's own chat template, streamed or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError
from tokenloom.server.params import chat_params, check_chat_request, render_chat
from tokenloom.server.protocol import ChatCompletionRequest
from tokenloom.server.responses import UsageCounter, chat_logprobs, queue_time_header
from tokenloom.server.state import get_state
from tokenloom.server.streaming import SSEResponse, collect, sse_events


async def create_chat_completion(raw: Request) -> Response:
    state = get_state(raw)
    req = parse_model(ChatCompletionRequest, await read_json(raw, state.config.max_request_body_bytes))
    model = state.model_name(req.model)
    check_chat_request(req)
    prompt_ids = await state.in_tokenizer_thread(
        render_chat, state.tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
        req.chat_template_kwargs, req.add_special_tokens,
    )
    params = chat_params(req, len(prompt_ids), state.max_model_len, state.sampling_defaults)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine = state.engine
    stream = engine.open_stream()
    try:
        engine.add_request(request_id, prompt_ids, params, stream, priority=req.priority)
    except BaseException:
        stream.close()
        raise
    top_n = req.top_logprobs or 0
    if req.stream:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        opening = [
            {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            for i in range(req.n)
        ]

        def choice(index: int, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
            wants_tokens = comp.delta_token_ids and (req.logprobs or req.return_token_ids)
            if not (comp.delta_text or comp.finish_reason or wants_tokens):
                return None
            body: dict[str, Any] = {"index": index, "delta": {"content": comp.delta_text} if comp.delta_text else {},
                                    "logprobs": None, "finish_reason": comp.finish_reason,
                                    "stop_reason": comp.stop_reason}
            if comp.delta_logprobs is not None:
                body["logprobs"] = chat_logprobs(comp.delta_token_ids, comp.delta_logprobs, top_n)
            if req.return_token_ids:
                body["token_ids"] = comp.delta_token_ids
            return body

        events = sse_events(
            stream, head, lambda out, comp: comp.index, choice, opening, req.stream_options
        )
        return SSEResponse(events, stream)

    finals = await collect(raw, stream)
    if finals is None:  # the client went away; its request was aborted
        return Response(status_code=499)
    out = finals[request_id]
    choices = []
    for comp in out.outputs:
        if comp.finish_reason == "error":
            raise APIError(500, out.error or "generation failed")
        body: dict[str, Any] = {"index": comp.index, "message": {"role": "assistant", "content": comp.text},
                                "logprobs": None, "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
        if comp.logprobs is not None:
            body["logprobs"] = chat_logprobs(comp.token_ids, comp.logprobs, top_n)
        if req.return_token_ids:
            body["token_ids"] = comp.token_ids
        choices.append(body)
    usage = UsageCounter()
    usage.update(out)
    response = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}
    if req.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return JSONResponse(response, headers=queue_time_header(out))
