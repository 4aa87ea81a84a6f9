"""Tool calls through a server started as vLLM's users start it for a Hermes-format model
(`--enable-auto-tool-choice --tool-call-parser hermes`), with the official openai client and the default
model: named, required and auto, each whole and streamed. A streamed call arrives as vLLM sends it:
index, id, type and name first, then the arguments in pieces; the pieces concatenate to the model's
text of the arguments, which the whole response gives re-serialised (json.dumps), as vLLM does."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.test_server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone", "strict": True,
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No prefix caching: the whole and the streamed reply of one request are compared token for token,
    # and a prefix-cache hit computes the prompt's tail in another batch shape, whose quantized kernels
    # may round a near-tie the other way (docs/speculative.md, "Greedy outputs and the quantized default").
    with ServerProcess("--host", "127.0.0.1", "--max-model-len", "1024", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--no-enable-prefix-caching",
                       log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed(client, **kwargs):
    """(content, calls as {"id", "name", "arguments", "pieces"}, finish_reason, chunks) of a stream."""
    content, calls, finish, chunks = "", {}, None, []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                # The first delta of a call announces it: id, type and name, before any argument.
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": "", "pieces": 0}
            else:
                assert tc.id is None and tc.function.name is None, tc
            if tc.function.arguments:
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["pieces"] += 1
    return content, [calls[i] for i in sorted(calls)], finish, chunks


def same_calls(whole, streamed_calls) -> None:
    """The streamed pieces are the model's own text of the arguments; the whole response has vLLM's
    json.dumps of them. So: equal once the stream's text is parsed and dumped, exactly."""
    assert [(c.function.name, c.function.arguments) for c in whole] == \
        [(c["name"], json.dumps(json.loads(c["arguments"]), ensure_ascii=False)) for c in streamed_calls]


def test_named_call_streams_its_arguments_and_round_trips(client) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
                  max_completion_tokens=60, temperature=0.0)
    reply = client.chat.completions.create(**kwargs)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert reply.choices[0].finish_reason == "stop"  # a named call keeps "stop" (OpenAI, vLLM)
    content, calls, finish, _ = streamed(client, **kwargs)
    same_calls([call], calls)
    assert calls[0]["pieces"] > 3 and finish == "stop" and content == ""
    # The call goes back into the conversation, with its result, and the model answers in text.
    follow = client.chat.completions.create(
        model=MODEL, max_completion_tokens=20, temperature=0.0, tools=[WEATHER], tool_choice="none",
        messages=ASK + [reply.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_a_forced_call_of_a_non_strict_tool_follows_its_schema(client) -> None:
    # Issue 35: named get_weather(city: string), not strict, came back as {"city": {"type": "string",
    # "description": "Paris"}} when the forced call's arguments were any JSON value.
    plain = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]}}}
    for choice in (NAMED, "required"):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[plain], tool_choice=choice,
                                               max_completion_tokens=60, temperature=0.0)
        [call] = reply.choices[0].message.tool_calls[:1]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, plain["function"]["parameters"])
        assert isinstance(args["city"], str)


@pytest.mark.parametrize("parallel", [False, None])
def test_required_calls_whole_and_streamed(client, parallel) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  max_completion_tokens=120, temperature=0.0)
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    reply = client.chat.completions.create(**kwargs)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls", reply
    if parallel is False:
        assert len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    content, s_calls, finish, _ = streamed(client, **kwargs)
    same_calls(calls, s_calls)
    assert finish == "tool_calls" and all(c["pieces"] > 1 for c in s_calls)


