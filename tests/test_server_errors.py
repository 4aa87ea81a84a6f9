"""Client mistakes over raw HTTP: each gets its status and an OpenAI-shaped error body, never a 500, and
the server keeps serving (including after a fuzz of random JSON types in every field)."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.slow
KEY = "sk-errors"
LIMIT = 16 * 1024  # --max-request-body-bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)
    args = [str(model_dir), "--dtype", "float32", "--num-blocks", "512", "--block-size", "4",
            "--served-model-name", "tiny", "--max-request-body-bytes", str(LIMIT)]
    with ServerProcess(*args, api_key=KEY, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
        yield c


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


CMPL = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_COMPLETIONS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 10_000}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [5] * 300}, "prompt"),  # longer than max_model_len (256)
    ({"prompt": [1, 2, 10**6]}, "prompt"),  # out of vocabulary
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"stream": "maybe"}, "stream"),
    ({"echo": "yes"}, "echo"),  # strict types: "yes" is not a boolean
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"n": "2"}, "n"),
    ({"logit_bias": {"5000000": 1.0}}, "logit_bias"),  # out of vocabulary
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"logprob_token_ids": [1, 2]}, "logprob_token_ids"),  # without logprobs
    ({"truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),  # > max_model_len
    ({"use_beam_search": True, "stream": True}, "stream"),  # vLLM's refusal (its chat streams beams)
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),  # not applied by beam search (vLLM ignores it)
    ({"use_beam_search": True, "n": 11}, "n"),  # 22 logprobs per step > --max-logprobs 20
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"length_penalty": 2.0}, "length_penalty"),  # without beam search it does nothing
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),  # does not compile
    ({"guided_json": {"type": "strin"}}, "guided_json"),  # not a JSON schema
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "guided_regex"),  # two constraints
    # vLLM 0.32's sampling rules (vllm/sampling_params.py), its messages
    ({"n": 2, "temperature": 0}, "n"),  # n greedy samples would all be the same
    ({"temperature": 5}, "temperature"),  # [0, 2]
    ({"temperature": 1e308}, "temperature"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 20_000}, "n"),  # > VLLM_MAX_N_SEQUENCES
    ({"prompt": ["x"] * 1025}, "prompt"),  # > VLLM_MAX_COMPLETION_PROMPTS
    ({"prompt": ["x"] * 600, "n": 2}, "n"),  # 1,200 sequences can never fit --max-waiting-requests (1,024)
    ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),  # beyond int()'s digit limit
    ({"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0}, "logprob_token_ids"),
    ({"suffix": ""}, "suffix"),  # vLLM: any suffix needs FIM rendering
    ({"structured_outputs": {}}, "structured_outputs"),  # vLLM: one kind of constraint is needed
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs"),  # not xgrammar's
    ({"structured_outputs": {"regex": "a+", "backend": "outlines"}}, "structured_outputs"),  # unknown: not ignored
]


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS, ids=[json.dumps(p)[:40] for p, _ in BAD_COMPLETIONS])
def test_bad_completion_parameters_are_400(http, patch, param) -> None:
    _assert_error(http.post("/v1/completions", json={**CMPL, **patch}), 400, param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"max_completion_tokens": -3}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),  # without tools
    ({"logprobs": "yes"}, "logprobs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),  # no name
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice"),  # not among the tools
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {}}, "response_format"),  # type is required
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),  # no schema
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format"),  # no name
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": []}, "tools"),  # vLLM: omit the field instead
    # Assistant tool-call history in OpenAI's shape (id, type "function", function name + arguments text)
    ({"messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}, {"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": {"a": 1}}}]}, {"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, {"role": "user", "content": "hi"}]}, "messages"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"chat_template": "{{ 'X' }}"}, None),  # needs --trust-request-chat-template
    ({"chat_template_kwargs": {"chat_template": "{{ 'X' }}"}}, None),
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHATS, ids=[json.dumps(p)[:40] for p, _ in BAD_CHATS])
def test_bad_chat_parameters_are_400(http, patch, param) -> None:
    _assert_error(http.post("/v1/chat/completions", json={**CHAT, **patch}), 400, param)


def test_malformed_bodies_are_400(http) -> None:
    for raw in [b"{not json", b"[1, 2]", b'"text"', b"", b'{"prompt": "a", "temperature": NaN}',
                b'{"prompt": "a", "max_tokens": 4, "temperature": 1e999}', b"\xff\xfe", b"[" * 10_000]:
        r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        _assert_error(r, 400)


def test_lone_surrogates_are_400_and_the_connection_stays_usable(http) -> None:
    """JSON can escape half a UTF-16 pair, which is no character: a 400 naming it (it was a 500 from the
    tokenizer, or from encoding the 404 body, and each 500 also reset the keep-alive connection)."""
    bodies = [("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
              ("/v1/completions", b'{"model": "\\ud800", "prompt": "a", "max_tokens": 2}'),
              ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
              ("/tokenize", b'{"model": "tiny", "prompt": "\\ud800"}')]
    for path, raw in bodies:
        err = _assert_error(http.post(path, content=raw, headers={"Content-Type": "application/json"}), 400)
        assert "surrogate" in err["message"]
        ok = http.post("/v1/completions", json=CMPL)  # same client, same keep-alive connection
        assert ok.status_code == 200, ok.text
    # A real pair is a character (an emoji): accepted.
    emoji = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'
    assert http.post("/v1/completions", content=emoji, headers={"Content-Type": "application/json"}).status_code == 200


def test_json_bodies_need_the_json_content_type(http) -> None:
    body = json.dumps(CMPL).encode()
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        err = _assert_error(http.post("/v1/completions", content=body, headers=headers), 400)
        assert "Only 'application/json' is allowed" in err["message"]
    ok = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_deeply_nested_schema_is_400(http) -> None:
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    err = _assert_error(http.post("/v1/chat/completions", json={**CHAT, "response_format": fmt}), 400,
                        "response_format")
    # The structured-output check's own refusal (vLLM's check_json_nesting), not any error that says "nest"
    assert err["message"] == ("response_format: The JSON schema is nested too deeply: objects and arrays may nest "
                              "at most 64 levels"), err


def test_what_vllm_accepts_is_accepted(http) -> None:
    """Values vLLM 0.32 takes that tokenloom once refused (or mis-read)."""
    accepted = [
        ("/v1/completions", {**CMPL, "stream_options": {}}),  # empty stream options without a stream
        ("/v1/completions", {**CMPL, "repetition_penalty": 3.0}),  # vLLM: any finite value > 0
        ("/v1/completions", {**CMPL, "seed": -1}),  # -1: no seed
        ("/v1/completions", {**CMPL, "stop": [f"stop{i}" for i in range(4)]}),  # VLLM_MAX_STOP_STRINGS (4)
        ("/v1/completions", {**CMPL, "stop_token_ids": [7, 7, 9], "bad_words": ["ab", "ab"]}),  # twice: once
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 0}),  # 0 without logprobs
        ("/v1/completions", {**CMPL, "structured_outputs": {"regex": "a+", "disable_additional_properties": True}}),
        # vLLM's message shapes: any role (the template decides), plain-string parts, refusal parts, a text
        # part without text (skipped), no content at all, well-formed tool-call history
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ["hi", "there"]}]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
            {"type": "refusal", "refusal": "no"}, {"type": "text", "text": None},
            {"type": "input_text", "text": "x"}]}]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}),
        ("/v1/chat/completions", {**CHAT, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}),
    ]
    for path, body in accepted:
        r = http.post(path, json=body)
        assert r.status_code == 200, (body, r.text)
    # Parts render as their texts joined by newlines, as vLLM's "string" content format.
    def tokens(content) -> list[int]:
        r = http.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    parts = ["hi", {"type": "text", "text": None}, {"type": "refusal", "refusal": "there"}]
    assert tokens(parts) == tokens("hi\nthere")
    r = http.post("/v1/completions", json={**CMPL, "prompt_logprobs": 0, "stream": True})  # 0 streams
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


FIVE_STOPS = ["one", "two", "three", "four", "five"]
TOO_LONG = "List should have at most 4 items after validation, not 5"


def test_vllm_0_32_request_bounds_are_400_in_its_words(http) -> None:
    """vLLM 0.32's bounds on request-controlled inputs (tests/peer/requests/test_vllm_request_input_bounds.py checks
    the objects), one request each through the server: the status, the field and vLLM's message."""
    one_conversation = [{"role": "user", "content": "hi"}]
    refused = [  # (path, body, param, what the message holds)
        ("/v1/completions", {**CMPL, "stop": FIVE_STOPS}, "stop", TOO_LONG),
        ("/v1/chat/completions", {**CHAT, "stop": FIVE_STOPS}, "stop", TOO_LONG),
        ("/v1/chat/completions/batch", {"model": "tiny", "messages": [one_conversation], "stop": FIVE_STOPS}, "stop",
         TOO_LONG),
        ("/v1/responses", {"model": "tiny", "input": "hi", "stop": FIVE_STOPS}, "stop", TOO_LONG),
        ("/v1/completions", {**CMPL, "bad_words": [f"w{i}" for i in range(129)]}, "bad_words",
         "Too many bad words after tokenization: 129. The max number is 128."),
        ("/v1/completions", {**CMPL, "bad_words": ["x" * 1200]}, "bad_words", "Too many total bad word tokens"),
        ("/v1/completions", {**CMPL, "bad_words": ["a", ""]}, "bad_words", "bad_words cannot contain an empty string"),
        ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "n": 16385}, "n",
         "must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES"),
        ("/v1/completions", {**CMPL, "vllm_xargs": {"big": 2**64}}, "extra_args",
         "extra_args integers must be between -2**63 and 2**64 - 1."),
        ("/v1/completions", {**CMPL, "repetition_detection": {"max_pattern_size": 3, "min_count": 1}},
         "repetition_detection", "min_count must be >= 2 to detect repetitive patterns"),
        ("/v1/chat/completions", {**CHAT, "repetition_detection": {"max_pattern_size": 1, "min_pattern_size": 2,
                                                                   "min_count": 2}},
         "repetition_detection", "with min_pattern_size <= max_pattern_size"),
        ("/v1/completions", {**CMPL, "stop_token_ids": [10**6]}, "stop_token_ids", "out of vocabulary"),
    ]
    for path, body, param, words in refused:
        err = _assert_error(http.post(path, json=body), 400, param)
        assert words in err["message"], (path, body, err)


