"""The llama3_json forced-call path on the real default model, below the server (the server refuses
llama3_json on SmolLM2's tokenizer, as vLLM does: it lacks <|python_tag|>; the parser reads text only, so
here it is built on a vocabulary that has the token).

The model is shown the tools in Llama 3.1's JSON tool prompt and decoded under xgrammar's builtin "llama"
structural tag (the one vLLM uses) for tool_choice required / named; what it writes must be read back
by the llama3_json parser as calls that fit the tools, and streamed token by token to the same calls.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.test_tool_calls_server import TIME, TOOLS, WEATHER
from tests.test_tool_parsers_llama_pythonic import LLAMA_VOCAB
from tokenloom import LLM, SamplingParams
from tokenloom.server.structured import structured_outputs_of
from tokenloom.server.tool_calls import StreamingToolParser, parse_output, tools_system_prompt
from tokenloom.server.tools import tool_setup

pytestmark = pytest.mark.slow

# The strict tools of the server's tool tests (one definition of them).


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_llama_calls_parse_and_stream_on_the_default_model(llm, choice) -> None:
    setup = tool_setup([WEATHER, TIME], choice, False, "llama3_json")
    setup.tokenizer = LLAMA_VOCAB
    so = structured_outputs_of({}, setup)
    assert so is not None and so.structural_tag is not None
    messages = [{"role": "system", "content": tools_system_prompt([WEATHER, TIME], "llama3_json")},
                {"role": "user", "content": "What is the weather in Paris?"}]
    [out] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so),
                     use_tqdm=False)
    comp = out.outputs[0]
    assert comp.finish_reason == "stop", comp.text
    content, calls = parse_output(comp.text, setup)
    assert content == "" and len(calls) == 1, comp.text
    name = calls[0]["function"]["name"]
    if isinstance(choice, dict):
        assert name == "get_time"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TOOLS[name]["function"]["parameters"])
    # Token by token, as the server streams it: the same call.
    tok = llm.get_tokenizer()
    parser, previous, got = StreamingToolParser(setup), "", {}
    for i in range(1, len(comp.token_ids) + 1):
        text = tok.decode(comp.token_ids[:i])
        delta = parser.feed(text[len(previous):], i == len(comp.token_ids))
        previous = text
        for tc in (delta or {}).get("tool_calls") or []:
            entry = got.setdefault(tc["index"], {"name": tc["function"].get("name"), "arguments": ""})
            entry["arguments"] += tc["function"].get("arguments") or ""
    assert [(c["name"], c["arguments"]) for c in got.values()] == [(name, calls[0]["function"]["arguments"])]
