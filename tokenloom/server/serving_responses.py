"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's Responses API as
vLLM 0.32 serves it for a model without Harmony (vLLM: entrypoints/openai/responses/serving.py, its
SimpleContext path; docs/responses.md).

A Responses request is a chat request in other words, and runs as one: its `instructions`, the stored
conversation of `previous_response_id` and its `input` (text, or message / function_call /
function_call_output items) become chat messages, its fields the chat fields they mean (`max_output_tokens`
→ max_completion_tokens, `text.format` → response_format, flat function `tools` → chat tools, ...), and
`parse_chat` / `chat_params` render and check it (chat template, structured outputs, tool grammar, limits).
The generation comes back as output items: a `message` with one `output_text` part, and a `function_call`
item per tool call (read by the same tool-call code as chat: tool_calls.py). With --reasoning-parser a
`reasoning` item (one `reasoning_text` part) comes first, and the message holds the content after the
reasoning (server/reasoning.py; `include_reasoning: false` leaves the item out). Streamed, as vLLM's events:
response.created, response.in_progress, then per item output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done (function calls:
function_call_arguments.delta / .done; reasoning: reasoning_text.delta / .done), and response.completed
carrying the whole response.

`store` (default true, as OpenAI) keeps the response and its conversation in memory for
`previous_response_id` and GET, bounded by TOKENLOOM_RESPONSES_STORE_SIZE (least recently used go first);
vLLM keeps them in memory too (behind VLLM_ENABLE_RESPONSES_API_STORE, unbounded). Cancel is vLLM's: only a
background response can be cancelled, and background is refused, so a stored response answers vLLM's 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenloom.engine.async_llm import EngineDeadError, InvalidRequestError, RequestStream
from tokenloom.engine.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError, generation_error, generation_error_status
from tokenloom.server.headers import request_priority, response_headers
from tokenloom.server.params import chat_params
from tokenloom.server.protocol import ResponsesNamedToolChoice, ResponsesRequest
from tokenloom.server.reasoning import OutputParser
from tokenloom.server.request_checks import flat_tool_name
from tokenloom.server.response_store import ResponseStore, StoredResponse
from tokenloom.server.responses import JSONResponse, chat_logprobs, json_text
from tokenloom.server.serving_chat import ChatExtras, parse_chat
from tokenloom.server.state import get_state
from tokenloom.server.streaming import SSEResponse, collect
from tokenloom.server.tool_calls import StreamingToolParser, parse_output
from tokenloom.server.tools import ToolSetup
from tokenloom.server.unsupported import reject_unsupported_responses

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
def _text_of(content: Any, where: str) -> str:
    """A message's content (a string, or input_text / output_text / refusal parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}.get(kind or "")
        if key is None:
            raise APIError(400, f"{where}.content.{j}: only text parts are supported (input_text, output_text, "
                                f"refusal), got {kind!r}", "input")
        value = part.get(key)
        if not isinstance(value, str):
            raise APIError(400, f"{where}.content.{j}.{key} must be a string", "input")
        texts.append(value)
    return "\n".join(texts)


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A function call joins the assistant message before it, as vLLM merges them."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _add_reasoning(messages: list[dict[str, Any]], where: str, item: dict[str, Any]) -> None:
    """vLLM's reasoning input item: an assistant message's `reasoning` (its first content part's text, else its
    first summary's), joining the assistant message before it. The chat templates tokenloom renders do not read
    it, so, as in vLLM with such a template, it leaves an (empty) assistant turn."""
    if item.get("encrypted_content"):
        raise APIError(400, "Encrypted content is not supported.", "input")
    parts = []
    for key in ("content", "summary"):
        value = item.get(key)
        if (value is None and key == "content") or (isinstance(value, list) and all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in value)):
            parts.append(value or [])
            continue
        raise APIError(400, f"{where}.{key} must be a list of parts with text", "input")
    content, summary = parts
    reasoning = (content or summary)[0]["text"] if (content or summary) else ""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("reasoning") is None:
        last["reasoning"] = reasoning
    else:
        messages.append({"role": "assistant", "content": None, "reasoning": reasoning})


def _add_item(messages: list[dict[str, Any]], i: int, item: Any) -> None:
    where = f"input.{i}"
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}",
                           "input")
        text = _text_of(item.get("content"), where)
        last = messages[-1] if messages else None
        if role == "assistant" and last is not None and last["role"] == "assistant" and last.get("content", "") is None:
            last["content"] = text  # vLLM: the text joins the assistant message a reasoning item began
        else:
            messages.append({"role": role, "content": text})
    elif kind == "reasoning":
        _add_reasoning(messages, where, item)
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            raise APIError(400, f"{where}: a function_call item needs call_id, name and arguments (strings)", "input")
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:  # vLLM: the flat name the model was shown
            name = flat_tool_name(namespace, name)
        _add_call(messages, {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise APIError(400, f"{where}: a function_call_output item needs call_id (a string)", "input")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where)})
    else:
        raise APIError(400, f"{where}.type {kind!r} is not supported (message, reasoning, function_call, "
                            "function_call_output)", "input")


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up continues from (reasoning aside)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(p.get("text", "") for p in item["content"])})
        elif item["type"] == "function_call":
            name = flat_tool_name(item["namespace"], item["name"]) if item.get("namespace") else item["name"]
            _add_call(messages, {"id": item["call_id"], "type": "function",
                                 "function": {"name": name, "arguments": item["arguments"]}})
    return messages


def build_messages(req: ResponsesRequest, previous: StoredResponse | None) -> list[dict[str, Any]]:
    """vLLM's construct_input_messages: instructions (not carried over), the previous conversation, the input."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if previous is not None:
        messages += [dict(m) for m in previous.messages if m["role"] != "system"]
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, i, item)
    if not messages:
        raise APIError(400, "input must not be empty", "input")
    return messages


