"""A property-based sweep of malformed requests over every endpoint of the server (hypothesis).

The rule it holds the server to: bad input gets a clear error, never a hang, a crash of the engine or a
lost request. For each generated body: the status is 2xx or 4xx (never 5xx, never a dropped connection);
a 4xx carries the OpenAI error object ({"error": {"message", "type", "param", "code"}}, as vLLM's
ErrorResponse); a stream that started with 200 carries no 5xx error event; the answer arrives within
the client's timeout. After the sweep the same server answers a normal request with the same tokens as
before it, and the leak check (tests/conftest.py) proves nothing was left running or holding KV blocks.

Bodies are a valid request with one to three fields replaced by garbage (wrong JSON types, extreme or
non-finite numbers, nested junk, long strings, out-of-vocabulary ids), by a value chosen to be hostile
to that field, or removed; plus raw bytes (invalid JSON and UTF-8, lone surrogates, truncated bodies,
wrong content types). Examples are few and derandomized, so the run is reproducible and short; raise
TOKENLOOM_SWEEP_EXAMPLES to sweep harder locally (docs/reliability.md).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pooling_models import make_tiny_bert
from tests.test_server_harness import ServerProcess
from tests.tiny_models import TINY_HIDDEN, TINY_INTERMEDIATE, TINY_KV_HEADS, TINY_LAYERS, TINY_VOCAB, make_tiny_hf_model

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TOKENLOOM_SWEEP_EXAMPLES", "20"))
CLIENT_TIMEOUT_S = 60.0  # a hang, not a slow answer on a loaded machine: every answer here takes < 1 s idle
SWEEP = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])

# Values of every JSON type, and the edges that have broken servers: ints past int64, floats at the ends of
# the double range, strings that look like other types or like special tokens, long strings.
_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, TINY_VOCAB - 1, TINY_VOCAB, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, 0.5, -0.0]),
    st.text(st.characters(exclude_categories=()), max_size=12),  # lone surrogates too (JSON escapes them)
    st.sampled_from(["", " ", "true", "null", "-1", "1e999", "<|im_end|>", "\x00", "tiny", "a" * 3000, "日本😀",
                     "\ud800",
                     "{{ 7*7 }}", "[", "(a"]),
)
_KEYS = st.text(max_size=6) | st.sampled_from(["type", "name", "text", "role", "content", "function", "schema",
                                                "json_schema", "parameters", "properties", "id", "arguments"])
GARBAGE = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
                       max_leaves=8)

MODEL = "tiny"
MAX_LEN = 1024  # room for a chat with tools (the hermes tools prompt is ~500 tokens), so fields past it are reached
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MSGS = [{"role": "user", "content": "hi"}]
_BAD_SCHEMAS = [{"type": "strin"}, {"type": "object", "properties": 5}, {"$ref": "#/nowhere"}, {"enum": []},
                {"type": "array", "items": {"type": "object", "required": [1]}}, {"minLength": -1, "type": "string"},
                {"type": "integer", "minimum": 5, "maximum": 1}, {"pattern": "(ab", "type": "string"}, True, "x"]
_HUGE_IDS = [[TINY_VOCAB], [-1], [2**63], [1, 2, 10**9], [True, 1]]
_COMMON_HOSTILE: dict[str, list[Any]] = {
    "model": ["gpt-17", "", "t" * 500, "../../etc/passwd", None, "\ud800"],
    "n": [0, -1, 2**31, 129, 10**6],
    "max_tokens": [0, -1, 2**31, MAX_LEN, MAX_LEN + 1, 10**30],
    "temperature": [-0.0, -1, 2.0000001, 1e-320, 1e308],
    "top_p": [0, -0.5, 1.5, 1e-320], "top_k": [-2, 0, TINY_VOCAB + 1, 2**40], "min_p": [-1, 1.0001, 1],
    "seed": [-(2**63) - 1, 2**64, -2], "priority": [2**63, -(2**63) - 1, 10**30],
    "presence_penalty": [-2.1, 2.1, 1e308], "frequency_penalty": [-2.1, 1e308], "repetition_penalty": [0, -1, 1e308],
    "stop": [[""], [None], [[]], ["a"] * 2000, "x" * 5000, [{"a": 1}]],
    "stop_token_ids": _HUGE_IDS, "allowed_token_ids": [[], *_HUGE_IDS], "logprob_token_ids": _HUGE_IDS,
    "bad_words": [[""], ["   "], "x", [None], [1], [["a"]], {"a": 1}, ["a"] * 2000, ["x" * 5000]],
    "logit_bias": [{"1": "x"}, {"-1": 1}, {str(TINY_VOCAB): 1}, {"1": 1e308}, {" 1 ": 1}, {"1.5": 1},
                   {"0x1": 1}, {"１": 1}, {"": 1}, {"1" * 30: 1}, {"1": None}],
    "stream": [True, "true", 1], "stream_options": [{"include_usage": "x"}, {"continuous_usage_stats": True},
                                                    {"include_usage": True, "extra": [1]}],
    "min_tokens": [-1, 2**31, 10**6], "prompt_logprobs": [-1, -2, 21, 2**31, 0],
    "truncate_prompt_tokens": [-2, 0, MAX_LEN + 1, 2**63],
    "truncation_side": ["middle", None], "use_beam_search": [True], "length_penalty": [1e308, -1],
    "kv_transfer_params": [{"do_remote_prefill": True}, {"do_remote_decode": True, "remote_block_ids": "x"},
                           {"do_remote_prefill": True, "remote_engine_id": 5, "remote_block_ids": [[1]]}],
    "structured_outputs": [{"regex": "(ab"}, {"json": {"type": "strin"}}, {"grammar": "root ::= "},
                           {"choice": []}, {"choice": [1]}, {"json": "{"}, {"regex": "a" * 5000},
                           {"json": {"type": "string", "pattern": "(x"}}, {"structural_tag": "x"},
                           {"grammar": "root ::= root"}, {"json_object": True, "regex": "a"},
                           {"grammar": 'root ::= a\na ::= a "x"'}, {"regex": "[^\\x00-\\x{10FFFF}]"}],
    "guided_json": _BAD_SCHEMAS, "guided_regex": ["(ab", "[", "\\"], "guided_choice": [[], [None], "a"],
    "guided_grammar": ["root ::=", "root ::= x"],
}

_CHAT_HOSTILE: dict[str, list[Any]] = {
    **_COMMON_HOSTILE,
    "messages": [[], [{}], [{"role": None}], [{"role": "user", "content": [{}]}],
                 [{"role": "user", "content": "\udfff"}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": 5}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                 [{"role": "tool", "content": "x"}], [{"role": "assistant", "content": "x"}],
                 [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                                   "function": {"name": 5, "arguments": "{"}}]}],
                 [{"role": "user", "content": "x" * 5000}], [{"role": "user", "content": "\x00\x01"}],
                 [{"role": "user", "content": "hi"}] * 300],
    "tools": [[], [{}], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
              [{"type": "code_interpreter"}], [TOOL, TOOL], [{"type": "function", "function": {"name": "f" * 3000}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": {"a": 5}}}}]],
    "tool_choice": ["required", "auto", "none", "any", {"type": "function"}, {"type": "function", "function": {}},
                    {"type": "function", "function": {"name": "missing"}}, {"type": "x"}],
    "response_format": [{"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in _BAD_SCHEMAS]
    + [{"type": "json_object"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": "x"},
       {"type": "structural_tag"}, {"type": "structural_tag", "format": 5}, {"type": None}],
    "logprobs": [True, "true"], "top_logprobs": [-1, 21, 2**31, 0], "max_completion_tokens": [0, -1, 2**31],
    "chat_template_kwargs": [{"add_generation_prompt": "x"}, {"tools": 5}, {"messages": 5}],
    "continue_final_message": [True], "add_generation_prompt": [False],
    "documents": [[{"a": 1}], [{"title": None}], "x"],
    "reasoning_effort": ["max", "huge", 5],
}
_COMPLETION_HOSTILE: dict[str, list[Any]] = {
    **_COMMON_HOSTILE,
    "prompt": ["", "a\ud800b", [], [[]], [[], [1]], [TINY_VOCAB], [-1], [2**63], [[1], ["a"]], ["a", 1], [True],
               "x" * 5000, [1] * (MAX_LEN + 1), ["a"] * 1025, "\x00", [None], {"a": 1}],
    "logprobs": [-1, -2, 21, 2**31, 0], "echo": [True], "best_of": [0, 2, -1, 10**6], "suffix": ["", "x"],
}
_RESPONSES_HOSTILE: dict[str, list[Any]] = {
    **{k: v for k, v in _COMMON_HOSTILE.items() if k in ("model", "temperature", "top_p", "top_k", "seed", "stop",
                                                         "priority", "logit_bias", "stream", "repetition_penalty",
                                                         "structured_outputs")},
    "input": ["", "\ud800", [], [{}], [{"type": "message"}], [{"role": "user", "content": 5}],
              [{"type": "message", "role": "robot", "content": "x"}], [{"type": "function_call"}],
              [{"type": "function_call_output", "output": 5}], [{"type": "reasoning", "encrypted_content": "x"}],
              [{"role": "user", "content": [{"type": "input_image"}]}], [{"type": "item_reference", "id": "x"}]],
    "max_output_tokens": [0, -1, 2**31], "instructions": ["", "x" * 5000],
    "text": [{"format": 5}, {"format": {"type": "json_schema"}}, {"format": {"type": "json_schema", "schema": 5}},
             {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}, {"verbosity": "low"},
             {"format": {"type": "xml"}}, {"x": 1}],
    "tools": [[{}], [{"type": "function"}], [{"type": "function", "name": 5}], [{"type": "web_search"}],
              [{"type": "namespace"}], [{"type": "function", "name": "f", "parameters": {"type": "strin"}}]],
    "tool_choice": ["required", {"type": "function", "name": "missing"}, {"type": "x"}, "bogus"],
    "previous_response_id": ["resp_missing", "", "x" * 500], "include": [["nothing"], [5]],
    "top_logprobs": [-1, 21, 2**31], "truncation": ["auto", "x"], "store": [False],
    "reasoning": [{"effort": "huge"}, {"effort": None}, "x"], "metadata": [{"a": 5}, {"a": "x" * 5000}],
    "background": [True], "enable_response_messages": [True],
}
_TOKENIZE_HOSTILE: dict[str, list[Any]] = {
    "model": _COMMON_HOSTILE["model"], "prompt": ["", "x" * 5000, None, [1], "\ud800"],
    "messages": _CHAT_HOSTILE["messages"],
    "add_special_tokens": ["x"], "return_token_strs": ["x"], "chat_template_kwargs": [{"tools": 5}],
}
_DETOKENIZE_HOSTILE: dict[str, list[Any]] = {
    "model": _COMMON_HOSTILE["model"], "tokens": [[], [-1], [TINY_VOCAB], [2**63], [2**64], [10**30], [1.5], "x",
                                                  [None]],
}
_LORA_HOSTILE: dict[str, list[Any]] = {
    "lora_name": ["", "tiny", "x" * 500, "../x", None, 5], "lora_path": ["", "/", "/nonexistent", "/etc/passwd",
                                                                        "/proc/self", ".", 5, None],
    "load_inplace": [True],
}
_POOLING_HOSTILE: dict[str, list[Any]] = {
    "model": _COMMON_HOSTILE["model"],
    "input": ["", "\udc80", [], [""], [[]], [[1], []], ["a", 1], [[1], ["a"]], [-1], [10**9], [2**63], [2**64], [True],
              "x" * 5000, ["word"] * 2000, [[1] * 200], {"a": 1}, [None]],
    "messages": [[], [{}], [{"role": "user"}], [{"role": 5, "content": "x"}], [{"content": "x"}], "x", [5]],
    "encoding_format": ["base32", None, 5], "dimensions": [0, -1, 8, 2**63, 10**30, 32, "x"],
    "normalize": ["x", 5], "truncate_prompt_tokens": [-2, -1, 0, 1, 10**6, 2**63, 10**30],
    "priority": [2**63, 10**30, -(2**63) - 1, "3"], "task": ["", "generate", "classify", "token_embed", 5],
    "use_activation": ["x"], "add_special_tokens": ["x"], "request_id": [5, "x" * 1000],
    "text_1": ["", [], [""], 5, [5], ["a"] * 600], "text_2": ["", [], [""], 5, [5], ["a", "b", "c"], ["a"] * 600],
    "query": ["", 5, None, "x" * 5000, "\ud800"], "documents": [[], [""], [5], "x", ["a"] * 600, [{"text": "a"}]],
    "top_n": [-1, 0, 10**30, 2**63, "x"],
}

ENDPOINTS: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
    "/v1/completions": ({"model": MODEL, "prompt": "hello", "max_tokens": 3}, _COMPLETION_HOSTILE),
    "/v1/chat/completions": ({"model": MODEL, "messages": MSGS, "max_tokens": 3, "tools": [TOOL]}, _CHAT_HOSTILE),
    "/v1/chat/completions/batch": ({"model": MODEL, "messages": [MSGS, MSGS], "max_tokens": 3},
                                   {**_CHAT_HOSTILE,
                                    "messages": [[[]], [MSGS, []], ["x"], [[{}]], MSGS, [MSGS] * 600]}),
    "/v1/responses": ({"model": MODEL, "input": "hello", "max_output_tokens": 3, "store": True}, _RESPONSES_HOSTILE),
    "/invocations": ({"model": MODEL, "prompt": "hello", "max_tokens": 3}, _COMPLETION_HOSTILE),
    "/tokenize": ({"model": MODEL, "prompt": "hello"}, _TOKENIZE_HOSTILE),
    "/detokenize": ({"model": MODEL, "tokens": [5, 6]}, _DETOKENIZE_HOSTILE),
    "/v1/load_lora_adapter": ({"lora_name": "a", "lora_path": "/nonexistent"}, _LORA_HOSTILE),
    "/v1/unload_lora_adapter": ({"lora_name": "a"}, _LORA_HOSTILE),
    # A generation model: every pooling route must refuse with a 400, whatever the body.
    "/v1/embeddings": ({"model": MODEL, "input": "hello"}, _POOLING_HOSTILE),
}
POOLING_ENDPOINTS: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
    "/v1/embeddings": ({"model": "emb", "input": ["a cat", "a dog"]}, _POOLING_HOSTILE),
    "/pooling": ({"model": "emb", "input": "a cat"}, _POOLING_HOSTILE),
    "/classify": ({"model": "emb", "input": "a cat"}, _POOLING_HOSTILE),
    "/score": ({"model": "emb", "text_1": "a cat", "text_2": ["a dog", "the mat"]}, _POOLING_HOSTILE),
    "/rerank": ({"model": "emb", "query": "a cat", "documents": ["a dog", "the mat"], "top_n": 1}, _POOLING_HOSTILE),
    "/v2/rerank": ({"model": "emb", "query": "a cat", "documents": ["a dog"]}, _POOLING_HOSTILE),
    "/tokenize": ({"model": "emb", "prompt": "a cat"}, _TOKENIZE_HOSTILE),
    # A pooling model: generation routes refuse.
    "/v1/completions": ({"model": "emb", "prompt": "hello", "max_tokens": 3}, _COMPLETION_HOSTILE),
}


@st.composite
def mutated_bodies(draw: st.DrawFn, base: dict[str, Any], hostile: dict[str, list[Any]]) -> dict[str, Any]:
    """`base` with one to three fields garbled: garbage of any type, a value hostile to that field, or removed."""
    body = copy.deepcopy(base)
    fields = sorted(set(hostile) | set(base))
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        action = draw(st.sampled_from(["hostile", "hostile", "garbage", "delete"]))
        if action == "delete":
            body.pop(field, None)
        elif action == "hostile" and hostile.get(field):
            body[field] = copy.deepcopy(draw(st.sampled_from(hostile[field])))
        else:
            body[field] = draw(GARBAGE)
    if draw(st.integers(0, 5)) == 0:  # an unknown field: ignored, as vLLM does
        body[draw(st.text(min_size=1, max_size=8))] = draw(GARBAGE)
    strings = list(_string_slots(body))
    if strings and draw(st.integers(0, 3)) == 0:  # half a UTF-16 pair in one of the texts (a prompt, a role...)
        holder, key = draw(st.sampled_from(strings))
        holder[key] = holder[key][:3] + draw(st.sampled_from(["\ud800", "\udfff", "\udc80x"]))
    return body


def _string_slots(obj: Any) -> Any:
    """(container, key) of every string value in a JSON document."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(value, str):
            yield obj, key
        else:
            yield from _string_slots(value)


