"""Tool calls through a server started for a pythonic-format model (`--enable-auto-tool-choice
--tool-call-parser pythonic`, vLLM's flags) with the official openai client and the default model.

SmolLM2's template does not render tools, so the server shows them in Llama 3.2's pythonic tool prompt
(`[func(a=1), ...]`). The 135M model seldom answers in that format on its own, so each path is also
driven deterministically: "required" and a named function are forced with vLLM's JSON forms (the
parser has no structural tag) and read back by their rules; "auto" is read by the pythonic parser,
with a regex of the request's own making the model write a call. Whole and streamed must agree.
Plus: `--tool-call-parser llama3_json` and `mistral` refused at start-up on this tokenizer (SmolLM2's has neither
`<|python_tag|>` nor `[TOOL_CALLS]`), vLLM's words.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.test_server_harness import ServerProcess
from tests.test_tool_calls_server import streamed

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--host", "127.0.0.1", "--max-model-len", "1024", "--enable-auto-tool-choice",
                       "--tool-call-parser", "pythonic",
                       log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_prompt_asks_for_pythonic_calls(server) -> None:
    import httpx

    from tokenloom.model.tokenizer import load_tokenizer

    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_completion_tokens": 1,
            "return_token_ids": True}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    text = load_tokenizer(None).decode(reply["prompt_token_ids"], skip_special_tokens=False)
    assert "[func_name1(params_name1=params_value1" in text and '"name": "get_weather"' in text
    assert "<tool_call>" not in text


@pytest.mark.parametrize("parallel", [False, None])
def test_required_is_a_json_array_whole_and_streamed(client, parallel) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  max_completion_tokens=120, temperature=0.0)
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    reply = client.chat.completions.create(**kwargs)
    msg = reply.choices[0].message
    assert msg.tool_calls and reply.choices[0].finish_reason == "tool_calls" and msg.content == "", reply
    if parallel is False:
        assert len(msg.tool_calls) == 1
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    content, calls, finish, _ = streamed(client, **kwargs)
    # vLLM streams the model's text of each "parameters" value; the whole response json.dumps it.
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [(c["name"], json.dumps(json.loads(c["arguments"]), ensure_ascii=False)) for c in calls]
    assert finish == "tool_calls" and content == ""


def test_named_is_the_functions_arguments_whole_and_streamed(client) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  max_completion_tokens=60, temperature=0.0)
    reply = client.chat.completions.create(**kwargs)
    [call] = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "stop"
    content, calls, finish, _ = streamed(client, **kwargs)
    # Named calls are the model's text in both (vLLM re-serialises neither): equal as text.
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert finish == "stop" and content == "" and calls[0]["pieces"] > 3


def test_auto_call_is_read_by_the_pythonic_parser(client) -> None:
    # A regex of the request's own makes the model write a pythonic call (auto adds no constraint for
    # this parser): the parser reads it, whole and streamed.
    regex = r"\[get_weather\(city='[A-Z][a-z]{1,8}', unit='celsius'\), get_time\(tz='[A-Z]{3}'\)\]"
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_completion_tokens=60, temperature=0.0,
                  extra_body={"structured_outputs": {"regex": regex}})
    reply = client.chat.completions.create(**kwargs)
    msg = reply.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"], reply
    assert msg.content is None and reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments)["unit"] == "celsius"
    content, calls, finish, _ = streamed(client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in msg.tool_calls]
    assert content == "" and finish == "tool_calls"


def test_auto_whole_and_streamed_agree(client) -> None:
    # Unconstrained: whatever the model writes, the stream and the whole response say the same.
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_completion_tokens=40, temperature=0.0)
    reply = client.chat.completions.create(**kwargs)
    msg = reply.choices[0].message
    content, calls, finish, _ = streamed(client, **kwargs)
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == \
        [(c["name"], c["arguments"]) for c in calls]
    if not msg.tool_calls:
        assert msg.content == content
    assert finish == reply.choices[0].finish_reason


REFUSALS = [
    ("llama3_json", "Llama3JsonToolParser could not locate the bot token '<|python_tag|>' in the tokenizer."),
    ("mistral", "Mistral parser could not locate the tool call token in the tokenizer!"),
]


@pytest.mark.parametrize("name, reason", REFUSALS)
def test_a_parser_needing_a_token_the_vocabulary_lacks_is_refused(name, reason) -> None:
    """vLLM's start-up check, its words, for each parser that needs a token (the check the server runs)."""
    from tokenloom.model.tokenizer import load_tokenizer
    from tokenloom.server.tool_parsers import ToolParserTokenizerError, check_tokenizer

    with pytest.raises(ToolParserTokenizerError) as err:
        check_tokenizer(name, load_tokenizer(None), "SmolLM2-135M-Instruct")
    assert f"--tool-call-parser {name} cannot be used with the tokenizer of 'SmolLM2-135M-Instruct': " \
           f"{reason}" == str(err.value)


def test_the_server_stops_at_start_up_on_such_a_parser(tmp_path) -> None:
    """End to end, once: `tokenloom serve` exits 1 with that message before serving anything."""
    name, reason = REFUSALS[1]
    server = ServerProcess("--host", "127.0.0.1", "--max-model-len", "256", "--enable-auto-tool-choice",
                           "--tool-call-parser", name, log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="server exited with 1") as err:
        server.start()
    server.stop()
    assert f"--tool-call-parser {name} cannot be used with the tokenizer of 'SmolLM2-135M-Instruct': " \
           f"{reason}" in str(err.value), str(err.value)