def namespaced_names(tools: list[dict[str, Any]] | None) -> dict[str, tuple[str, str]]:
    """Flat name → (name, namespace) of every function in a `namespace` tool (vLLM's
    build_responses_tool_call_name_map)."""
    names: dict[str, tuple[str, str]] = {}
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and inner.get("type") == "function" and isinstance(inner.get("name"), str):
                    names[flat_tool_name(tool["name"], inner["name"])] = (inner["name"], tool["name"])
    return names


def _function(fn: dict[str, Any], name: Any = None) -> dict[str, Any]:
    fields = {k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None}
    return {"type": "function", "function": {**fields, **({"name": name} if name is not None else {})}}


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools → chat's {"type": "function", "function": {...}}; a `namespace` tool's
    functions as `<namespace>__<name>` (vLLM's get_function_tools; its other tools are dropped, as vLLM)."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(inner, list) or not all(
                    isinstance(t, dict) and isinstance(t.get("name"), str) for t in inner):
                raise APIError(400, f"tools.{i}: a namespace tool needs a name and a list of named tools", "tools")
            out += [_function(t, flat_tool_name(namespace, t["name"])) for t in inner if t.get("type") == "function"]
            continue
        if kind != "function":
            raise APIError(400, f"tools.{i}.type {kind!r} is not supported: only function and namespace tools "
                                "(built-in tools such as web_search, file_search, code_interpreter and mcp need a "
                                "tool server)", "tools")
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool  # chat's shape, leniently
        out.append(_function(fn))
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """Responses' tool_choice (resolved by its request checks, request_checks.py) in chat's shape."""
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


def continues_final_message(req: ResponsesRequest) -> bool:
    """vLLM's should_continue_final_message: a last input item that is a message or reasoning item with status
    in_progress / incomplete is a partial turn the model goes on with (no new generation prompt)."""
    if isinstance(req.input, str) or not req.input or not isinstance(req.input[-1], dict):
        return False
    last = req.input[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress",
                                                                                                "incomplete")


