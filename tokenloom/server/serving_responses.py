"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's Responses API as
vLLM 0.32 serves it for a model without Harmony (vLLM: entrypoints/openai/responses/serving.py, its
SimpleContext path; docs/responses.md).

A Responses request is a chat request in other words, and runs as one: its `instructions`, the stored
conversation of `previous_response_id` and its `input` (text, or message / reasoning / function_call /
custom_tool_call / tool output items) become chat messages by vLLM's rules (responses_input.py), its fields the
chat fields they mean (`max_output_tokens` → max_completion_tokens, `text.format` → response_format, function,
namespace and custom `tools` → chat functions: responses_tools.py, ...), and `parse_chat` / `chat_params` render
and check it (chat template, structured outputs, tool grammar, limits). The generation comes back as output
items (responses_output.py): a `message` with one `output_text` part, and a `function_call` (a custom tool's:
`custom_tool_call`) item per tool call, read by the same tool-call code as chat (tool_calls.py). With
--reasoning-parser a `reasoning` item (one `reasoning_text` part) comes first, and the message holds the content
after the reasoning (server/reasoning.py; `include_reasoning: false` leaves the item out). Streamed, as vLLM's
events (responses_events.py): response.created, response.in_progress, each item's events, and
response.completed carrying the whole response.

`store` (default true, as OpenAI) keeps the response and its conversation in memory for
`previous_response_id` and GET, bounded by TOKENLOOM_RESPONSES_STORE_SIZE (least recently used go first);
vLLM keeps them in memory too (behind VLLM_ENABLE_RESPONSES_API_STORE, unbounded). `background` is vLLM's:
stored queued and answered at once, generated in a task of the server (responses_background.py); cancel stops
only such a response, any other answers vLLM's 400.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tokenloom.engine.async_llm import EngineDeadError, InvalidRequestError, RequestStream
from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError, generation_error, generation_error_status
from tokenloom.server.headers import request_priority, response_headers
from tokenloom.server.params import chat_params
from tokenloom.server.protocol import ChatCompletionRequest, ResponsesNamedToolChoice, ResponsesRequest
from tokenloom.server.reasoning import OutputParser
from tokenloom.server.response_store import ResponseStore, StoredResponse
from tokenloom.server.responses import JSONResponse, chat_logprobs, json_text
from tokenloom.server.responses_background import EventLog
from tokenloom.server.responses_events import ItemStream, split_delta
from tokenloom.server.responses_input import (
    construct_chat_messages_with_tool_call,
    construct_input_messages,
    should_continue_final_message,
)
from tokenloom.server.responses_output import build_response_output_items, message_item, new_item_id
from tokenloom.server.responses_tools import ToolNames, chat_tools
from tokenloom.server.serving_chat import ChatExtras, parse_chat
from tokenloom.server.state import ServerState, get_state
from tokenloom.server.streaming import SSEResponse, collect, merge_final
from tokenloom.server.tool_calls import StreamingToolParser, parse_output
from tokenloom.server.tool_parsers import DeltaMessage
from tokenloom.server.tools import ToolSetup
from tokenloom.server.unsupported import reject_unsupported_responses

logger = logging.getLogger(__name__)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat fields (what parse_chat's 400s name) → the Responses fields they came from: the `param`, and the
# words of the message (longest first; not "messages" or "logprobs", which are common words there).
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "messages": "input", "truncate_prompt_tokens": "truncation", "logprobs": "include"}
_MESSAGE_NAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                  ("max_completion_tokens", "max_output_tokens"), ("truncate_prompt_tokens", "truncation"))


def _not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param)


# Request → chat messages and chat fields ------------------------------------------------------------
def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up continues from: its text and, unlike vLLM
    0.32 (which keeps only the text), its tool calls, so that a function_call_output answering one follows the
    call; reasoning is left out, as vLLM does."""
    return construct_chat_messages_with_tool_call(
        [item for item in output if item["type"] != "reasoning" and (item["type"] != "message" or item["content"])])


def build_messages(req: ResponsesRequest, previous: StoredResponse | None) -> list[dict[str, Any]]:
    """vLLM's construct_input_messages: instructions (not carried over), the previous conversation, the input."""
    messages = construct_input_messages(request_instructions=req.instructions, request_input=req.input,
                                        prev_msg=previous.messages if previous is not None else None)
    if not messages:
        raise APIError(400, "input must not be empty", "input")
    return messages