def test_auto_whole_and_streamed_agree(client) -> None:
    # The model decides; with strict tools the call it makes is held to the schema. Whatever it does,
    # the stream and the whole response say the same.
    for tools in ([WEATHER], [{"type": "function", "function": {**WEATHER["function"], "strict": False}}]):
        kwargs = dict(model=MODEL, messages=ASK, tools=tools, max_completion_tokens=60, temperature=0.0)
        reply = client.chat.completions.create(**kwargs)
        msg = reply.choices[0].message
        content, calls, finish, _ = streamed(client, **kwargs)
        same_calls(msg.tool_calls or [], calls)
        assert (msg.content or "") == content.strip() if msg.tool_calls else (msg.content == content)
        assert finish == reply.choices[0].finish_reason
        assert "<tool_call>" not in (msg.content or "")


def test_unconstrained_auto_call_is_parsed(client) -> None:
    # Non-strict tools leave "auto" unconstrained: the Hermes parser reads whatever the model wrote. A
    # regex of the request's own makes the model write a call (it stays the only constraint), content first.
    loose = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    regex = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}", '
             r'"unit": "celsius"\}\}\n</tool_call>')
    kwargs = dict(model=MODEL, messages=ASK, tools=[loose], max_completion_tokens=60, temperature=0.0,
                  extra_body={"structured_outputs": {"regex": regex}})
    reply = client.chat.completions.create(**kwargs)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].message.content == "Checking.\n" and reply.choices[0].finish_reason == "tool_calls"
    content, calls, finish, _ = streamed(client, **kwargs)
    assert calls[0]["arguments"] == call.function.arguments  # written in json.dumps's spacing: exact
    assert content == "Checking.\n" and finish == "tool_calls" and calls[0]["pieces"] > 3


def test_fuzzed_tool_fields_are_200_or_a_clear_400(server) -> None:
    import random

    import httpx

    bad_schema = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "strin"}}}
    tools_values = [[], [{}], [WEATHER], "x", 5, None, [bad_schema], [WEATHER, TIME],
                    [{"type": "function", "function": {"name": "f", "parameters": "x"}}]]
    choice_values = ["auto", "required", "none", "bogus", {"type": "function"}, NAMED, 5, None,
                     {"type": "function", "function": {"name": "get_time"}}]
    rng = random.Random(7)
    statuses: dict[int, int] = {}
    for _ in range(30):
        body = {"messages": ASK, "max_completion_tokens": 4, "tools": rng.choice(tools_values),
                "tool_choice": rng.choice(choice_values), "parallel_tool_calls": rng.choice([True, False, "x"]),
                "stream": rng.choice([True, False])}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            r.read()
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
            if r.status_code == 400:
                err = r.json()["error"]
                assert err["type"] == "BadRequestError" and err["message"], err
            else:
                assert b'"code":500' not in r.content, (body, r.text[:300])
    assert statuses.get(200) and statuses.get(400), statuses


def test_a_speculating_server_makes_the_same_calls(client, tmp_path) -> None:
    # Issues 13 + 18 together: the forced call's grammar constrains every draft position, so n-gram
    # speculation changes nothing in the greedy output, and its acceptance shows in /metrics.
    import re

    import httpx

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    messages = [{"role": "user", "content": "Weather in Paris, in celsius. Call get_weather with "
                                            '{"city": "Paris", "unit": "celsius"}.'}]
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                  max_completion_tokens=120, temperature=0.0)
    want = client.chat.completions.create(**kwargs)
    with ServerProcess("--host", "127.0.0.1", "--max-model-len", "1024", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--speculative-config", json.dumps(ngram),
                       log_path=tmp_path / "server.log") as spec_server:
        spec = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = spec.chat.completions.create(**kwargs)
        assert [(c.function.name, c.function.arguments) for c in got.choices[0].message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls]
        assert got.choices[0].finish_reason == want.choices[0].finish_reason == "tool_calls"
        _, calls, finish, _ = streamed(spec, **kwargs)
        same_calls(want.choices[0].message.tool_calls, calls)
        metrics = httpx.get(spec_server.url + "/metrics", timeout=30).text
        accepted = re.search(r"^tokenloom:spec_decode_num_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
        assert accepted and float(accepted.group(1)) > 0, metrics[-2000:]
