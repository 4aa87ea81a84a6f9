"""Structured outputs and tool calls through the server with the official openai client (default model):
response_format json_schema and beta.chat.completions.parse, completions with structured_outputs, 400s
with the reason ("auto" tool_choice without --enable-auto-tool-choice among them), a slow grammar compile
that does not stall a request already streaming, and named / required tool_choice without a tool parser.
Tool calls with a parser: tests/test_tool_calls_server.py."""

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
from tests.test_tool_calls_server import streamed

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
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
    # The first constraint after start-up also imports xgrammar and builds the vocabulary table in the
    # engine (~0.5 s that holds the GIL, docs/structured_outputs.md): a warm-up takes it out of the window.
    client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_completion_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "warm", "schema": {"type": "object"}}})
    fields = {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]{{2}}x{i}$"} for i in range(600)}
    slow = {"type": "object", "properties": fields, "required": list(fields)}
    # What this compile costs here with nothing else running: compiled on the step loop, it would stop
    # the stream at least this long.
    compile_s = _compile_seconds(slow)
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
    assert done[0] - submitted[0] > compile_s / 2  # it did wait for its grammar
    # Tokens kept coming while the grammar compiled. On 2 cores the compile threads do slow the
    # decode steps (their OpenMP team shares the cores), but no gap comes near the compile itself.
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if submitted[0] <= b <= done[0]]
    assert len(during) >= 5 and max(gaps) < 0.5 * compile_s, (len(during), max(gaps), compile_s)


def _compile_seconds(schema: dict) -> float:
    from tokenloom.model.grammar import XgrammarBackend
    from tokenloom.model.tokenizer import load_tokenizer

    backend = XgrammarBackend(load_tokenizer(None).hf, 49152)
    start = time.perf_counter()
    backend.compile("json", "any|" + json.dumps(schema))
    return time.perf_counter() - start


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


@pytest.mark.parametrize("body, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "multipleOf": 2}}}}, "unsupported JSON schema feature"),
    ({"structured_outputs": {"regex": "(ab"}}, "Failed to transform regex into a grammar"),
    ({"guided_grammar": "root ::= ("}, "EBNF"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),  # vLLM's words
    # This server runs without --enable-auto-tool-choice: vLLM's 400 for "auto", word for word (required and
    # named need no parser: the end of this file).
    ({"tools": [WEATHER]}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "only one kind"),
])
def test_bad_input_is_a_400_with_the_reason(server, body, reason: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]


# Matches "a" and then nothing: `b` never ends, so after the first token the grammar allows none. It passes
# validation (its first token exists); the dead end is met while generating.
DEAD_END = 'root ::= "a" b\nb ::= b "x"'


def test_a_grammar_that_dead_ends_while_generating_is_a_400_not_a_500(server) -> None:
    body = {"messages": ASK, "max_tokens": 8, "guided_grammar": DEAD_END}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("the structured-output grammar allows no token here: after 1 ")
    # Streamed: the headers are sent, so the error is the stream's last event, with the same status.
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Say a", "max_tokens": 8, "guided_grammar": DEAD_END, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 400, events
    # The engine goes on: a plain request right after.
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_max_tokens_cuts_a_grammar_with_length_and_partial_text(client) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_completion_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "array", "items": {"type": "integer"}, "minItems": 30}}})
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("[")


# Named and "required" tool_choice without --enable-auto-tool-choice / --tool-call-parser (this server has
# neither), as vLLM serves them: the grammar forces the named function's arguments (named) or vLLM's list
# `[{"name": ..., "parameters": ...}]` (required), and the reply carries `tool_calls` built from that JSON,
# whole and streamed. Every forced call's arguments validate against the tool's `parameters`, over schemas
# of every JSON type, nested objects, enums, arrays and `required`; none of them is "strict" (issue 35).
FORCED_ASK = [{"role": "user", "content": "Book a table for two at a restaurant in Paris tonight."}]
# Not "strict": the forced call must follow the schema anyway (issue 35).
BOOK = {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "guests": {"type": "integer", "minimum": 1, "maximum": 9},
                "budget": {"type": "number", "minimum": 0, "maximum": 500},
                "outdoor": {"type": "boolean"},
                "note": {"type": "null"},
                "cuisine": {"enum": ["french", "italian", "thai"]},
                "dishes": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
                "when": {"type": "object", "properties": {"day": {"type": "string", "enum": ["today", "tomorrow"]},
                                                          "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                         "required": ["day", "hour"], "additionalProperties": False},
            },
            "required": ["city", "guests", "budget", "outdoor", "note", "cuisine", "dishes", "when"],
            "additionalProperties": False}}}
CITY = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"]}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping", "description": "Is the service up?"}}
SCHEMAS = {"book_table": BOOK["function"]["parameters"], "get_weather": CITY["function"]["parameters"],
           "ping": {"type": "object", "properties": {}, "additionalProperties": False}}


def _valid(call) -> None:
    name = call.function.name if hasattr(call, "function") else call["name"]
    arguments = call.function.arguments if hasattr(call, "function") else call["arguments"]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool", [BOOK, CITY, NO_PARAMS], ids=lambda t: t["function"]["name"])
def test_named_tool_choice_without_a_parser(client, tool) -> None:
    name = tool["function"]["name"]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=FORCED_ASK, tools=[BOOK, CITY, NO_PARAMS],
                  max_completion_tokens=200, tool_choice={"type": "function", "function": {"name": name}},
                  temperature=0.0)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == name and call.id
    assert choice.finish_reason == "stop" and not choice.message.content  # a named call keeps "stop"
    _valid(call)
    content, calls, finish, _ = streamed(client, **kwargs)
    assert content == "" and finish == "stop" and len(calls) == 1 and calls[0]["name"] == name
    _valid(calls[0])


def test_required_tool_choice_without_a_parser(client) -> None:
    # parallel_tool_calls false: exactly one call (the default, several allowed, runs in
    # tests/test_responses_api.py through the same chat path).
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=FORCED_ASK, tools=[BOOK, CITY], tool_choice="required",
                  max_completion_tokens=300, temperature=0.0, parallel_tool_calls=False)
    reply = client.chat.completions.create(**kwargs)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls", reply
    assert len(calls) == 1
    for call in calls:
        _valid(call)
    content, s_calls, finish, _ = streamed(client, **kwargs)
    assert finish == "tool_calls" and not content and s_calls
    for call in s_calls:
        _valid(call)