def _chat_tool_choice(choice: Any) -> Any:
    """Responses' tool_choice (resolved by its request checks, request_checks.py) in chat's shape: a named custom
    tool is the function it is shown as."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, ResponsesNamedToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise APIError(400, f"tool_choice {kind!r} is not supported: 'none', 'auto', 'required' or "
                        '{"type": "function", "name": ...}', "tool_choice")


def _echo(value: Any) -> Any:
    """A request field as the response object repeats it (JSON)."""
    return value.model_dump() if isinstance(value, BaseModel) else value


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format → chat's response_format (the json_schema fields sit one level up in Responses)."""
    if text is None:
        return None
    unknown = [k for k in text if k not in ("format", "verbosity")]
    if unknown:
        raise APIError(400, f"text.{unknown[0]} is not supported", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise APIError(400, "text.verbosity is not supported (other than 'medium')", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise APIError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "text.format")


def chat_body(req: ResponsesRequest, obj: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request this Responses request means (parse_chat checks and renders it)."""
    continue_final = should_continue_final_message(req.input)
    body: dict[str, Any] = {
        "add_generation_prompt": not continue_final, "continue_final_message": continue_final,
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "stop": req.stop, "stop_token_ids": req.stop_token_ids, "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "include_stop_str_in_output": req.include_stop_str_in_output,
        "priority": req.priority, "logit_bias": req.logit_bias, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text), "structured_outputs": req.structured_outputs,
        # vLLM without a reasoning parser: the effort only reaches the chat template (params.template_kwargs).
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "chat_template_kwargs": req.chat_template_kwargs, "vllm_xargs": req.vllm_xargs,
        "include_reasoning": req.include_reasoning,
    }
    if req.text is not None and body["response_format"] is not None and req.structured_outputs is not None:
        raise APIError(400, "Cannot specify both structured_outputs and text.format", "structured_outputs")
    functions = chat_tools(req.tools) if req.tools else []
    if functions:  # vLLM: Responses tools that leave no function are no tools (chat refuses an empty list)
        body["tools"] = functions
    if not functions and req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice requires a function call, but tools contains no function tool the model "
                            "can call.", "tool_choice")
    body["tool_choice"] = _chat_tool_choice(req.tool_choice if functions else "none")
    include = req.include or []
    unknown = [x for x in include if x != LOGPROBS_INCLUDE]
    if unknown:
        raise APIError(400, f"include {unknown[0]!r} is not supported (only {LOGPROBS_INCLUDE!r})", "include")
    if LOGPROBS_INCLUDE in include:  # vLLM: top_logprobs without it asks for nothing
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.truncation == "auto":  # vLLM: keep the prompt's end, room for one output token
        body["truncate_prompt_tokens"] = -1
    return {k: v for k, v in body.items() if v is not None}


def responses_sampling_params(req: ResponsesRequest, chat: ChatCompletionRequest, prompt_len: int,
                              max_model_len: int, vocab_size: int, max_logprobs: int,
                              defaults: dict[str, Any] | None = None,
                              structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """The chat request's sampling parameters, with vLLM's Responses rules on top: a prompt that fills the context
    is its 400; a max_output_tokens past the whole context is its 400, any other is held to the room the prompt
    leaves (vLLM's get_max_tokens); and
    extra_args is a dict even when empty (vLLM's ResponsesRequest.to_sampling_params, which custom logits
    processors read)."""
    if prompt_len == max_model_len:  # vLLM's _validate_generator_input (a longer prompt is refused as chat's is)
        raise APIError(400, f"The engine prompt length {prompt_len} exceeds the max_model_len {max_model_len}. "
                            "Please reduce prompt.", "input")
    wanted = req.max_output_tokens
    if wanted is not None and wanted > max_model_len:
        raise APIError(400, f"max_output_tokens={wanted} cannot be greater than max_model_len={max_model_len}. "
                            "Please request fewer output tokens.", "max_output_tokens")
    if wanted is not None:
        chat = chat.model_copy(update={"max_completion_tokens": min(wanted, max(max_model_len - prompt_len, 1))})
    params = chat_params(chat, prompt_len, max_model_len, vocab_size, max_logprobs, defaults, structured_outputs)
    params.extra_args = params.extra_args or {}
    return params


def _renamed(exc: APIError) -> APIError:
    """A chat 400 in the Responses request's own field names."""
    message = exc.message
    for chat_name, name in _MESSAGE_NAMES:
        message = message.replace(chat_name, name)
    return APIError(exc.status, message, _FIELD_NAMES.get(exc.param or "", exc.param), exc.headers)


@dataclass
class ResponseContext:
    """One Responses request on its way: what the response object echoes, and what the store keeps."""

    req: ResponsesRequest
    obj: dict[str, Any]
    response_id: str
    model: str
    params: SamplingParams
    tools: ToolSetup | None
    messages: list[dict[str, Any]]
    prompt: tuple[str, list[int]] | None = None  # the rendered prompt, kept for enable_response_messages
    events: EventLog | None = None  # a streamed background response's events, kept for GET ?stream=true
    created_at: int = field(default_factory=lambda: int(time.time()))
    extras: ChatExtras = field(default_factory=ChatExtras)  # parse_chat's: the reasoning parsing among them
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" (vLLM's Responses reads the server's flag;
    # its request has no such field)
    tokens_as_ids: bool = False

    def output_parser(self) -> OutputParser | None:
        """The output's reasoning / tool-call parser (None without --reasoning-parser: tool_calls.py's alone)."""
        if self.extras.reasoning is None:
            return None
        return OutputParser(self.extras.reasoning.make(), self.tools, self.req.include_reasoning, self.req)

    def reasoning_tokens(self, comp: CompletionOutput) -> int:
        """usage's output_tokens_details.reasoning_tokens (0 without a reasoning parser, as vLLM)."""
        count = self.extras.count_reasoning()
        return count(comp.token_ids) if count is not None else 0

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.req.include or [])

    def logprobs(self, token_ids: list[int], entries: Any) -> list[dict[str, Any]] | None:
        if not self.wants_logprobs or entries is None:
            return None
        return chat_logprobs(token_ids, entries, self.req.top_logprobs or 0, self.tokens_as_ids)["content"]

    def response(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        req = self.req
        usage = None
        if out is not None:
            prompt = len(out.prompt_token_ids)
            generated = sum(len(c.token_ids) for c in out.outputs)
            reasoning = sum(self.reasoning_tokens(c) for c in out.outputs)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
                     "total_tokens": prompt + generated}
        input_messages = output_messages = None
        if req.enable_response_messages and self.prompt is not None and out is not None:
            # vLLM's SimpleContext: the prompt as one raw message, the output as one (none when empty).
            text, ids = self.prompt
            input_messages = [{"message": text, "tokens": ids, "type": "raw_message_tokens"}]
            comp = out.outputs[0]
            output_messages = [{"message": comp.text, "tokens": list(comp.token_ids), "type": "raw_message_tokens"}
                               ] if comp.text or comp.token_ids else []
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": bool(req.background), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": self.params.max_tokens, "max_tool_calls": None,
            "metadata": req.metadata, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "service_tier": req.service_tier or "auto", "store": bool(req.store),
            "temperature": self.params.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": _echo(req.tool_choice), "tools": req.tools or [],
            # vLLM's from_request: the sampling parameters as used (top_logprobs null without the include)
            "top_logprobs": self.params.logprobs, "top_p": self.params.top_p,
            "presence_penalty": self.params.presence_penalty, "frequency_penalty": self.params.frequency_penalty,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "input_messages": input_messages, "output_messages": output_messages,
        }

    def store(self, store: ResponseStore, body: dict[str, Any]) -> None:
        """Keep (or replace) the stored response; a cancelled one stays as it is (vLLM)."""
        if not self.req.store:
            return
        kept = store.get(self.response_id)
        if kept is not None and kept.body.get("status") == "cancelled":
            return
        store.put(self.response_id, StoredResponse(body, self.messages + output_messages(body["output"]),
                                                   self.events))


def _status(comp: CompletionOutput) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(comp.finish_reason or "", "completed")


def whole_output(ctx: ResponseContext, comp: CompletionOutput) -> list[dict[str, Any]]:
    """vLLM's _make_response_output_items: the reasoning (with a reasoning parser) as a reasoning item, the text
    as a message, each tool call as a function_call (or custom_tool_call) item."""
    tools = ctx.tools
    calls: list[dict[str, Any]] = []
    reasoning, content = None, comp.text
    parser = ctx.output_parser()
    if parser is not None:
        reasoning, content, calls = parser.parse(comp.text)
    elif tools is not None and tools.parses_calls:
        content, calls = parse_output(comp.text, tools)
    shown = not calls and (parser is None or ctx.req.include_reasoning)
    logprobs = ctx.logprobs(comp.token_ids, comp.logprobs) if shown else None
    if parser is None and not calls:  # vLLM's fallback without a parser: the message, no part for no text
        return [message_item(new_item_id("msg"), content or None, "completed", logprobs)]
    return build_response_output_items(reasoning, content, calls, logprobs, ToolNames.of(ctx.req.tools))


# Routes ---------------------------------------------------------------------------------------------
async def create_response(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    reject_unsupported_responses(obj)
    req = parse_model(ResponsesRequest, obj)
    store = state.responses
    if req.background and store.capacity <= 0:  # vLLM's case: its store off, background is its 400
        raise APIError(400, "background responses are kept in the response store, which "
                            "TOKENLOOM_RESPONSES_STORE_SIZE=0 turns off", "background")
    previous = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
    messages = build_messages(req, previous)
    try:
        chat_req, prompt_ids, extras = await parse_chat(state, chat_body(req, obj, messages))
        params = responses_sampling_params(req, chat_req, len(prompt_ids), state.max_model_len, state.vocab_size,
                                           state.config.max_logprobs, state.sampling_defaults,
                                           extras.structured_outputs)
    except APIError as exc:
        raise _renamed(exc) from None
    ctx = ResponseContext(req, obj, req.request_id or new_item_id("resp"), state.model_name(req.model), params,
                          extras.tools, messages, extras=extras, tokens_as_ids=state.config.return_tokens_as_token_ids)
    if req.enable_response_messages:
        ctx.prompt = (state.tokenizer.decode(prompt_ids, skip_special_tokens=False), list(prompt_ids))
    engine_id = f"{ctx.response_id}-{uuid.uuid4().hex[:8]}"
    engine = state.engine
    stream = engine.open_stream()
    try:
        engine.add_request(engine_id, prompt_ids, params, stream, priority=request_priority(raw, req.priority),
                           lora_request=state.lora_request(req.model),
                           **extras.reasoning.engine_kwargs(req.include_reasoning, prompt_ids) if extras.reasoning
                           else {})
    except InvalidRequestError as exc:  # e.g. no room left to generate: the prompt is the input
        stream.close()
        raise APIError(400, str(exc), "input" if exc.param == "prompt" else exc.param) from None
    except BaseException:
        stream.close()
        raise
    if req.background:
        return _start_background(state, ctx, stream)
    if req.stream:
        return SSEResponse(_events(ctx, stream, store), stream)
    finals = await collect(raw, stream)
    if finals is None:  # the client went away; its request was aborted
        return Response(status_code=499)
    out = finals[engine_id]
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        raise generation_error(out.error)
    body = ctx.response(_status(comp), whole_output(ctx, comp), out)
    ctx.store(store, body)
    return JSONResponse(body, headers=response_headers(state, raw, out))


async def retrieve_response(raw: Request, response_id: str) -> Response:
    """The stored response; with ?stream=true a streamed background response's events again, after the
    sequence number `starting_after` (vLLM's)."""
    stored = get_state(raw).responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if raw.query_params.get("stream", "false").lower() in ("false", "0"):
        return JSONResponse(stored.body)
    if stored.events is None:  # vLLM's words: only a background response streamed when created has events
        raise APIError(400, f"Unknown response_id: {response_id}", "response_id")
    after = raw.query_params.get("starting_after")
    if after is not None and not after.lstrip("-").isdigit():
        raise APIError(400, f"starting_after must be an integer, got {after[:40]!r}", "starting_after")
    return _replay(stored.events, int(after) if after is not None else None)


async def cancel_response(raw: Request, response_id: str) -> JSONResponse:
    """vLLM's rule: only a queued or in-progress (background) response can be cancelled; it stays cancelled."""
    state = get_state(raw)
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if stored.body.get("status") not in ("queued", "in_progress"):
        raise APIError(400, "Cannot cancel a synchronous response.", "response_id")
    stored.body["status"] = "cancelled"
    await state.background.cancel(response_id)
    return JSONResponse(stored.body)


# Background -----------------------------------------------------------------------------------------
def _replay(events: EventLog, starting_after: int | None = None) -> StreamingResponse:
    """Events of a background response: they go on without this client, which may leave at any time."""
    return StreamingResponse(events.replay(starting_after), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _start_background(state: ServerState, ctx: ResponseContext, stream: RequestStream) -> Response:
    """vLLM's background mode: the response is stored queued and answered at once (streamed: its events as they
    come), and the generation goes on in a task of the server, without the client."""
    queued = ctx.response("queued", [], None)
    if ctx.req.stream:
        ctx.events = EventLog()
    ctx.store(state.responses, queued)
    state.background.start(ctx.response_id, _run_in_background(ctx, stream, state.responses),
                           lambda: _end_background(ctx, stream, state.responses))
    return _replay(ctx.events) if ctx.events is not None else JSONResponse(queued)


async def _run_in_background(ctx: ResponseContext, stream: RequestStream, store: ResponseStore) -> None:
    """Generate a background response to its end and store it (_end_background follows, however it ends)."""
    try:
        if ctx.events is not None:
            async for frame in _events(ctx, stream, store):
                ctx.events.append(frame)
            return
        last: RequestOutput | None = None
        async for out in stream:
            last = merge_final(last, out)
        comp = last.outputs[0] if last is not None else None
        if comp is not None and comp.finish_reason != "error":
            ctx.store(store, ctx.response(_status(comp), whole_output(ctx, comp), last))
    except EngineDeadError:
        pass  # stored failed by _end_background
    except Exception:
        logger.exception("background response %s failed", ctx.response_id)


def _end_background(ctx: ResponseContext, stream: RequestStream, store: ResponseStore) -> None:
    """After a background run, even one cancelled before it started (vLLM's cancel): its engine request aborted if
    unfinished, its event log closed, and a response that came to no end (an error) stored failed, as vLLM marks
    it."""
    stream.close()
    if ctx.events is not None:
        ctx.events.close()
    kept = store.get(ctx.response_id)
    if kept is not None and kept.body.get("status") == "queued":
        kept.body["status"] = "failed"


# Streaming ------------------------------------------------------------------------------------------
class _EventWriter:
    """The stream's events, numbered, in SSE's `event:` / `data:` framing (vLLM's)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json_text(event, allow_nan=True)}\n\n"


async def _events(ctx: ResponseContext, stream: RequestStream, store: ResponseStore) -> AsyncIterator[str]:
    write = _EventWriter()
    initial = ctx.response("in_progress", [], None)
    yield write({"type": "response.created", "response": initial})
    yield write({"type": "response.in_progress", "response": initial})
    items = ItemStream(ToolNames.of(ctx.req.tools), ctx.wants_logprobs)
    output_parser = ctx.output_parser()
    parser = StreamingToolParser(ctx.tools) if ctx.tools is not None and ctx.tools.parses_calls else None
    if output_parser is not None:
        parser = None  # the output parser runs the tool calls after the reasoning
    # Logprobs follow the tokens only while the text is the model's own (no tool parser holding any back); behind
    # a reasoning parser they are the step's, as vLLM's, unless the reasoning is hidden.
    text_logprobs = parser is None and (output_parser is None or ctx.req.include_reasoning)
    last: RequestOutput | None = None
    status = "completed"
    try:
        async for out in stream:
            last = out
            comp = out.outputs[0]
            if comp.finish_reason == "error":
                code = "invalid_request_error" if generation_error_status(out.error) == 400 else "server_error"
                yield write({"type": "error", "code": code, "message": out.error or "generation failed", "param": None})
                return
            final = comp.finish_reason is not None
            if output_parser is not None:
                message = output_parser.parse_delta(comp.delta_text, comp.delta_token_ids, out.prompt_token_ids,
                                                    final)
                delta = DeltaMessage.model_validate(message.as_delta()) if message is not None else DeltaMessage()
            elif parser is None:
                delta = DeltaMessage(content=comp.delta_text or None)
            else:
                delta = DeltaMessage.model_validate(parser.feed(comp.delta_text, final, comp.delta_token_ids) or {})
            for piece in split_delta(delta):
                logprobs = ctx.logprobs(comp.delta_token_ids, comp.delta_logprobs) \
                    if piece.content and text_logprobs else None
                for event in items.feed(piece, logprobs):
                    yield write(event)
            if final:
                status = _status(comp)
        for event in items.close():
            yield write(event)
        body = ctx.response(status, items.done, last)
        ctx.store(store, body)
        # vLLM sends response.completed whatever the status ("incomplete" at max_output_tokens included).
        yield write({"type": "response.completed", "response": body})
    except EngineDeadError as exc:
        yield write({"type": "error", "code": "server_error", "message": str(exc), "param": None})
