"""POST /v1/chat/completions: the model's own chat template, streamed or whole."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.async_llm import RequestStream
from tokenloom.engine.beam_search_async import BeamSearchStream
from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.beam_search import (
    ShapedStream,
    beam_search_params,
    check_beam_search,
    reject_beam_only_fields,
)
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import generation_error
from tokenloom.server.headers import base_request_id, request_priority, response_headers
from tokenloom.server.params import (
    chat_params,
    check_chat_request,
    check_request_chat_template,
    forwarded_prompt_token_ids,
    message_text,
    render_chat,
    template_kwargs,
    truncate_prompt,
)
from tokenloom.server.protocol import ChatCompletionRequest
from tokenloom.server.responses import UsageCounter, chat_logprobs, prompt_logprobs_json
from tokenloom.server.state import ServerState, get_state
from tokenloom.server.streaming import SSEResponse, collect, sse_events, usage_flags
from tokenloom.server.structured import structured_outputs_of
from tokenloom.server.tool_calls import (
    StreamingToolParser,
    parse_output,
    template_renders_tools,
    tools_system_prompt,
)
from tokenloom.server.tool_calls import finish_reason as tool_finish_reason
from tokenloom.server.tool_parsers import get_tool_parser
from tokenloom.server.tools import ToolSetup, render_tools, tool_setup
from tokenloom.server.unsupported import reject_unsupported_chat

ROLE = "assistant"


@dataclass
class ChatExtras:
    """What parse_chat worked out beyond the body: the tool setup and the request's constraint."""

    tools: ToolSetup | None = None
    structured_outputs: StructuredOutputsParams | None = None


async def parse_chat(state: ServerState, obj: dict[str, Any]) -> tuple[ChatCompletionRequest, list[int], ChatExtras]:
    """Validate one chat request and render its prompt (the batch endpoint shares this)."""
    reject_unsupported_chat(obj)
    req = parse_model(ChatCompletionRequest, obj)
    state.model_name(req.model)
    state.check_generates()
    check_chat_request(req, state.vocab_size)
    config = state.config
    check_request_chat_template(req, config.trust_request_chat_template)
    parser = config.tool_call_parser if config.enable_auto_tool_choice else None
    tools = tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls, parser, "tool_choice" in obj)
    if tools is not None:  # what its tool parser is built with and given (vLLM's)
        tools.tokenizer, tools.request = state.tokenizer, req
    # In the tokenizer thread: checking a large schema (and, on the first constraint, importing
    # xgrammar) must not hold the event loop that relays every other request's stream.
    extras = ChatExtras(tools, await state.in_tokenizer_thread(
        structured_outputs_of, obj, tools, config.tool_strict_level))
    if req.use_beam_search:
        check_beam_search(obj, req, extras.structured_outputs, completion=False)
    else:
        reject_beam_only_fields(req)
    if tools is not None and tools.parser is not None and tools.mode != "none" \
            and get_tool_parser(tools.parser).keeps_special_tokens:
        # vLLM's Hermes adjust_request: the tool-call tags may be special tokens; keep them in the text.
        req.skip_special_tokens = False
    template_tools = render_tools(tools, config.exclude_tools_when_tool_choice_none)
    tools_prompt = None
    if template_tools and not template_renders_tools(req.chat_template or state.tokenizer.chat_template):
        tools_prompt = tools_system_prompt(template_tools, (tools.parser if tools else None) or "hermes")
    forwarded = forwarded_prompt_token_ids(req, state.vocab_size)
    if forwarded is not None:  # the prefill stage's ids, run as they are (vLLM's decode-side token reuse)
        return req, truncate_prompt(forwarded, req, state.max_model_len), extras
    prompt_ids = await state.in_tokenizer_thread(
        render_chat, state.tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
        template_kwargs(req.chat_template_kwargs, req.reasoning_effort), req.add_special_tokens, req.chat_template,
        template_tools if tools_prompt is None else None, req.documents, tools_prompt,
    )
    return req, truncate_prompt(prompt_ids, req, state.max_model_len), extras


def response_role(req: ChatCompletionRequest) -> str:
    """vLLM's get_chat_request_role: the assistant's, or, without a generation prompt, the last message's
    (the model goes on with that turn)."""
    if req.add_generation_prompt or not req.messages:
        return ROLE
    return req.messages[-1].role


def echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when its role is the response's (continue_final_message,
    or no generation prompt)."""
    if req.echo and req.messages and req.messages[-1].role == response_role(req):
        return message_text(req.messages[-1])
    return ""


def chat_choice(req: ChatCompletionRequest, comp: CompletionOutput, prefix: str,
                tools: ToolSetup | None = None) -> dict[str, Any]:
    if comp.finish_reason == "error":
        raise generation_error(comp.error)
    top_n = None if req.logprob_token_ids else (req.top_logprobs or 0)
    role = response_role(req)
    message: dict[str, Any] = {"role": role, "content": prefix + comp.text}
    calls: list[dict[str, Any]] = []
    if tools is not None and tools.parses_calls:
        content, calls = parse_output(comp.text, tools)
        message = {"role": role, "content": (prefix + content) if content is not None else (prefix or None),
                   "tool_calls": calls}
    body: dict[str, Any] = {"index": comp.index, "message": message, "logprobs": None,
                            "finish_reason": tool_finish_reason(comp.finish_reason, tools, calls),
                            "stop_reason": comp.stop_reason,
                            "token_ids": comp.token_ids if req.return_token_ids else None}
    if comp.logprobs is not None:
        body["logprobs"] = chat_logprobs(comp.token_ids, comp.logprobs, top_n, bool(req.return_tokens_as_token_ids))
    return body


def chat_response(req: ChatCompletionRequest, out: RequestOutput, request_id: str, model: str,
                  tools: ToolSetup | None = None, details: str | None = None) -> dict[str, Any]:
    prefix = echo_text(req)
    choices = []
    for comp in out.outputs:
        if comp.finish_reason == "error":
            raise generation_error(out.error)
        choices.append(chat_choice(req, comp, prefix, tools))
    usage = UsageCounter(details)
    usage.update(out)
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage.as_dict(),
            "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
            "kv_transfer_params": out.kv_transfer_params,
            "prompt_token_ids": out.prompt_token_ids if req.return_token_ids else None}


async def create_chat_completion(raw: Request) -> Response:
    state = get_state(raw)
    req, prompt_ids, extras = await parse_chat(state, await read_json(raw, state.config.max_request_body_bytes))
    model = state.model_name(req.model)
    params = chat_params(req, len(prompt_ids), state.max_model_len, state.vocab_size, state.config.max_logprobs,
                         state.sampling_defaults, extras.structured_outputs)
    if req.logprobs:  # -1 resolved to the whole vocabulary
        req.top_logprobs = params.logprobs
    base_id = base_request_id(raw, req.request_id)
    request_id = f"chatcmpl-{base_id}"
    engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"  # unique even when a client reuses its X-Request-Id
    priority = request_priority(raw, req.priority)
    engine = state.engine
    stream: RequestStream | BeamSearchStream | ShapedStream
    stream = BeamSearchStream(engine, state.config.max_logprobs) if req.use_beam_search else engine.open_stream()
    try:
        if isinstance(stream, BeamSearchStream):
            stream.add(engine_id, prompt_ids, beam_search_params(req, params.max_tokens, state.sampling_defaults),
                       seed=req.seed, priority=req.priority, lora_request=state.lora_request(req.model))
        else:
            engine.add_request(engine_id, prompt_ids, params, stream, priority=priority,
                               lora_request=state.lora_request(req.model))
    except BaseException:
        stream.close()
        raise
    if req.use_beam_search:  # the search's one output, with the logprobs the request asked for
        stream = ShapedStream(stream, (req.top_logprobs or 0) if req.logprobs else None)
    if req.stream:
        return _stream(state, req, stream, request_id, model, extras.tools)
    finals = await collect(raw, stream)
    if finals is None:  # the client went away; its request was aborted
        return Response(status_code=499)
    out = finals[engine_id]
    details = state.config.usage_details("chat", req.use_beam_search)
    return JSONResponse(chat_response(req, out, request_id, model, extras.tools, details),
                        headers=response_headers(state, raw, out))


def _stream(state: ServerState, req: ChatCompletionRequest, stream: Any, request_id: str, model: str,
            tools: ToolSetup | None = None) -> Response:
    head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    top_n = None if req.logprob_token_ids else (req.top_logprobs or 0)
    as_ids = bool(req.return_tokens_as_token_ids)
    prefix = echo_text(req)
    role = response_role(req)

    def opening(out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for i in range(req.n):
            chunk = {**head, "choices": [{"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                                          "finish_reason": None}]}
            if req.return_token_ids:  # vLLM: the prompt's ids ride on the role chunk
                chunk["prompt_token_ids"] = out.prompt_token_ids
            chunks.append(chunk)
        if prefix:
            chunks += [{**head, "choices": [{"index": i, "delta": {"content": prefix}, "logprobs": None,
                                             "finish_reason": None}]} for i in range(req.n)]
        return chunks

    parsers: dict[int, StreamingToolParser] = {}

    def delta_of(index: int, comp: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The chunk's delta and finish reason: text as content, or (tools) what the parser makes of it."""
        if tools is None or not tools.parses_calls:
            return ({"content": comp.delta_text} if comp.delta_text else {}), comp.finish_reason
        parser = parsers.setdefault(index, StreamingToolParser(tools))
        delta = parser.feed(comp.delta_text, comp.finish_reason is not None, comp.delta_token_ids)
        return delta or {}, parser.finish_reason(comp.finish_reason)

    def choice(index: int, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
        wants_tokens = comp.delta_token_ids and (req.logprobs or req.return_token_ids)
        if not (comp.delta_text or comp.finish_reason or wants_tokens):
            return None
        delta, finish = delta_of(index, comp)
        if not (delta or finish or wants_tokens):
            return None
        body: dict[str, Any] = {"index": index, "delta": delta,
                                "logprobs": None, "finish_reason": finish,
                                "stop_reason": comp.stop_reason}
        if comp.delta_logprobs is not None:
            body["logprobs"] = chat_logprobs(comp.delta_token_ids, comp.delta_logprobs, top_n, as_ids)
        if req.return_token_ids:
            body["token_ids"] = comp.delta_token_ids
        return body

    usage_on = usage_flags(req.stream_options, state.config.enable_force_include_usage)
    events = sse_events(stream, head, lambda out, comp: comp.index, choice, opening, usage_on,
                        state.config.usage_details("chat", req.use_beam_search))
    return SSEResponse(events, stream)
