"""POST /v1/chat/completions: the model's own chat template, streamed or whole."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

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
from tokenloom.server.reasoning import OutputParser, ReasoningSetup
from tokenloom.server.responses import JSONResponse, UsageCounter, chat_logprobs, prompt_logprobs_json
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
    """What parse_chat worked out beyond the body: the tool setup, the request's constraint, and its
    reasoning parsing (None without --reasoning-parser)."""

    tools: ToolSetup | None = None
    structured_outputs: StructuredOutputsParams | None = None
    reasoning: ReasoningSetup | None = None

    def output_parser(self, req: ChatCompletionRequest) -> OutputParser | None:
        """A fresh parser for one choice's output when the server parses reasoning (None: tool_calls.py's
        handling alone, as before)."""
        if self.reasoning is None:
            return None
        return OutputParser(self.reasoning.make(), self.tools, req.include_reasoning, req)

    def count_reasoning(self) -> Any:
        """usage's reasoning-token count (None without a reasoning parser)."""
        return self.reasoning.make().count_reasoning_tokens if self.reasoning is not None else None

    def engine_kwargs(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> dict[str, Any]:
        """The reasoning gate's arguments for engine.add_request (none without a reasoning parser)."""
        if self.reasoning is None:
            return {}
        return self.reasoning.engine_kwargs(req.include_reasoning, prompt_ids)


async def parse_chat(state: ServerState, obj: dict[str, Any]) -> tuple[ChatCompletionRequest, list[int], ChatExtras]:
    """Validate one chat request and render its prompt (the batch endpoint shares this)."""
    reject_unsupported_chat(obj)
    req = parse_model(ChatCompletionRequest, obj)
    if req.return_tokens_as_token_ids is None:  # --return-tokens-as-token-ids: the server's default
        req.return_tokens_as_token_ids = state.config.return_tokens_as_token_ids
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
    chat_kwargs = template_kwargs(req.chat_template_kwargs, req.reasoning_effort)
    if state.reasoning_parser_cls is not None:
        extras.reasoning = ReasoningSetup(state.reasoning_parser_cls, state.tokenizer, chat_kwargs or {})
        extras.reasoning.adjust_request(req)
    template_tools = render_tools(tools, config.exclude_tools_when_tool_choice_none)
    tools_prompt = None
    if template_tools and not template_renders_tools(req.chat_template or state.tokenizer.chat_template):
        tools_prompt = tools_system_prompt(template_tools, (tools.parser if tools else None) or "hermes")
    forwarded = forwarded_prompt_token_ids(req, state.vocab_size)
    if forwarded is not None:  # the prefill stage's ids, run as they are (vLLM's decode-side token reuse)
        return req, truncate_prompt(forwarded, req, state.max_model_len), extras
    prompt_ids = await state.in_tokenizer_thread(
        render_chat, state.tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
        chat_kwargs, req.add_special_tokens, req.chat_template,
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
                tools: ToolSetup | None = None, parser: OutputParser | None = None) -> dict[str, Any]:
    """One choice of a whole response. `parser` (a server with --reasoning-parser): the reasoning split out
    into `reasoning`, the tool calls read from the content after it; with include_reasoning false the
    logprobs and token ids are left out too, so they do not show the reasoning (vLLM's rule). The caller has
    checked the request with `check_generated`."""
    top_n = None if req.logprob_token_ids else (req.top_logprobs or 0)
    role = response_role(req)
    reasoning: str | None = None
    content: str | None = comp.text
    calls: list[dict[str, Any]] = []
    if parser is not None:
        reasoning, content, calls = parser.parse(comp.text)
    elif tools is not None and tools.parses_calls:
        content, calls = parse_output(comp.text, tools)
    message: dict[str, Any] = {"role": role, "content": (prefix + content) if content is not None else (prefix or None)}
    if tools is not None and tools.parses_calls:
        message["tool_calls"] = calls
    message["reasoning"] = reasoning  # vLLM's message has the field, null without a reasoning parser
    hide = parser is not None and not req.include_reasoning
    body: dict[str, Any] = {"index": comp.index, "message": message, "logprobs": None,
                            "finish_reason": tool_finish_reason(comp.finish_reason, tools, calls),
                            "stop_reason": comp.stop_reason,
                            "token_ids": comp.token_ids if req.return_token_ids and not hide else None}
    if comp.logprobs is not None and not hide:
        body["logprobs"] = chat_logprobs(comp.token_ids, comp.logprobs, top_n, bool(req.return_tokens_as_token_ids))
    return body


def check_generated(out: RequestOutput) -> None:
    """A request the engine ended with an error fails the answer: 400 when its own grammar could not be completed,
    else 500. The error is the request's (`out.error`); its completions only say that they failed."""
    if any(comp.finish_reason == "error" for comp in out.outputs):
        raise generation_error(out.error)


def chat_response(req: ChatCompletionRequest, out: RequestOutput, request_id: str, model: str,
                  extras: ChatExtras | None = None, details: str | None = None) -> dict[str, Any]:
    extras = extras or ChatExtras()
    prefix = echo_text(req)
    check_generated(out)
    choices = [chat_choice(req, comp, prefix, extras.tools, extras.output_parser(req)) for comp in out.outputs]
    usage = UsageCounter(details, extras.count_reasoning())
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
                               lora_request=state.lora_request(req.model), **extras.engine_kwargs(req, prompt_ids))
    except BaseException:
        stream.close()
        raise
    if req.use_beam_search:  # the search's one output, with the logprobs the request asked for
        stream = ShapedStream(stream, (req.top_logprobs or 0) if req.logprobs else None)
    if req.stream:
        return _stream(state, req, stream, request_id, model, extras)
    finals = await collect(raw, stream)
    if finals is None:  # the client went away; its request was aborted
        return Response(status_code=499)
    out = finals[engine_id]
    details = state.config.usage_details("chat", req.use_beam_search)
    return JSONResponse(chat_response(req, out, request_id, model, extras, details),
                        headers=response_headers(state, raw, out))


