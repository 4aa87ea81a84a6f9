"""POST /v1/completions: text or token-id prompts, one or a batch, streamed or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError
from tokenloom.server.params import check_completion_request, completion_params, completion_prompts
from tokenloom.server.protocol import CompletionRequest
from tokenloom.server.responses import UsageCounter, completion_logprobs, queue_time_header
from tokenloom.server.state import get_state
from tokenloom.server.streaming import SSEResponse, collect, sse_events


async def create_completion(raw: Request) -> Response:
    state = get_state(raw)
    req = parse_model(CompletionRequest, await read_json(raw, state.config.max_request_body_bytes))
    model = state.model_name(req.model)
    check_completion_request(req)
    prompts = await state.in_tokenizer_thread(completion_prompts, req, state.tokenizer)
    params = [completion_params(req, len(ids), state.max_model_len, state.sampling_defaults) for _, ids in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    engine = state.engine
    stream = engine.open_stream()
    try:
        for rid, (text, token_ids), p in zip(ids, prompts, params):
            engine.add_request(rid, token_ids, p, stream, prompt=text, priority=req.priority)
    except BaseException:
        stream.close()
        raise
    position = {rid: i for i, rid in enumerate(ids)}
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    if req.stream:
        offsets: dict[int, int] = {}

        def choice(index: int, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
            wants_tokens = comp.delta_token_ids and (req.logprobs is not None or req.return_token_ids)
            if not (comp.delta_text or comp.finish_reason or wants_tokens):
                return None
            body: dict[str, Any] = {"index": index, "text": comp.delta_text, "logprobs": None,
                                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if comp.delta_logprobs is not None:
                body["logprobs"] = completion_logprobs(comp.delta_token_ids, comp.delta_logprobs,
                                                       offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(comp.delta_text)
            if req.return_token_ids:
                body["token_ids"] = comp.delta_token_ids
            return body

        def index_of(out: RequestOutput, comp: CompletionOutput) -> int:
            return position[out.request_id] * req.n + comp.index

        events = sse_events(stream, head, index_of, choice, [], req.stream_options)
        return SSEResponse(events, stream)

    finals = await collect(raw, stream)
    if finals is None:  # the client went away; its requests were aborted
        return Response(status_code=499)
    usage = UsageCounter()
    choices = []
    for rid in ids:
        out = finals[rid]
        usage.update(out)
        for comp in out.outputs:
            if comp.finish_reason == "error":
                raise APIError(500, out.error or "generation failed")
            body = {"index": position[rid] * req.n + comp.index, "text": comp.text, "logprobs": None,
                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if comp.logprobs is not None:
                body["logprobs"] = completion_logprobs(comp.token_ids, comp.logprobs, 0)
            if req.return_token_ids:
                body["token_ids"] = comp.token_ids
                body["prompt_token_ids"] = out.prompt_token_ids
            choices.append(body)
    return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()},
                        headers=queue_time_header(finals[ids[0]]))