_VALID = b'{"model": "tiny", "prompt": "hello", "max_tokens": 3}'
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"null", b"[]", b"1", b'"x"', b"{}", b'{"a": NaN}', b'{"a": Infinity}',
                     b'{"a": -Infinity}', b'{"a": 1e999}', b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"[" * 50_000,
                     b'{"a": ' * 50_000, b'{"model": "\\ud800", "prompt": "x"}', b'{"prompt": "\\udfff"}',
                     b'{"messages": [{"role": "user", "content": "\\ud800"}], "model": "tiny"}',
                     b'{"input": "\\ud800", "model": "tiny"}', b'{"tokens": [1], "model": "tiny"}\x00',
                     b'{"prompt": "a", "prompt": 5, "model": "tiny"}', b'{"\\u0000": 1}']),
    st.integers(1, len(_VALID) - 1).map(lambda cut: _VALID[:cut]),  # a body cut short
)
CONTENT_TYPES = st.sampled_from(["application/json", "application/json; charset=latin-1", "text/plain", "",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                 "application/JSON", "application/json-patch+json"])

# json.dumps escapes what is not ASCII, so a lone surrogate in a generated string travels as "\ud800" (httpx's
# json= would refuse to encode it): the server must refuse it, not the test's client.
JSON = {"Content-Type": "application/json"}
FALLBACK_LOG = re.compile(r": \d{3} from \w+: |unhandled error in ")
_SSE_SERVER_ERROR = re.compile(rb'"code":\s*5\d\d')
# Python's own words for a failure the code did not foresee, as the whole message: a client cannot act on
# "'int' object is not iterable" (a TypeError that escaped, caught only by a fallback handler). After a
# prefix that says what failed ("cannot read adapter_config.json: ...") the same words are context.
UNCLEAR = re.compile(r"^(?:'[^']*' object (?:is not|has no|cannot)|unhashable type|(?:list|tuple|string) index out of "
                     r"range|'[^']*' not supported between|\w+\(\) (?:takes|got|missing|should|argument)|'[^']*'$|"
                     r"None$|[A-Za-z]*Error\b)")


