"""Structured outputs and tool calls through the server with the official openai client (default model):
response_format json_schema and beta.chat.completions.parse, tool calls named / required / auto
(whole and streamed), completions with structured_outputs, 400s with the reason, and a slow grammar
compile that does not stall a request already streaming."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.test_server_harness import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--host", "127.0.0.1", "--max-model-len", "1024",
                       log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_slow_compile_does_not_stall_a_streaming_request(server, client) -> None:
    # The first constrained request also builds the vocabulary table (~2 s) and this schema takes ~1 s
    # more to compile: all of it in the grammar threads while the other request keeps streaming.
    fields = {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]{{2}}x{i}$"} for i in range(200)}
    slow = {"type": "object", "properties": fields, "required": list(fields)}
    stamps: list[float] = []
    submitted: list[float] = []
    done: list[float] = []

    def constrained() -> None:
        time.sleep(1.0)  # the stream is under way
        submitted.append(time.monotonic())
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, max_completion_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": slow}})
        done.append(time.monotonic())

    worker = threading.Thread(target=constrained)
    worker.start()
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Tell me a long story."}],
        max_completion_tokens=400, temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.monotonic())
        if done and stamps[-1] > done[0]:
            break
    stream.close()
    worker.join(120)
    assert submitted and done, "the constrained request did not finish"
    during = [t for t in stamps if submitted[0] <= t <= done[0]]
    window = done[0] - submitted[0]
    assert window > 1.0, window  # it did wait for its grammar
    # Tokens kept coming while the grammar compiled: no gap anywhere near the compile time.
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if submitted[0] <= b <= done[0]]
    assert len(during) >= 5 and max(gaps) < window / 2, (len(during), max(gaps), window)


def test_response_format_json_schema_and_parse(client) -> None:
    class Person(BaseModel):
        name: str
        age: int

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_completion_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    parsed = client.beta.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Describe a person."}],
        max_completion_tokens=60, temperature=0.0, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"


def test_completions_structured_outputs_choice_and_guided_regex(client) -> None:
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Is water wet? Answer:", max_tokens=5,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Year:", max_tokens=8, temperature=1.0,
                                    extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    assert len(out.choices[0].text) == 4 and out.choices[0].text[:2] in ("19", "20")


def test_named_tool_call_round_trips(client) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], max_completion_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.0)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The call goes back into the conversation, with its result, and the model answers in text.
    follow = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_completion_tokens=20, temperature=0.0, tools=[WEATHER],
        messages=ASK + [reply.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
    assert follow.choices[0].message.content is not None


def test_required_tool_calls_whole_and_streamed(client) -> None:
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, max_completion_tokens=80, temperature=0.0)
    reply = client.chat.completions.create(**kwargs)
    calls = reply.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls", reply
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert [d.index for d in deltas] == list(range(len(calls)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_parses_hermes_calls(client) -> None:
    # The model decides; whatever it says, a <tool_call> block becomes a tool call and the rest content.
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER], tool_choice="auto",
        max_completion_tokens=40, temperature=0.0)
    msg = reply.choices[0].message
    assert msg.tool_calls or msg.content
    assert "<tool_call>" not in (msg.content or "") or not msg.tool_calls


def test_hermes_parser_and_streaming_parser() -> None:
    from tokenloom.server.structured import tool_setup
    from tokenloom.server.tool_parser import StreamingToolParser, parse_hermes

    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    parser = StreamingToolParser(tool_setup([WEATHER], "auto"))
    pieces = [parser.feed(text[i:i + 3], i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert "".join(c for c, _ in pieces) == "Let me check.\n"
    [call] = [c for _, cs in pieces for c in cs]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert parse_hermes("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("body, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "multipleOf": 2}}}}, "unsupported JSON schema feature"),
    ({"structured_outputs": {"regex": "(ab"}}, "regex does not compile"),
    ({"guided_grammar": "root ::= ("}, "EBNF"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "only one kind"),
])
def test_bad_input_is_a_400_with_the_reason(server, body, reason: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]


def test_max_tokens_cuts_a_grammar_with_length_and_partial_text(client) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_completion_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "array", "items": {"type": "integer"}, "minItems": 30}}})
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("[")