def chat_body(req: ResponsesRequest, obj: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request this Responses request means (parse_chat checks and renders it)."""
    continue_final = continues_final_message(req)
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
        raise APIError(400, "Cannot specify both structured_outputs and text.format", "text.format")
    chat_tools = _chat_tools(req.tools) if req.tools else []
    if chat_tools:  # vLLM: Responses tools that leave no function are no tools (chat refuses an empty list)
        body["tools"] = chat_tools
    if not chat_tools and req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice requires a function call, but tools contains no function tool the model "
                            "can call.", "tool_choice")
    body["tool_choice"] = _chat_tool_choice(req.tool_choice if chat_tools else "none")
    include = req.include or []
    unknown = [x for x in include if x != LOGPROBS_INCLUDE]
    if unknown:
        raise APIError(400, f"include {unknown[0]!r} is not supported (only {LOGPROBS_INCLUDE!r})", "include")
    if LOGPROBS_INCLUDE in include:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs:
        raise APIError(400, f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
    if req.truncation == "auto":  # vLLM: keep the prompt's end, room for one output token
        body["truncate_prompt_tokens"] = -1
    return {k: v for k, v in body.items() if v is not None}


def _renamed(exc: APIError) -> APIError:
    """A chat 400 in the Responses request's own field names."""
    message = exc.message
    for chat_name, name in _MESSAGE_NAMES:
        message = message.replace(chat_name, name)
    return APIError(exc.status, message, _FIELD_NAMES.get(exc.param or "", exc.param), exc.headers)


# Output items ---------------------------------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None,
                 ) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    """vLLM's ResponseReasoningItem: the reasoning as one reasoning_text part (none while it streams in)."""
    content = None if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content, "encrypted_content": None,
            "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str,
              namespaces: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A function_call item; a namespace's function (flat name in `namespaces`) as its name and namespace."""
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if namespaces and name in namespaces:
        item["name"], item["namespace"] = namespaces[name]
    return item


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
    created_at: int = field(default_factory=lambda: int(time.time()))
    extras: ChatExtras = field(default_factory=ChatExtras)  # parse_chat's: the reasoning parsing among them

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
        return chat_logprobs(token_ids, entries, self.req.top_logprobs or 0)["content"]

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
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": self.params.max_tokens, "max_tool_calls": None,
            "metadata": req.metadata, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "service_tier": req.service_tier or "auto", "store": bool(req.store),
            "temperature": self.params.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": _echo(req.tool_choice), "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0, "top_p": self.params.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "input_messages": input_messages, "output_messages": output_messages,
        }

    def store(self, store: ResponseStore, body: dict[str, Any]) -> None:
        if self.req.store:
            store.put(self.response_id, StoredResponse(body, self.messages + output_messages(body["output"])))


def _status(comp: CompletionOutput) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(comp.finish_reason or "", "completed")


def whole_output(ctx: ResponseContext, comp: CompletionOutput) -> list[dict[str, Any]]:
    """vLLM's _make_response_output_items: the reasoning (with a reasoning parser) as a reasoning item, the text
    as a message, each tool call as a function_call item."""
    tools = ctx.tools
    calls: list[dict[str, Any]] = []
    content: str | None = comp.text
    items = []
    parser = ctx.output_parser()
    if parser is not None:
        reasoning, content, calls = parser.parse(comp.text)
        if reasoning:
            items.append(reasoning_item(_item_id("rs"), reasoning, None))
    elif tools is not None and tools.parses_calls:
        content, calls = parse_output(comp.text, tools)
    # vLLM: no text (and no call) is a message without content parts; with a reasoning parser, no message then.
    if content or (not calls and parser is None):
        shown = not calls and (parser is None or ctx.req.include_reasoning)
        logprobs = ctx.logprobs(comp.token_ids, comp.logprobs) if shown else None
        items.append(message_item(_item_id("msg"), content or None, "completed", logprobs))
    namespaces = namespaced_names(ctx.req.tools)
    items += [call_item(_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed",
                        namespaces) for c in calls]
    return items