def test_responses_reads_the_sampling_fields_vllm_takes_there(http) -> None:
    """vLLM 0.32's ResponsesRequest has min_p, the penalties and stop_token_ids (they were ignored here: unknown
    fields are); each now reaches the sampling parameters, and its bad value is their 400."""
    base = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
    for patch, param in (({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"), ({"stop_token_ids": [10**6]},
                                                                            "stop_token_ids"),
                         ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params")):
        _assert_error(http.post("/v1/responses", json={**base, **patch}), 400, param)
    ok = http.post("/v1/responses", json={**base, "min_p": 0.1, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                          "stop_token_ids": [7], "session_id": "s1"})
    assert ok.status_code == 200, ok.text


def test_repetition_detection_ends_a_request_as_vllm_reports_it(http) -> None:
    """Two allowed tokens make the output repeat within four tokens; vLLM's finish_reason and stop_reason."""
    detect = {"max_pattern_size": 2, "min_count": 2}
    for path, base in (("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)):
        r = http.post(path, json={**base, "max_tokens": 16, "temperature": 0, "allowed_token_ids": [5, 12],
                                  "repetition_detection": detect})
        assert r.status_code == 200, r.text
        [c] = r.json()["choices"]
        assert (c["finish_reason"], c["stop_reason"]) == ("repetition", "repetition_detected"), c
        assert r.json()["usage"]["completion_tokens"] <= 4, r.json()


def test_empty_prompts_are_refused_with_vllms_words(http) -> None:
    """vLLM's CompletionRequest validator refuses an empty prompt with its own sentence, its input processor an
    empty prompt among others with another; clients (and vLLM's tests) match on these."""
    for prompt in ("", []):
        err = _assert_error(http.post("/v1/completions", json={**CMPL, "prompt": prompt}), 400, "prompt")
        assert err["message"] == "Either prompt or prompt_embeds must be provided and non-empty.", err
    # vLLM's test_prompt_validation.py::test_empty_prompt: no prompt and empty prompt_embeds, the same sentence
    for body in ({"prompt": None, "prompt_embeds": []}, {"prompt": "", "prompt_embeds": []}, {"prompt": None}):
        err = _assert_error(http.post("/v1/completions", json={**CMPL, **body}), 400, "prompt")
        assert err["message"] == "Either prompt or prompt_embeds must be provided and non-empty.", (body, err)
    err = _assert_error(http.post("/v1/completions", json={**CMPL, "prompt_embeds": "AAAA"}), 400, "prompt_embeds")
    err = _assert_error(http.post("/v1/completions", json={**CMPL, "prompt": [[1, 2], []]}), 400, "prompt")
    assert "The decoder prompt cannot be empty" in err["message"], err


def test_completion_max_tokens_null_means_16(http) -> None:
    """vLLM's completions turn an explicit null into the default (16), not 'until the context is full'."""
    body = {**CMPL, "max_tokens": None, "ignore_eos": True, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16


def test_a_max_tokens_past_the_context_runs_until_the_context_is_full(http) -> None:
    """vLLM 0.32's get_max_tokens: max_tokens (chat's max_completion_tokens) larger than the room the prompt leaves
    is capped at that room, 200 with finish_reason "length", not refused; a prompt that fills the context still
    is (vLLM's words)."""
    max_len = http.post("/tokenize", json={"model": "tiny", "prompt": "hello"}).json()["max_model_len"]
    for body in ({**CMPL, "max_tokens": 10**9}, {**CMPL, "max_tokens": max_len}):
        r = http.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] == max_len and usage["completion_tokens"] == max_len - usage["prompt_tokens"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": None, "max_completion_tokens": 10**9,
                                                "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == max_len, r.text
    err = _assert_error(http.post("/v1/completions", json={**CMPL, "prompt": [5] * max_len, "max_tokens": 10**9}),
                        400, "prompt")
    assert "maximum model length of 256" in err["message"], err


def test_unknown_model_route_and_method(http) -> None:
    err = _assert_error(http.post("/v1/completions", json={**CMPL, "model": "gpt-17"}), 404, "model")
    assert err["type"] == "NotFoundError"
    _assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404, "model")
    _assert_error(http.get("/v1/models/gpt-17"), 404)
    _assert_error(http.get("/v1/nothing-here"), 404)
    r = _assert_error(http.get("/v1/completions"), 405)
    assert r["type"] == "MethodNotAllowedError"
    _assert_error(http.delete("/health"), 405)


def test_oversized_bodies_are_413(http) -> None:
    big = {**CMPL, "prompt": "x" * (LIMIT + 10)}
    _assert_error(http.post("/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit is counted as the body streams in
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1000 + 2):
            yield b"y" * 1000
        yield b'"}'

    _assert_error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    # Far beyond the socket buffers: the 413 goes out before the body is read, and the rest is drained so
    # the client (which writes everything before reading) reads it instead of a connection reset.
    huge = b'{"prompt": "' + b"z" * (16 << 20) + b'"}'
    _assert_error(http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"}), 413)


def test_api_key(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=CMPL, headers=headers, timeout=10)
        assert _assert_error(r, 401)["type"] == "AuthenticationError"
    _assert_error(httpx.get(server.url + "/v1/models", timeout=10), 401)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200


_VALUES = [None, True, False, -1, 0, 1, 3, 2**70, -(2**70), 1.5, -0.0, 1e300, "", "x", "1", [], [1], ["a"], [[1]],
           [None], {}, {"a": 1}, {"type": "text"}]
_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
           "stream_options", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
           "min_tokens", "priority", "include_stop_str_in_output", "skip_special_tokens", "stop_token_ids",
           "echo", "best_of", "user", "logit_bias", "suffix", "return_token_ids", "use_beam_search",
           "length_penalty"]
_CHAT_FIELDS = ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                "response_format", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"]


def test_fuzzed_fields_never_500_and_the_engine_keeps_serving(http) -> None:
    rng = random.Random(1234)
    cases = [("/v1/completions", CMPL, f) for f in _FIELDS] + [("/v1/chat/completions", CHAT, f)
                                                              for f in _FIELDS + _CHAT_FIELDS if f != "prompt"]
    statuses: dict[int, int] = {}
    for path, base, field in cases:
        for value in rng.sample(_VALUES, 8):
            body = {**base, field: value}
            with http.stream("POST", path, json=body) as r:
                r.read()  # a stream=True that passed validation answers 200 with SSE
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (200, 400, 404), (body, r.status_code, r.text[:300])
                if r.status_code != 200:
                    _assert_error(r, r.status_code)
                else:  # a stream fails after its 200 with an error event; a client's mistake never may
                    assert b'"code":500' not in r.content, (body, r.text[:300])
    assert statuses.get(200) and statuses.get(400)
    ok = http.post("/v1/completions", json={**CMPL, "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert http.get("/health").status_code == 200


def test_a_body_that_does_not_validate_is_described_in_vllms_words() -> None:
    """vLLM's validation handler's message: the count, then each error's pydantic type, field, words and the value
    sent (a long value cut, a container described), at most ten; `param` the first field. tokenloom's message
    had neither the type nor the value, which vLLM's tests read ("literal_error", the bad value)."""
    from tokenloom.server.body import parse_model
    from tokenloom.server.errors import APIError
    from tokenloom.server.protocol import CompletionRequest

    with pytest.raises(APIError) as err:
        parse_model(CompletionRequest, {"prompt": "hi", "n": "x" * 500, "stop": [5] * 300})
    assert err.value.status == 400 and err.value.param == "n"
    lines = err.value.message.splitlines()
    assert lines[0] == "302 validation errors:" and len(lines) == 12 and lines[-1] == "  ...and 292 more errors"
    assert "'type': 'int_type', 'loc': 'n'" in lines[1] and "x" * 200 + "...[truncated]" in lines[1]
    assert "'loc': 'stop', " in lines[2] and "'input': '<list of 300 items>'" in lines[2]  # union branches left out
    with pytest.raises(APIError) as err:
        parse_model(CompletionRequest, {"prompt": "hi", "stream": "maybe"})
    assert err.value.message == ("1 validation error:\n  {'type': 'bool_type', 'loc': 'stream', 'msg': 'Input should "
                                 "be a valid boolean', 'input': 'maybe'}")
