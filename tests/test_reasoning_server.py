"""A reasoning model behind `tokenloom serve --reasoning-parser qwen3`, as vLLM serves Qwen3: the chat answer's
`<think>` part comes back as `reasoning`, streamed as `reasoning` deltas, tool calls are read from the content
after it, a structured output constrains only what follows it, and the Responses API gives a reasoning item.

One server for the module: tests/reasoning_models.py's tiny Qwen3 (Qwen3's reasoning tokens, a template with
`enable_thinking`), its answers scripted token by token (`vllm_xargs: {"script": [ids]}`, its ScriptedOutput
logits processor), with `--enable-auto-tool-choice --tool-call-parser hermes`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.test_server_harness import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tiny_reasoning_model):
    return tiny_reasoning_model


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with ServerProcess(str(model_dir), "--max-model-len", "1024", "--reasoning-parser", "qwen3",
                       "--logits-processors", "tests.reasoning_models:ScriptedOutput",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def encode(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def chat(server, encode, script: str, **body: Any) -> dict[str, Any]:
    body = {"messages": ASK, "max_tokens": 128, "vllm_xargs": {"script": encode(script)}, **body}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat_stream(server, encode, script: str, **body: Any) -> list[dict[str, Any]]:
    body = {"messages": ASK, "max_tokens": 128, "vllm_xargs": {"script": encode(script)}, "stream": True, **body}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def joined(chunks: list[dict[str, Any]], field: str, index: int = 0) -> str | None:
    parts = [c["choices"][0]["delta"][field] for c in chunks
             if c["choices"] and c["choices"][0]["index"] == index and c["choices"][0]["delta"].get(field) is not None]
    return "".join(parts) if parts else None


def test_reasoning_and_content_whole_and_streamed(server, encode) -> None:
    script = "<think>The quick fox.</think>Hello, world!"
    reply = chat(server, encode, script, logprobs=True)
    message = reply["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("The quick fox.", "Hello, world!")
    assert "reasoning_content" not in message  # vLLM 0.32's field is `reasoning` only
    # logprobs are the whole output's, reasoning included (vLLM's), one per generated token
    assert len(reply["choices"][0]["logprobs"]["content"]) == reply["usage"]["completion_tokens"]
    # usage counts the tokens inside the think block (vLLM's completion_tokens_details.reasoning_tokens)
    assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(encode("The quick fox."))}
    chunks = chat_stream(server, encode, script, stream_options={"include_usage": True})
    assert joined(chunks, "reasoning") == "The quick fox." and joined(chunks, "content") == "Hello, world!"
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(encode("The quick fox."))}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_no_end_of_reasoning_is_all_reasoning_and_n_choices_each_parse(server, encode) -> None:
    reply = chat(server, encode, "Cut off mid-thought", n=2)
    assert [(c["message"]["reasoning"], c["message"]["content"]) for c in reply["choices"]] == \
        [("Cut off mid-thought", None)] * 2
    chunks = chat_stream(server, encode, "<think>A</think>B", n=2)
    assert [(joined(chunks, "reasoning", i), joined(chunks, "content", i)) for i in (0, 1)] == [("A", "B")] * 2


def test_include_reasoning_false_drops_it_and_the_tokens_that_show_it(server, encode) -> None:
    script = "<think>Secret.</think>Visible."
    reply = chat(server, encode, script, include_reasoning=False, logprobs=True, return_token_ids=True)
    choice = reply["choices"][0]
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == (None, "Visible.")
    assert choice["logprobs"] is None and choice["token_ids"] is None
    chunks = chat_stream(server, encode, script, include_reasoning=False, logprobs=True)
    assert joined(chunks, "reasoning") is None and joined(chunks, "content") == "Visible."
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])


def test_enable_thinking_false_makes_the_whole_output_content(server, encode) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = chat(server, encode, "Just an answer.", **kwargs)
    assert (reply["choices"][0]["message"]["reasoning"], reply["choices"][0]["message"]["content"]) == \
        (None, "Just an answer.")
    chunks = chat_stream(server, encode, "Just an answer.", **kwargs)
    assert joined(chunks, "reasoning") is None and joined(chunks, "content") == "Just an answer."


@pytest.mark.parametrize("end", ["</think>", ""])  # "": the tool call ends the reasoning itself
def test_tool_calls_are_read_from_the_content_after_the_reasoning(server, encode, end: str) -> None:
    script = f'<think>Need the weather.{end}<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}' \
             '\n</tool_call>'
    reply = chat(server, encode, script, tools=[WEATHER])
    choice = reply["choices"][0]
    assert choice["message"]["reasoning"] == "Need the weather."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"})]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    chunks = chat_stream(server, encode, script, tools=[WEATHER])
    assert joined(chunks, "reasoning") == "Need the weather."
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


def test_a_structured_output_constrains_only_what_follows_the_reasoning(server, encode) -> None:
    body = {"structured_outputs": {"regex": "(yes|no)"},
            "vllm_xargs": {"script": encode("<think>Free text: 42!</think>"), "free_after_script": 1}}
    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 32, **body},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning"] == "Free text: 42!" and message["content"] in ("yes", "no")


def test_responses_give_a_reasoning_item_then_the_message(server, encode) -> None:
    body = {"input": "Hello", "max_output_tokens": 64,
            "vllm_xargs": {"script": encode("<think>Greet back.</think>Hi!")}}
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=120).json()
    reasoning, message = reply["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"text": "Greet back.", "type": "reasoning_text"}] and reasoning["summary"] == []
    assert message["type"] == "message" and message["content"][0]["text"] == "Hi!"
    assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] == len(encode("Greet back."))
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[3]["part"] == {"text": "", "type": "reasoning_text"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "Greet back."
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "Greet back." and done["output_index"] == 0
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hi!" and types[-1] == "response.completed"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    hidden = httpx.post(server.url + "/v1/responses", json={**body, "include_reasoning": False}, timeout=120).json()
    assert [item["type"] for item in hidden["output"]] == ["message"]


def test_thinking_token_budget_forces_the_end_of_thinking(server, encode, tokenizer) -> None:
    thought = encode("The quick brown fox.")
    reply = chat(server, encode, "<think>The quick brown fox.</think>Hi", thinking_token_budget=2,
                 return_token_ids=True)
    choice = reply["choices"][0]
    think, end_think = encode("<think>")[0], encode("</think>")[0]
    assert choice["token_ids"][:4] == [think, *thought[:2], end_think]  # two tokens of thinking, then the end
    assert choice["message"]["reasoning"] == tokenizer.decode(thought[:2])
    assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "thinking_token_budget": -2},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
    assert "must be a non-negative integer or -1 for unlimited" in bad.json()["error"]["message"]