def _stream(state: ServerState, req: ChatCompletionRequest, stream: Any, request_id: str, model: str,
            extras: ChatExtras) -> Response:
    tools = extras.tools
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
    output_parsers: dict[int, OutputParser] = {}
    # include_reasoning false: no logprobs or token ids in the chunks, which would show the reasoning (vLLM's).
    hide = extras.reasoning is not None and not req.include_reasoning

    def delta_of(index: int, out: RequestOutput, comp: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The chunk's delta and finish reason: text as content, or what the parsers make of it."""
        if extras.reasoning is not None:
            output_parser = output_parsers.get(index)
            if output_parser is None:
                output_parser = output_parsers[index] = extras.output_parser(req)  # type: ignore[assignment]
            assert output_parser is not None
            message = output_parser.parse_delta(comp.delta_text, comp.delta_token_ids, out.prompt_token_ids,
                                                comp.finish_reason is not None)
            return (message.as_delta() if message is not None else {}), output_parser.finish_reason(comp.finish_reason)
        if tools is None or not tools.parses_calls:
            return ({"content": comp.delta_text} if comp.delta_text else {}), comp.finish_reason
        parser = parsers.setdefault(index, StreamingToolParser(tools))
        delta = parser.feed(comp.delta_text, comp.finish_reason is not None, comp.delta_token_ids)
        return delta or {}, parser.finish_reason(comp.finish_reason)

    def choice(index: int, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
        wants_tokens = comp.delta_token_ids and (req.logprobs or req.return_token_ids) and not hide
        if not (comp.delta_text or comp.finish_reason or wants_tokens or extras.reasoning is not None):
            return None
        delta, finish = delta_of(index, out, comp)
        if not (delta or finish or wants_tokens):
            return None
        body: dict[str, Any] = {"index": index, "delta": delta,
                                "logprobs": None, "finish_reason": finish,
                                "stop_reason": comp.stop_reason}
        if comp.delta_logprobs is not None and not hide:
            body["logprobs"] = chat_logprobs(comp.delta_token_ids, comp.delta_logprobs, top_n, as_ids)
        if req.return_token_ids and not hide:
            body["token_ids"] = comp.delta_token_ids
        return body

    usage_on = usage_flags(req.stream_options, state.config.enable_force_include_usage)
    events = sse_events(stream, head, lambda out, comp: comp.index, choice, opening, usage_on,
                        state.config.usage_details("chat", req.use_beam_search), extras.count_reasoning())
    return SSEResponse(events, stream)