def check_answer(http: httpx.Client, method: str, path: str, **kwargs: Any) -> int:
    """Send one request and hold its answer to the rule; the status."""
    try:
        with http.stream(method, path, **kwargs) as r:
            content = r.read()
    except httpx.TimeoutException:
        pytest.fail(f"{method} {path} hung (> {CLIENT_TIMEOUT_S:g} s): {str(kwargs)[:400]}")
    except httpx.TransportError as exc:
        pytest.fail(f"{method} {path} dropped the connection ({exc!r}): {str(kwargs)[:400]}")
    what = f"{method} {path} {str(kwargs)[:400]} -> {r.status_code} {content[:400]!r}"
    assert 200 <= r.status_code < 500, what
    if r.status_code >= 400:
        try:
            err = json.loads(content)["error"]
        except (ValueError, KeyError, TypeError):
            pytest.fail(f"a {r.status_code} without the OpenAI error object: {what}")
        assert set(err) == {"message", "type", "param", "code"}, what
        assert err["code"] == r.status_code and isinstance(err["message"], str) and err["message"], what
        assert isinstance(err["type"], str) and err["type"].endswith("Error"), what
        assert err["param"] is None or isinstance(err["param"], str), what
        assert not UNCLEAR.search(err["message"]), f"an unclear message: {what}"
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert not _SSE_SERVER_ERROR.search(content), f"a server error inside the stream: {what}"
    return r.status_code