# Routes ---------------------------------------------------------------------------------------------
async def create_response(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    reject_unsupported_responses(obj)
    req = parse_model(ResponsesRequest, obj)
    store = state.responses
    previous = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
    messages = build_messages(req, previous)
    try:
        chat_req, prompt_ids, extras = await parse_chat(state, chat_body(req, obj, messages))
        params = chat_params(chat_req, len(prompt_ids), state.max_model_len, state.vocab_size,
                             state.config.max_logprobs, state.sampling_defaults, extras.structured_outputs)
    except APIError as exc:
        raise _renamed(exc) from None
    ctx = ResponseContext(req, obj, req.request_id or _item_id("resp"), state.model_name(req.model), params,
                          extras.tools, messages, extras=extras)
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


async def retrieve_response(raw: Request, response_id: str) -> JSONResponse:
    if raw.query_params.get("stream", "false").lower() not in ("false", "0") or "starting_after" in raw.query_params:
        raise APIError(400, "only background responses can be streamed again, and background is not supported",
                       "stream")
    stored = get_state(raw).responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


async def cancel_response(raw: Request, response_id: str) -> JSONResponse:
    stored = get_state(raw).responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    # vLLM's rule: only a queued or in-progress (background) response can be cancelled.
    raise APIError(400, "Cannot cancel a synchronous response.", "response_id")


# Streaming ------------------------------------------------------------------------------------------
class _EventWriter:
    """The stream's events, numbered, in SSE's `event:` / `data:` framing (vLLM's)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json_text(event, allow_nan=True)}\n\n"


@dataclass
class _OpenItem:
    index: int
    item: dict[str, Any]
    text: str = ""  # the message's text, or the call's arguments, so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class _ItemStream:
    """Output items as their events: at most one open at a time (vLLM's SimpleStreamingEventProcessor)."""

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.done: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open.item["type"] != "message":
            events += self.close()
            item = message_item(_item_id("msg"), None, "in_progress")
            self.open = _OpenItem(len(self.done), item)
            events.append({"type": "response.output_item.added", "output_index": self.open.index, "item": item})
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": self.open.index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        self.open.text += delta
        self.open.logprobs += logprobs or []
        events.append({"type": "response.output_text.delta", "item_id": self.open.item["id"],
                       "output_index": self.open.index, "content_index": 0, "delta": delta,
                       "logprobs": logprobs or []})
        return events

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        """vLLM's emit_simple_reasoning_open / _delta: a reasoning item opened on its first piece."""
        events = []
        if self.open is None or self.open.item["type"] != "reasoning":
            events += self.close()
            item = reasoning_item(_item_id("rs"), None, "in_progress")
            self.open = _OpenItem(len(self.done), item)
            events.append({"type": "response.output_item.added", "output_index": self.open.index, "item": item})
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": self.open.index, "content_index": 0,
                           "part": {"text": "", "type": "reasoning_text"}})
        self.open.text += delta
        events.append({"type": "response.reasoning_text.delta", "item_id": self.open.item["id"],
                       "output_index": self.open.index, "content_index": 0, "delta": delta})
        return events

    def call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        events = self.close()
        item = call_item(_item_id("fc"), call_id, name, "", "in_progress", namespaced_names(self.ctx.req.tools))
        self.open = _OpenItem(len(self.done), item)
        events.append({"type": "response.output_item.added", "output_index": self.open.index, "item": item})
        return events

    def arguments(self, delta: str) -> list[dict[str, Any]]:
        if self.open is None or self.open.item["type"] != "function_call" or not delta:
            return []
        self.open.text += delta
        return [{"type": "response.function_call_arguments.delta", "item_id": self.open.item["id"],
                 "output_index": self.open.index, "delta": delta}]

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        o, self.open = self.open, None
        item_id, index = o.item["id"], o.index
        if o.item["type"] == "message":
            item = message_item(item_id, o.text, "completed", o.logprobs if self.ctx.wants_logprobs else None)
            part = item["content"][0]
            events = [{"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                       "content_index": 0, "text": o.text, "logprobs": part["logprobs"]},
                      {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                       "content_index": 0, "part": part}]
        elif o.item["type"] == "reasoning":  # vLLM's emit_simple_reasoning_done
            item = reasoning_item(item_id, o.text, "completed")
            events = [{"type": "response.reasoning_text.done", "item_id": item_id, "output_index": index,
                       "content_index": 0, "text": o.text},
                      {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                       "content_index": 0, "part": item["content"][0]}]
        else:
            item = {**o.item, "arguments": o.text, "status": "completed"}
            events = [{"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": index,
                       "name": item["name"], "arguments": o.text}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        self.done.append(item)
        return events


async def _events(ctx: ResponseContext, stream: RequestStream, store: ResponseStore) -> AsyncIterator[str]:
    write = _EventWriter()
    initial = ctx.response("in_progress", [], None)
    yield write({"type": "response.created", "response": initial})
    yield write({"type": "response.in_progress", "response": initial})
    items = _ItemStream(ctx)
    output_parser = ctx.output_parser()
    parser = StreamingToolParser(ctx.tools) if ctx.tools is not None and ctx.tools.parses_calls else None
    if output_parser is not None:
        parser = None  # the output parser runs the tool calls after the reasoning
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
                delta: dict[str, Any] = message.as_delta() if message is not None else {}
            elif parser is None:
                delta = {"content": comp.delta_text} if comp.delta_text else {}
            else:
                delta = parser.feed(comp.delta_text, final, comp.delta_token_ids) or {}
            if delta.get("reasoning"):  # vLLM's split_delta order: reasoning, then content, then tool calls
                for event in items.reasoning(delta["reasoning"]):
                    yield write(event)
            if delta.get("content"):
                # Logprobs follow the tokens only while the text is the model's own (no tool parser holding any
                # back); behind a reasoning parser they are the step's, as vLLM's, unless the reasoning is hidden.
                shown = parser is None and (output_parser is None or ctx.req.include_reasoning)
                logprobs = ctx.logprobs(comp.delta_token_ids, comp.delta_logprobs) if shown else None
                for event in items.text(delta["content"], logprobs):
                    yield write(event)
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id"):
                    for event in items.call(tc["id"], fn.get("name") or ""):
                        yield write(event)
                for event in items.arguments(fn.get("arguments") or ""):
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
