"""Tool calls through a server started for a Qwen3-Coder-format model (`--enable-auto-tool-choice
--tool-call-parser qwen3_coder`, vLLM's flags) with the official openai client and the default model, with
n-gram speculative decoding and async scheduling on: the parser reads text, the structural tag that forces
its calls constrains every draft position, and neither may notice how the tokens were scheduled.

SmolLM2's template does not render tools, so the server shows them in Qwen3-Coder's XML tool prompt; the
135M model is driven deterministically: "required" and a named function are forced by xgrammar's builtin
"qwen_3_coder" tag, "auto" by a regex of the request's own. The whole response and the stream must give the
same calls, their XML values typed by the tools' schemas (an integer parameter is a JSON number).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.test_server_harness import ServerProcess
from tests.test_tool_calls_server import streamed

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = {"get_forecast": FORECAST, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--host", "127.0.0.1", "--max-model-len", "1024", "--enable-auto-tool-choice",
                       "--tool-call-parser", "qwen3_coder", "--speculative-config", json.dumps(NGRAM),
                       "--async-scheduling", "--no-enable-prefix-caching",
                       log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls) -> None:
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, TOOLS[call.function.name]["function"]["parameters"])


def test_forced_calls_whole_and_streamed(client) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[FORECAST, TIME], tool_choice="required",
                  max_completion_tokens=80, temperature=0.0)
    reply = client.chat.completions.create(**kwargs)
    msg = reply.choices[0].message
    assert msg.tool_calls and msg.content == "" and reply.choices[0].finish_reason == "tool_calls", reply
    check_calls(msg.tool_calls)
    # SmolLM2 adds a stray "</tool_call>" after the forced call: text after a call is content in neither.
    content, calls, finish, _ = streamed(client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in msg.tool_calls]
    assert finish == "tool_calls" and content == ""
    # A named function: one call of it, its integer parameter a JSON number; finish_reason stays "stop".
    named = client.chat.completions.create(**{**kwargs, "tool_choice": {"type": "function",
                                                                        "function": {"name": "get_forecast"}}})
    [call] = named.choices[0].message.tool_calls
    check_calls([call])
    assert call.function.name == "get_forecast" and isinstance(json.loads(call.function.arguments)["days"], int)
    assert named.choices[0].finish_reason == "stop"


def test_auto_call_is_read_by_the_parser_and_drafts_were_accepted(client, server) -> None:
    regex = (r"Checking\.\n<tool_call>\n<function=get_forecast>\n<parameter=city>\n[A-Z][a-z]{1,8}\n</parameter>\n"
             r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>")
    kwargs = dict(model=MODEL, messages=ASK, tools=[FORECAST, TIME], max_completion_tokens=80, temperature=0.0,
                  extra_body={"structured_outputs": {"regex": regex}})
    reply = client.chat.completions.create(**kwargs)
    msg = reply.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_forecast"], reply
    assert msg.content == "Checking." and reply.choices[0].finish_reason == "tool_calls"
    check_calls(msg.tool_calls)
    content, calls, finish, _ = streamed(client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in msg.tool_calls]
    assert content.strip() == "Checking." and finish == "tool_calls" and calls[0]["pieces"] > 1
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    accepted = re.search(r"^tokenloom:spec_decode_num_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0, metrics[-2000:]