def _greedy(http: httpx.Client, model: str) -> list[int]:
    r = http.post("/v1/completions", json={"model": model, "prompt": "The quick brown", "max_tokens": 8,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def gen_server(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=7,
                                   max_position_embeddings=MAX_LEN)
    args = [str(model_dir), "--dtype", "float32", "--num-blocks", "1024", "--block-size", "4",
            "--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--uvicorn-log-level", "info"]
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as s:
        yield s


@pytest.fixture(scope="module")
def gen_http(gen_server):
    with httpx.Client(base_url=gen_server.url, timeout=CLIENT_TIMEOUT_S) as c:
        c.reference = _greedy(c, MODEL)  # the greedy tokens before the sweep, compared after it
        yield c


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory):
    model_dir = make_tiny_bert(tmp_path_factory.mktemp("bert"), sentence_transformers_pooling="mean", seed=4)
    args = [str(model_dir), "--dtype", "float32", "--served-model-name", "emb", "--uvicorn-log-level", "info"]
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def pool_http(pool_server):
    with httpx.Client(base_url=pool_server.url, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_generation_server_sweep(gen_http, path) -> None:
    base, hostile = ENDPOINTS[path]

    @SWEEP
    @given(body=mutated_bodies(base, hostile))
    def run(body: dict[str, Any]) -> None:
        check_answer(gen_http, "POST", path, content=json.dumps(body), headers=JSON)

    run()


@pytest.mark.parametrize("path", list(POOLING_ENDPOINTS))
def test_pooling_server_sweep(pool_http, path) -> None:
    base, hostile = POOLING_ENDPOINTS[path]

    @SWEEP
    @given(body=mutated_bodies(base, hostile))
    def run(body: dict[str, Any]) -> None:
        check_answer(pool_http, "POST", path, content=json.dumps(body), headers=JSON)

    run()


_RAW_PATHS = [*ENDPOINTS, "/v1/responses/resp_x/cancel", "/pooling", "/score", "/rerank", "/classify"]


@SWEEP
@given(path=st.sampled_from(_RAW_PATHS), raw=RAW_BODIES, content_type=CONTENT_TYPES)
def test_raw_bodies_and_content_types(gen_http, path, raw, content_type) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    check_answer(gen_http, "POST", path, content=raw, headers=headers)


@SWEEP
@given(name=st.text(max_size=40) | st.sampled_from(["..", "%2e%2e", "a/b", "x" * 3000, "%00", "%ff", "%ud800"]),
       route=st.sampled_from(["/v1/models/{}", "/v1/responses/{}", "/v1/responses/{}/cancel"]))
def test_path_parameters(gen_http, name, route) -> None:
    method = "POST" if route.endswith("cancel") else "GET"
    check_answer(gen_http, method, route.format(quote(name, safe="%")))


def _adapter(root: Path, name: str, config: Any = None, tensors: dict[str, Any] | None = None,
             raw_weights: bytes | None = None) -> str:
    """An adapter directory in PEFT's layout whose config and weights are whatever the case needs."""
    import torch
    from safetensors.torch import save_file

    path = root / name
    path.mkdir()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]} if config is None else config
    (path / "adapter_config.json").write_bytes(cfg if isinstance(cfg, bytes) else
                                               cfg.encode() if isinstance(cfg, str) else json.dumps(cfg).encode())
    if raw_weights is not None:
        (path / "adapter_model.safetensors").write_bytes(raw_weights)
    else:
        if tensors is None:
            tensors = {"A": torch.randn(4, TINY_HIDDEN), "B": torch.randn(TINY_HIDDEN, 4)}
        prefix = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
        save_file({f"{prefix}{k}.weight" if k in ("A", "B") else k: v.contiguous() for k, v in tensors.items()},
                  str(path / "adapter_model.safetensors"))
    return str(path)


