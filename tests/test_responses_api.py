"""POST /v1/responses (and GET / cancel) through the official openai client against `tokenloom serve` on
the default model, a server without tool flags: text whole and streamed (the client's own event
accumulator checks the sequence and the item ids), text.format json_schema, named and required function
tools (function_call items, whole and streamed, arguments valid), a follow-up with previous_response_id
(and one answering a function call with function_call_output), the bounded store, and the 400s / 404s in
the API's error shape, unsupported fields refused by name. docs/responses.md."""

from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from tests.test_server_harness import ServerProcess
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.server.body import parse_model
from tokenloom.server.errors import APIError
from tokenloom.server.params import render_chat, template_kwargs
from tokenloom.server.protocol import ChatCompletionRequest, ResponsesRequest
from tokenloom.server.response_store import ResponseStore, StoredResponse
from tokenloom.server.responses_background import BackgroundRuns, EventLog
from tokenloom.server.responses_events import ItemStream
from tokenloom.server.responses_output import call_item
from tokenloom.server.responses_tools import ToolNames
from tokenloom.server.serving_responses import build_messages, chat_body, output_messages, responses_sampling_params
from tokenloom.server.state import ServerState
from tokenloom.server.unsupported import reject_unsupported_chat

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
ASK = "What is the weather in Paris?"
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]


def test_the_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}))
        store.get("r0")  # r0 is used, so r1 goes when r2 comes
    assert store.get("r1") is None and store.get("r0") is not None and store.get("r2") is not None
    assert len(store) == 2
    off = ResponseStore(0)
    off.put("r", StoredResponse({}))
    assert off.get("r") is None