def _bad_adapters(root: Path) -> list[str]:
    import torch

    nan, inf = float("nan"), float("inf")
    a, b = torch.randn(4, TINY_HIDDEN), torch.randn(TINY_HIDDEN, 4)
    head_dim = TINY_HIDDEN // 4
    return [
        _adapter(root, "nan", tensors={"A": torch.full_like(a, nan), "B": b}),
        _adapter(root, "inf", tensors={"A": a, "B": torch.full_like(b, inf)}),
        _adapter(root, "huge", tensors={"A": a * 1e30, "B": b * 1e30}),
        _adapter(root, "alpha_huge", config={"r": 4, "lora_alpha": 1e300, "target_modules": ["q_proj"]}),
        _adapter(root, "alpha_nan", config='{"r": 4, "lora_alpha": NaN, "target_modules": ["q_proj"]}'),
        _adapter(root, "alpha_inf", config='{"r": 4, "lora_alpha": -Infinity}'),
        _adapter(root, "alpha_str", config={"r": 4, "lora_alpha": "8"}),
        _adapter(root, "r_str", config={"r": "4"}), _adapter(root, "r_zero", config={"r": 0}),
        _adapter(root, "r_big", config={"r": 10**30}), _adapter(root, "r_float", config={"r": 4.0}),
        _adapter(root, "targets_int", config={"r": 4, "target_modules": 5}),
        _adapter(root, "targets_nested", config={"r": 4, "target_modules": [["q_proj"]]}),
        _adapter(root, "config_list", config="[1, 2]"), _adapter(root, "config_text", config="not json {"),
        _adapter(root, "config_empty", config=""), _adapter(root, "config_bad_utf8", config=b"{\"r\": \xff}"),
        _adapter(root, "peft_type", config={"r": 4, "peft_type": ["LORA"]}),
        _adapter(root, "weights_garbage", raw_weights=b"\x00" * 64),
        _adapter(root, "weights_empty", raw_weights=b""),
        _adapter(root, "weights_header", raw_weights=(10**6).to_bytes(8, "little") + b"{}"),
        _adapter(root, "no_weights", tensors={}),
        _adapter(root, "half", tensors={"A": a}),
        _adapter(root, "layer_far", tensors={"base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight": a,
                                             "base_model.model.model.layers.99.self_attn.q_proj.lora_B.weight": b}),
        _adapter(root, "shape", tensors={"A": torch.randn(4, TINY_HIDDEN + 1), "B": b}),
        _adapter(root, "three_d", tensors={"A": a[None], "B": b[None]}),
        _adapter(root, "rank_mismatch", tensors={"A": a, "B": torch.randn(TINY_HIDDEN, 3)}),
        _adapter(root, "int_weights", tensors={"A": a.to(torch.int8), "B": b.to(torch.int64)}),
        _adapter(root, "bool_weights", tensors={"A": a > 0, "B": b > 0}),
        _adapter(root, "fp16_inf", tensors={"A": (a * 1e5).half(), "B": b.half()}),
        _adapter(root, "empty_rank", tensors={"A": a[:0], "B": b[:, :0]}),
        _adapter(root, "k_proj_shape", tensors={
            "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.randn(TINY_KV_HEADS * head_dim
                                                                                           + 1, 4)}),
        _adapter(root, "down_proj", tensors={
            "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight": torch.randn(4, TINY_INTERMEDIATE) * 1e20,
            "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight": torch.randn(TINY_HIDDEN, 4) * 1e20}),
        _adapter(root, "layer_negative", tensors={
            f"base_model.model.model.layers.{TINY_LAYERS}.self_attn.q_proj.lora_A.weight": a,
            f"base_model.model.model.layers.{TINY_LAYERS}.self_attn.q_proj.lora_B.weight": b}),
    ]


def test_broken_lora_adapters(gen_http, tmp_path) -> None:
    """Runtime LoRA loading of adapters broken every way a file can be: each load is a 200 or a 400 saying why;
    an adapter that loads (non-finite or huge weights are numbers all the same) then serves requests, greedy and
    sampled, with logprobs, streamed, as 2xx or 4xx, and the engine lives on."""
    loaded = []
    for path in _bad_adapters(tmp_path):
        name = Path(path).name
        status = check_answer(gen_http, "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if status == 200:
            loaded.append(name)
            for extra in ({"temperature": 0}, {"temperature": 1.0, "logprobs": 2, "seed": 1},
                          {"stream": True, "top_p": 0.5, "top_k": 5, "min_p": 0.1},
                          {"structured_outputs": {"regex": "[ab]+"}}, {"n": 2, "repetition_penalty": 1.5}):
                body = {"model": name, "prompt": "The quick brown", "max_tokens": 4, **extra}
                check_answer(gen_http, "POST", "/v1/completions", json=body)
            check_answer(gen_http, "POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        assert gen_http.get("/health").status_code == 200, (name, status)
    assert _greedy(gen_http, MODEL) == gen_http.reference


@pytest.mark.parametrize(("case", "words"), [
    ("nan", "NaN or infinite weights"), ("inf", "NaN or infinite weights"), ("fp16_inf", "NaN or infinite weights"),
    ("alpha_nan", "not a finite scaling"), ("alpha_huge", "not a finite scaling"),
    ("targets_int", "target_modules must be"), ("config_bad_utf8", "cannot read"), ("empty_rank", "rank-r pair"),
])
def test_lora_loader_refusals(tmp_path, case, words) -> None:
    """The adapters the sweep above found loaded (NaN weights: a 500 later) or refused in Python's words."""
    from tokenloom.lora.peft_loader import LoRAError, load_peft_adapter

    path = next(p for p in _bad_adapters(tmp_path) if Path(p).name == case)
    shapes = {"q_proj": (TINY_HIDDEN, TINY_HIDDEN), "k_proj": (TINY_HIDDEN, TINY_HIDDEN // 2)}
    with pytest.raises(LoRAError, match=words) as exc:
        load_peft_adapter(path, 1, case, num_layers=TINY_LAYERS, target_shapes=shapes, max_lora_rank=8)
    assert not UNCLEAR.search(str(exc.value))


def test_bodies_must_be_utf8(gen_http) -> None:
    """JSON in UTF-16 (or five NUL bytes, which json.loads took for UTF-32) is refused as not UTF-8."""
    for raw, words in ((json.dumps({"model": MODEL, "prompt": "hi"}).encode("utf-16"), "not valid UTF-8"),
                       (b"\x00" * 5, "not valid JSON: Expecting value")):
        r = gen_http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_grammar_that_matches_nothing_is_400(gen_http) -> None:
    """A rule that only refers to itself parses, but allows no first token: the request's first sample was
    refused by its own grammar after queueing (a 500 then; a grammar that dead-ends later is a 400 at that point:
    tests/test_structured_server.py)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4,
            "structured_outputs": {"grammar": 'root ::= a\na ::= a "x"'}}
    r = gen_http.post("/v1/completions", json=body)
    assert r.status_code == 400 and "matches no text" in r.json()["error"]["message"], r.text
    body["structured_outputs"] = {"grammar": 'root ::= "" | "x"'}  # the empty text is some text
    assert gen_http.post("/v1/completions", json=body).status_code == 200


# Found by benchmarks/serving/fuzz_requests.py (docs/reliability.md, "The request fuzzer"): one request each.
_HALF_PAIR_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MSGS, "tools": [TOOL], "max_tokens": 96}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 96, "tools": [{"type": "function", "name": "get_weather",
                                                                       "parameters": {"type": "object"}}]}),
])
def test_tool_arguments_escaping_half_a_surrogate_pair_are_served(gen_http, path, body) -> None:
    """A model may write the JSON escape of half a UTF-16 pair in a tool call's arguments (here the grammar makes
    it); the tool parser reads it into text that UTF-8 cannot encode, and rendering the whole answer raised
    UnicodeEncodeError: a valid request's generation lost in a 400 in Python's words (vLLM: a 500). The answer now
    writes it back as the same JSON escape."""
    r = gen_http.post(path, json={"model": MODEL, **body, "structured_outputs": {"choice": [_HALF_PAIR_CALL]}})
    assert r.status_code == 200, r.text
    out = r.json()
    call = out["choices"][0]["message"]["tool_calls"][0]["function"] if "choices" in out else out["output"][0]
    assert json.loads(call["arguments"]) == {"city": "\ud800"}, r.text


def test_every_json_writer_escapes_half_a_surrogate_pair() -> None:
    """The same text through the server's other writers: SSE chunks, whole answers and the Responses stream's events
    (a tool parser that re-serializes streamed arguments, phi4_mini_json's, put one there: Starlette's UTF-8 encoding
    of the event raised mid-stream and the connection dropped without [DONE])."""
    from tokenloom.server.responses import JSONResponse, sse
    from tokenloom.server.serving_responses import _EventWriter

    event = {"type": "response.function_call_arguments.done", "arguments": '{"city": "\ud800"}'}
    for text in (sse(dict(event)), JSONResponse(dict(event)).body.decode(), _EventWriter()(dict(event))):
        assert json.loads(text.split("data: ", 1)[-1])["arguments"] == event["arguments"], text
        text.encode("utf-8")


def test_a_batch_chat_whose_grammar_dead_ends_is_400(gen_http) -> None:
    """allowed_token_ids that the grammar allows none of: the engine ends each conversation with its error. The batch
    endpoint read that error from the completion instead of the request: an AttributeError, a 500 that also reset
    the connection. Now the batch fails as one chat does, with the grammar's 400."""
    body = {"model": MODEL, "messages": [MSGS, MSGS], "max_tokens": 4, "structured_outputs": {"choice": ["yes"]},
            "allowed_token_ids": [2]}
    r = gen_http.post("/v1/chat/completions/batch", json=body)
    assert r.status_code == 400 and "grammar" in r.json()["error"]["message"], r.text


def test_n_with_the_largest_seed_is_served(gen_http) -> None:
    """seed 2**63 - 1 (the largest the API takes) with n > 1: the children's seeds (vLLM's seed + index) went past
    64 bits and SamplingParams refused them, a 400 from the fallback handler for a valid request (found by the
    request fuzzer's `combined` kind). They wrap now."""
    for path, body in (("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", {"messages": MSGS})):
        r = gen_http.post(path, json={"model": MODEL, **body, "max_tokens": 2, "n": 3, "seed": 2**63 - 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text


def test_malformed_requests_beside_running_ones_lose_nothing(gen_http) -> None:
    """Bad requests arriving while good ones run (a stream and a batch of plain requests): the good ones finish
    with the tokens they get alone, each bad one gets its 4xx."""
    import concurrent.futures

    good = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}

    def tokens(body: dict[str, Any]) -> list[int]:
        r = gen_http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def streamed() -> str:
        with gen_http.stream("POST", "/v1/completions", json={**good, "stream": True}) as r:
            assert r.status_code == 200
            return "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))

    alone = tokens(good)
    text_alone = gen_http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    bad = [(path, {**base, field: values[0]}) for path, (base, hostile) in ENDPOINTS.items()
           for field, values in hostile.items() if path in ("/v1/completions", "/v1/chat/completions")]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        runs = [pool.submit(tokens, good) for _ in range(3)]
        stream = pool.submit(streamed)
        statuses = [check_answer(gen_http, "POST", path, content=json.dumps(body), headers=JSON) for path, body in bad]
        assert all(run.result(timeout=CLIENT_TIMEOUT_S) == alone for run in runs)
        assert stream.result(timeout=CLIENT_TIMEOUT_S) == text_alone
    assert statuses.count(400) > len(bad) // 2, statuses


def test_servers_still_serve_the_same_after_the_sweep(gen_server, pool_server, gen_http, pool_http) -> None:
    """Last in the module, after every sweep above: the same greedy tokens, a healthy engine; the leak check that
    follows this test finds no request running and no KV block held in either server."""
    assert _greedy(gen_http, MODEL) == gen_http.reference
    assert gen_http.get("/health").status_code == 200 and pool_http.get("/health").status_code == 200
    r = pool_http.post("/v1/embeddings", json={"model": "emb", "input": ["a cat"]})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 32, r.text
    # Every refusal above came from a check that meant it: none from the handlers that turn an exception the
    # code did not foresee (a TypeError deep in the tokenizer, a ValueError rendering JSON) into a 400 or 500,
    # whatever the message says. They log each one (tokenloom/server/app.py).
    for server in (gen_server, pool_server):
        escaped = [line for line in server.log_path.read_text(errors="replace").splitlines()
                   if FALLBACK_LOG.search(line)]
        assert not escaped, "exceptions escaped to the fallback handlers:\n" + "\n".join(escaped[:20])