def test_reasoning_reaches_the_chat_template_as_in_vllm() -> None:
    # vLLM 0.32 without a reasoning parser (ResponsesRequest.build_chat_params, construct_input_messages):
    # reasoning.effort becomes the chat template's reasoning_effort and enable_thinking (unless the request's
    # chat_template_kwargs set it), and a reasoning input item is the `reasoning` of the assistant turn it
    # begins or joins; vLLM's peer tests send both (test_simple.py), tokenloom answered 400.
    obj = {"input": [{"role": "user", "content": "Hello."},
                     {"type": "reasoning", "id": "rs_1", "summary": [],
                      "content": [{"type": "reasoning_text", "text": "Greet back."}]},
                     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
                     {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Short."}]},
                     {"role": "user", "content": "Again."}],
           "reasoning": {"effort": "low"}, "chat_template_kwargs": {"enable_thinking": False, "x": 1}}
    req = parse_model(ResponsesRequest, obj)
    messages = build_messages(req, None)
    assert messages == [{"role": "user", "content": "Hello."},
                        {"role": "assistant", "content": "Hi!", "reasoning": "Greet back."},
                        {"role": "assistant", "reasoning": "Short."},
                        {"role": "user", "content": "Again."}]
    chat = parse_model(ChatCompletionRequest, chat_body(req, obj, messages))
    assert chat.reasoning_effort == "low"
    assert template_kwargs(chat.chat_template_kwargs, chat.reasoning_effort) == {
        "enable_thinking": False, "x": 1, "reasoning_effort": "low"}
    assert template_kwargs(None, "none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs({"a": 1}, None) == {"a": 1}
    tokenizer = load_tokenizer(None)
    ids = render_chat(tokenizer, chat.messages, chat_template_kwargs=template_kwargs(None, "high"),
                      chat_template="[{{ reasoning_effort }} {{ enable_thinking }} {{ messages | length }}]")
    assert tokenizer.decode(ids) == "[high True 4]"


def test_partial_last_message_is_continued_as_in_vllm() -> None:
    # vLLM's should_continue_final_message: an in_progress / incomplete message or reasoning item last is a
    # turn the model goes on with (continue_final_message, no generation prompt); otherwise a new turn.
    partial = {"type": "message", "role": "assistant", "status": "incomplete",
               "content": [{"type": "output_text", "text": "The capital of France is"}]}
    for input_, continued in (([{"role": "user", "content": "Capital of France?"}, partial], True),
                              ([{"role": "user", "content": "Capital of France?"}, {**partial, "status": "completed"}],
                               False),
                              ([{"role": "user", "content": "Hi", "status": "in_progress"}], True),
                              ([{"type": "function_call_output", "call_id": "c", "output": "x",
                                 "status": "incomplete"}], False),
                              ("Hi", False)):
        obj = {"input": input_}
        req = parse_model(ResponsesRequest, obj)
        chat = parse_model(ChatCompletionRequest, chat_body(req, obj, build_messages(req, None)))
        assert (chat.continue_final_message, chat.add_generation_prompt) == (continued, not continued), input_
    tokenizer = load_tokenizer(None)
    obj = {"input": [{"role": "user", "content": "Capital of France?"}, partial]}
    req = parse_model(ResponsesRequest, obj)
    chat = parse_model(ChatCompletionRequest, chat_body(req, obj, build_messages(req, None)))
    text = tokenizer.decode(render_chat(tokenizer, chat.messages, chat.add_generation_prompt,
                                        chat.continue_final_message), skip_special_tokens=False)
    assert text.endswith("The capital of France is")  # the turn left open, no end-of-turn or new turn


def test_reasoning_effort_is_not_refused_on_chat() -> None:
    # vLLM's chat without a reasoning parser takes reasoning_effort (to the chat template) as Responses does.
    body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "high"}
    reject_unsupported_chat(body)
    assert parse_model(ChatCompletionRequest, body).reasoning_effort == "high"


def test_namespace_tools_as_vllm() -> None:
    # vLLM 0.32: a `namespace` tool's functions are shown to the model as `<namespace>__<name>`, a call of one
    # comes back as its own name plus `namespace`, a named tool_choice may use the own name when unambiguous,
    # and a namespaced function_call input item is the flat name again (vLLM's test_namespace_tool_separator).
    app = {"type": "function", "name": "get_app_state", "parameters": {"type": "object"}}
    tools = [{"type": "namespace", "name": "mcp__computer_use", "description": "Computer control tools.",
              "tools": [app, {"type": "custom", "name": "raw"}]},
             {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    obj = {"input": [{"role": "user", "content": "Inspect Chrome."},
                     {"type": "function_call", "call_id": "c1", "name": "get_app_state", "arguments": "{}",
                      "namespace": "mcp__computer_use"}],
           "tools": tools, "tool_choice": {"type": "function", "name": "get_app_state"}}
    req = parse_model(ResponsesRequest, obj)
    messages = build_messages(req, None)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "mcp__computer_use__get_app_state"
    body = chat_body(req, obj, messages)
    assert [t["function"]["name"] for t in body["tools"]] == ["mcp__computer_use__get_app_state", "get_weather"]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "mcp__computer_use__get_app_state"}}
    names = ToolNames.of(tools)
    item = call_item("c2", "mcp__computer_use__get_app_state", '{"app": "Chrome"}', "completed", names)
    assert (item["name"], item["namespace"]) == ("get_app_state", "mcp__computer_use")
    assert "namespace" not in call_item("c3", "get_weather", "{}", "completed", names)
    # The stored output continues with the flat name the model wrote.
    assert output_messages([item])[0]["tool_calls"][0]["function"]["name"] == "mcp__computer_use__get_app_state"
    twice = [*tools, {"type": "namespace", "name": "other", "tools": [app]}]
    obj2 = {**obj, "tools": twice}
    with pytest.raises(APIError, match="ambiguous"):
        chat_body(parse_model(ResponsesRequest, obj2), obj2, messages)
    bad = {**obj, "tools": [{"type": "namespace", "name": "x"}]}
    with pytest.raises(APIError, match="namespace tool needs"):
        chat_body(parse_model(ResponsesRequest, bad), bad, messages)


def test_model_names_as_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read in vLLM 0.32's serving base while porting test_errors.py (not vendored: it drives vLLM's serving class
    # through mocks): an unknown model is its 404 naming the served aliases, an empty name is the served model,
    # and VLLM_SKIP_MODEL_NAME_VALIDATION (1 or true) takes any name, answered as the served model.
    state = ServerState.__new__(ServerState)
    state.model_names = [MODEL, "smol"]
    state.models = SimpleNamespace(is_served=lambda name: name in state.model_names)
    monkeypatch.delenv("VLLM_SKIP_MODEL_NAME_VALIDATION", raising=False)
    assert (state.model_name("smol"), state.model_name(""), state.model_name(None)) == ("smol", MODEL, MODEL)
    with pytest.raises(APIError) as err:
        state.model_name("gpt-4o")
    assert (err.value.status, err.value.param) == (404, "model")
    assert err.value.message == f"The model `gpt-4o` does not exist. Valid aliases: {MODEL}, smol."
    for value, skips in (("1", True), ("true", True), ("TRUE", True), ("yes", False), ("0", False)):
        monkeypatch.setenv("VLLM_SKIP_MODEL_NAME_VALIDATION", value)
        if skips:
            assert state.model_name("gpt-4o") == MODEL
        else:
            pytest.raises(APIError, state.model_name, "gpt-4o")


def test_output_room_as_vllm() -> None:
    # vLLM 0.32's Responses serving: a prompt that fills the context is its 400 (_validate_generator_input); a
    # max_output_tokens past the context is its renderer's 400; any other is held to the room the prompt leaves
    # (get_max_tokens). tokenloom answered a limit past the room with a 400 naming max_tokens.
    obj = {"input": "Hi", "max_output_tokens": 500}
    req = parse_model(ResponsesRequest, obj)
    chat = parse_model(ChatCompletionRequest, chat_body(req, obj, build_messages(req, None)))
    assert responses_sampling_params(req, chat, 900, 1024, 50000, 20).max_tokens == 124
    assert responses_sampling_params(req, chat, 10, 1024, 50000, 20).max_tokens == 500
    with pytest.raises(APIError, match=r"^The engine prompt length 1024 exceeds the max_model_len 1024\. Please"):
        responses_sampling_params(req, chat, 1024, 1024, 50000, 20)
    with pytest.raises(APIError, match=r"^max_output_tokens=500 cannot be greater than max_model_len=400\."):
        responses_sampling_params(req, chat, 10, 400, 50000, 20)


def test_background_runs_end_and_replay() -> None:
    # A run cancelled before its task started still ends (its engine request is aborted there: a coroutine
    # cancelled then never runs its own `finally`), and an event log replays after a sequence number, then
    # follows new frames until it closes (vLLM's responses_background_stream_generator).
    async def scenario() -> tuple[list[str], list[str], list[str]]:
        ended: list[str] = []
        runs = BackgroundRuns()
        runs.start("r1", asyncio.sleep(60), lambda: ended.append("r1"))
        assert "r1" in runs
        await runs.cancel("r1")
        log = EventLog()
        for frame in ("a", "b"):
            log.append(frame)
        replayed: list[str] = []

        async def follow() -> None:
            replayed.extend([frame async for frame in log.replay(starting_after=0)])

        reader = asyncio.ensure_future(follow())
        await asyncio.sleep(0)
        log.append("c")
        log.close()
        await reader
        return ended, replayed, [frame async for frame in log.replay()]

    ended, replayed, whole = asyncio.run(scenario())
    assert ended == ["r1"] and replayed == ["b", "c"] and whole == ["a", "b", "c"]


def test_custom_tool_input_resent_whole_when_the_end_disagrees() -> None:
    # vLLM's emit_simple_tool_call_done: the custom call's input streams as the part of `{"input": "..."}` that
    # is sure; when the finished arguments do not decode to an extension of what was sent (here the call was
    # cut inside the string: the input is then the arguments as written), the whole input is sent again.
    items = ItemStream(ToolNames.of([{"type": "custom", "name": "sh"}]))
    events = items.call("c1", "sh", 0) + items.arguments('{"input": "ls -') + items.close()
    assert [e["type"] for e in events] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                                           "response.custom_tool_call_input.delta",
                                           "response.custom_tool_call_input.done", "response.output_item.done"]
    assert [e["delta"] for e in events[1:3]] == ["ls -", '{"input": "ls -']
    assert events[3]["input"] == events[4]["item"]["input"] == '{"input": "ls -' and items.done == [events[4]["item"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No prefix caching: a whole and a streamed reply are compared token for token (a prefix-cache hit
    # computes the prompt's tail in another batch shape; see tests/test_tool_calls_server.py).
    # --return-tokens-as-token-ids: vLLM's Responses logprobs then name tokens "token_id:N" (no test here reads
    # another server's token strings).
    with ServerProcess("--host", "127.0.0.1", "--max-model-len", "1024", "--no-enable-prefix-caching",
                       "--return-tokens-as-token-ids", log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
class TestServer:
    def test_text_whole_and_streamed(self, client) -> None:
        kwargs = dict(model=MODEL, input="Say hello.", instructions="Answer in English.", max_output_tokens=8,
                      temperature=0.0)
        whole = client.responses.create(**kwargs)
        assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
        [item] = whole.output
        assert item.type == "message" and item.role == "assistant" and whole.output_text
        assert whole.status in ("completed", "incomplete") and whole.instructions == "Answer in English."
        assert whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 5
        assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
        if whole.status == "incomplete":
            assert whole.usage.output_tokens == 8 and whole.incomplete_details.reason == "max_output_tokens"
        # The client's stream helper accumulates the events (it raises on an event out of order or an
        # item whose id changes between added, done and the final response).
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
        types = [e.type for e in events]
        deltas = types.count("response.output_text.delta")
        assert types == TEXT_EVENTS + ["response.output_text.delta"] * (deltas - 1) + TEXT_END
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        assert final.output_text == whole.output_text and final.status == whole.status
        assert final.output[0].id == events[2].item.id and final.usage.output_tokens == whole.usage.output_tokens
        # stream=True gives the same events, parsed by the client's plain stream.
        raw = list(client.responses.create(**kwargs, stream=True))
        assert [e.type for e in raw] == types and raw[-1].response.output_text == whole.output_text

    def test_json_schema_format(self, client) -> None:
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["city", "rank"], "additionalProperties": False}
        r = client.responses.create(model=MODEL, input="The capital of France, as JSON.", max_output_tokens=40,
                                    temperature=0.0, text={"format": {"type": "json_schema", "name": "city",
                                                                      "schema": schema, "strict": True}})
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), schema)

    @pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                             ids=["required", "named"])
    def test_function_tool_whole_streamed_and_answered(self, client, choice) -> None:
        kwargs = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=60,
                      temperature=0.0)
        r = client.responses.create(**kwargs)
        # "required" lets the model call once or more (vLLM's schema: an array, minItems 1): SmolLM2 calls
        # once on a VNNI build and twice (celsius, then fahrenheit) on an AVX2 one. A named tool: one call.
        calls = r.output
        assert calls and (choice == "required" or len(calls) == 1)
        for call in calls:
            assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
            assert call.call_id and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
        types = [e.type for e in events]
        assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
        assert len(final.output) == len(calls)
        for i, (s_call, call) in enumerate(zip(final.output, calls)):
            pieces = "".join(e.delta for e in events
                             if e.type == "response.function_call_arguments.delta" and e.output_index == i)
            assert s_call.type == "function_call" and s_call.arguments == pieces
            assert json.loads(pieces) == json.loads(call.arguments)
        # The calls answered: the conversation goes on from the stored response.
        answer = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "18 degrees, sunny"} for call in calls],
                                         max_output_tokens=16, temperature=0.0)
        assert answer.output[0].type == "message" and answer.output_text
        assert answer.previous_response_id == r.id and answer.usage.input_tokens > r.usage.input_tokens

    def test_custom_tool_streamed(self, client) -> None:
        # vLLM 0.32's custom tools (free text in): shown to the model as a function of one string, `input`, and
        # answered as a custom_tool_call item carrying that string; streamed as custom_tool_call_input events
        # (the whole response's items and the answer's replay: the vendored test_vllm_responses_utils.py);
        # the stored conversation carries the call as the function the model wrote. tokenloom refused custom
        # tools (400 naming tools.0) until 2026-12-07.
        shell = {"type": "custom", "name": "shell", "description": "Run a shell command.", "format": {"type": "text"}}
        with client.responses.stream(model=MODEL, input="Run the command `ls`.", tools=[shell], max_output_tokens=24,
                                     tool_choice={"type": "custom", "name": "shell"}, temperature=0.0) as stream:
            events = list(stream)
            r = stream.get_final_response()
        [call] = r.output
        assert (call.type, call.name) == ("custom_tool_call", "shell") and call.id.startswith("ctc_") and call.input
        assert r.tool_choice.type == "custom" and r.tools[0].type == "custom"
        types = [e.type for e in events]
        assert types[2] == "response.output_item.added" and events[2].item.type == "custom_tool_call"
        assert types[-3:] == ["response.custom_tool_call_input.done", "response.output_item.done",
                              "response.completed"]
        pieces = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
        assert pieces == events[-3].input == call.input
        # The answer's replay (custom_tool_call_output after the call) is the vendored
        # test_custom_tool_history_replays_through_function_shim's.
        stored = output_messages([call.model_dump(exclude_none=True)])
        arguments = json.dumps({"input": call.input}, ensure_ascii=False)
        assert stored[0]["tool_calls"][0]["function"] == {"name": "shell", "arguments": arguments}

    def test_vllm_request_fields_read_and_echoed(self, client, server) -> None:
        # vLLM 0.32 takes top_logprobs without the logprobs include (it asks for nothing then) and every
        # service_tier of its Literal, holds a max_output_tokens within the context to the room the prompt
        # leaves (get_max_tokens), and echoes the sampling parameters as used (from_request). tokenloom answered
        # these three with 400s until 2026-12-07, and echoed no penalties.
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, top_logprobs=3, service_tier="flex",
                                    temperature=0.0, extra_body={"presence_penalty": 0.5})
        assert r.top_logprobs is None and r.service_tier == "flex" and not r.output[0].content[0].logprobs
        # the server's --return-tokens-as-token-ids (vLLM's _create_response_logprobs reads it)
        scored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, top_logprobs=1,
                                         temperature=0.0, include=["message.output_text.logprobs"])
        lps = scored.output[0].content[0].logprobs
        assert lps and all(lp.token.startswith("token_id:") for lp in lps)
        assert all(top.token.startswith("token_id:") for lp in lps for top in lp.top_logprobs)
        assert (r.presence_penalty, r.frequency_penalty) == (0.5, 0.0)
        body = {"input": "Hi", "max_output_tokens": 1024, "stream": True}
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as events:
            created = next(json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: "))
        assert created["type"] == "response.created" and 900 < created["response"]["max_output_tokens"] < 1024

    def test_reasoning_accepted_and_echoed(self, client) -> None:
        # vLLM without a reasoning parser takes `reasoning` and reasoning items (they reach the chat template
        # only; SmolLM2's ignores them) and echoes `reasoning`; no reasoning items come out.
        r = client.responses.create(model=MODEL, reasoning={"effort": "low"}, max_output_tokens=2, temperature=0.0,
                                    input=[{"role": "user", "content": "Hello."},
                                           {"type": "reasoning", "summary": [],
                                            "content": [{"type": "reasoning_text", "text": "Greet back."}]}])
        assert r.reasoning.effort == "low" and [o.type for o in r.output] == ["message"]
        assert r.usage.output_tokens_details.reasoning_tokens == 0

    @pytest.mark.parametrize("stream", [False, True])
    def test_enable_response_messages(self, client, stream) -> None:
        # vLLM's SimpleContext (no Harmony): the rendered prompt and the output as raw messages with their
        # token ids (vLLM's test_simple.py asks for them; tokenloom refused the field).
        kwargs = dict(model=MODEL, input="Hello?", max_output_tokens=3, temperature=0.0,
                      extra_body={"enable_response_messages": True})
        if stream:
            r = list(client.responses.create(**kwargs, stream=True))[-1].response
        else:
            r = client.responses.create(**kwargs)
        [prompt] = r.input_messages
        assert prompt["type"] == "raw_message_tokens" and prompt["message"].count("Hello?") == 1
        assert len(prompt["tokens"]) == r.usage.input_tokens and all(type(t) is int for t in prompt["tokens"])
        [output] = r.output_messages
        assert output == {"message": r.output_text, "tokens": output["tokens"], "type": "raw_message_tokens"}
        assert len(output["tokens"]) == r.usage.output_tokens
        plain = client.responses.create(model=MODEL, input="Hello?", max_output_tokens=1)
        assert plain.input_messages is None and plain.output_messages is None

    def test_namespace_tool_call_whole_and_streamed(self, client) -> None:
        tools = [{"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [WEATHER]}]
        kwargs = dict(model=MODEL, input=ASK, tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                      max_output_tokens=60, temperature=0.0)
        [call] = client.responses.create(**kwargs).output
        assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", "weather")
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
        added = next(e.item for e in events if e.type == "response.output_item.added")
        assert (added.name, added.namespace) == ("get_weather", "weather")
        assert (final.output[0].name, final.output[0].namespace) == ("get_weather", "weather")

    def test_partial_assistant_message_is_continued(self, client) -> None:
        ask = {"role": "user", "content": "What is the capital of France?"}
        partial = {"type": "message", "role": "assistant", "status": "incomplete",
                   "content": [{"type": "output_text", "text": "The capital of France is"}]}
        kwargs = dict(model=MODEL, max_output_tokens=3, temperature=0.0)
        go_on = client.responses.create(input=[ask, partial], **kwargs)
        new_turn = client.responses.create(input=[ask, {**partial, "status": "completed"}], **kwargs)
        # The open turn has no end-of-turn and no new assistant header: fewer prompt tokens.
        assert go_on.usage.input_tokens < new_turn.usage.input_tokens and go_on.output_text

    def test_previous_response_id_get_and_cancel(self, client, server) -> None:
        first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0.0)
        follow = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                         max_output_tokens=6, temperature=0.0)
        # The follow-up's prompt holds the first turn, its answer and the new question.
        alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=1, store=False)
        assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
        got = client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(alone.id)  # store: false
        assert err.value.body["param"] == "response_id" and alone.id in err.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown", max_output_tokens=1)
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
            client.responses.cancel(first.id)
        assert httpx.post(f"{server.url}/v1/responses/resp_unknown/cancel", timeout=30).status_code == 404

    def test_background_polled_replayed_and_cancelled(self, client) -> None:
        # vLLM 0.32's background mode (its test_stateful.py's test_background and test_background_cancel, which
        # failed here: tokenloom refused `background`): stored queued and answered at once, generated without
        # the client; a streamed one's events replay from GET ?stream=true&starting_after=N; cancel stops a
        # queued one for good, and answers a finished one vLLM's 400.
        kwargs = dict(model=MODEL, input="Say hello.", max_output_tokens=4, temperature=0.0)
        queued = client.responses.create(background=True, **kwargs)
        assert (queued.status, queued.background, queued.output) == ("queued", True, [])
        for _ in range(300):
            done = client.responses.retrieve(queued.id)
            if done.status != "queued":
                break
            time.sleep(0.1)
        assert done.status in ("completed", "incomplete") and done.output_text
        assert done.output_text == client.responses.create(**kwargs).output_text
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
            client.responses.cancel(queued.id)
        streamed = list(client.responses.create(background=True, stream=True, **kwargs))
        assert streamed[0].type == "response.created" and streamed[-1].type == "response.completed"
        again = list(client.responses.retrieve(streamed[0].response.id, stream=True, starting_after=1))
        assert [e.sequence_number for e in again] == [e.sequence_number for e in streamed[2:]]
        with pytest.raises(openai.BadRequestError, match="Unknown response_id"):
            list(client.responses.retrieve(queued.id, stream=True))  # not streamed when created
        long = client.responses.create(background=True, model=MODEL, input="Write a long story.",
                                       max_output_tokens=900, extra_body={"ignore_eos": True})
        assert client.responses.cancel(long.id).status == "cancelled"
        time.sleep(0.5)
        assert client.responses.retrieve(long.id).status == "cancelled"  # its engine request: the leak check's

    @pytest.mark.parametrize("body, param, words", [
        # vLLM's check (vLLM 0.32's test_stateful.py matches the message)
        ({"background": True, "store": False}, "background", "background can only be used when `store` is true"),
        ({"reasoning": {"effort": "maximal"}}, "reasoning", "reasoning.effort"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
        ({"tools": [WEATHER]}, None, '"auto" tool choice requires --enable-auto-tool-choice'),
        ({"include": ["file_search_call.results"]}, "include", "not supported"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format",
         "text.format.name is required"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs", "top_logprobs must be"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input",
         "Encrypted content is not supported."),
        ({"input": [{"type": "reasoning"}]}, "input", "summary must be a list"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "Unsupported input item type: item_reference"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
         "only text parts"),
        ({"max_output_tokens": "many"}, "max_output_tokens", "max_output_tokens"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"service_tier": "premium"}, "service_tier", "service_tier"),
        # vLLM 0.32's words (its renderer's TokenizeParams); a limit within the context is held to the room left
        ({"max_output_tokens": 1025}, "max_output_tokens",
         "max_output_tokens=1025 cannot be greater than max_model_len=1024. Please request fewer output tokens."),
        ({"tools": [{"type": "custom", "name": "sh", "format": {"type": "grammar", "syntax": "lark",
                                                                 "definition": "start: \"ls\""}}]}, "tools",
         "Custom tools with a grammar format are not supported; only free-form text custom tools are accepted."),
        ({"model": "nope"}, "model", "does not exist"),
    ])
    def test_errors_in_the_apis_shape(self, server, body, param, words) -> None:
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={"input": "Hi", "max_output_tokens": 2, **body})
        error = r.json()["error"]
        assert r.status_code == (404 if param == "model" else 400), r.text
        assert error["param"] == param and words in error["message"] and error["code"] == r.status_code

    def test_fuzzed_fields_never_500(self, server) -> None:
        values = [None, True, False, -1, 0, 3, 2**70, 1.5, "", "x", [], [1], ["a"], {}, {"a": 1}, {"type": "text"},
                  {"format": {"type": "json_schema"}}, {"type": "function"}, [{"type": "function"}],
                  [{"type": "function_call"}], [{"role": "user"}], [{"type": "function_call_output", "call_id": 1}],
                  [{"role": "user", "content": [{"type": "input_text"}]}]]
        fields = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
                  "tool_choice", "store", "stream", "previous_response_id", "include", "top_logprobs", "truncation",
                  "metadata", "parallel_tool_calls", "service_tier", "stop", "structured_outputs", "background"]
        rng = random.Random(35)
        statuses: dict[int, int] = {}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for field in fields:
                for value in rng.sample(values, 6):
                    body = {"input": "Hi", "max_output_tokens": 2, field: value}
                    with http.stream("POST", "/v1/responses", json=body) as r:
                        r.read()
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    assert r.status_code in (200, 400, 404), (body, r.status_code, r.text[:300])
                    assert b"server_error" not in r.content and b'"code":500' not in r.content, (body, r.text[:300])
                    if r.status_code != 200:
                        error = r.json()["error"]
                        assert error["code"] == r.status_code and error["message"], r.text
        assert statuses.get(200) and statuses.get(400)
