"""Fuzz a live `tokenloom serve` with malformed and adversarial requests, then prove it still serves.

Not part of `make test` (tests/test_malformed_sweep.py is the short, fixed sweep that is). This one starts
the default model (SmolLM2-135M-Instruct, GGUF, a small --max-model-len) in one or more of these
configurations (CONFIGS; --configs, `plain,spec` by default):

- `plain`: the defaults;
- `spec`: n-gram speculative decoding + --async-scheduling + --enable-auto-tool-choice --tool-call-parser
  hermes; `spec-sync`: the drafts without async scheduling;
- `reasoning`: --reasoning-parser qwen3 (its tags are text to SmolLM2) with the hermes tool parser, and the
  tests' ScriptedOutput logits processor, which makes the model write the reasoning markup a request lists;
- `lora`: --enable-lora with three adapters written from the model's shapes, two slots, runtime loading on;
- `dp`: --data-parallel-size 2, the router's accounting checked after every batch;

and sends every endpoint (/v1/completions, /v1/chat/completions, /v1/chat/completions/batch, /v1/responses
and its GET / cancel, /invocations, /tokenize, /detokenize, /v1/models, the pooling routes a generation
model refuses, the probes) bodies made by hypothesis: wrong types for every field, boundary numbers (0, -1,
ints past int64, NaN / inf as strings, floats where ints go), huge / empty / deeply nested / broken-unicode
strings and arrays, token ids out of vocabulary, prompts longer than the context, contradictory fields (n vs
best_of, stop lists, logprobs limits, response_format with tools, structured outputs with invalid or
explosive schemas / regexes / grammars), invalid JSON, wrong content types, and clients that leave: mid-body,
mid-wait, mid-stream. Each configuration adds kinds of its own to the mix (CONFIG_KINDS): `sampling`
(valid, edge and hostile sampling fields together on prompts the drafter copies), `reasoning` (chat and
Responses asking for reasoning, with tools, structured outputs, budgets, streams, scripted markup), `lora`
(adapters that are, are not or cannot be names; n > 1, logprobs, beam search; runtime loads of good and
broken adapters, unloads while requests run). Each batch is sent --concurrency at a time beside a canary
(a greedy stream).

Every answer must be a 2xx, or a 4xx with vLLM's error body ({"error": {"message", "type", "param", "code"}},
code = status, a message in words, not Python's); never a 5xx, a dropped connection or a hang; a 200 stream
ends with [DONE] and carries no 5xx error event. After each batch: the server process lives, /health is 200,
a greedy request alone gives the tokens it gave before the fuzz, /metrics shows 0 running, 0 waiting and every
KV block free, /load is 0 (no handler stuck), and the server log shows no exception that reached the fallback
handlers (tokenloom/server/app.py logs each: a check can be right about the status by accident); with data
parallelism each engine alive, idle and with nothing left in the router's count of what it sent there; with
LoRA, adapter a1 alone still gives its own greedy tokens.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serving/fuzz_requests.py                      # both, ~10 min
    PYTHONPATH=$PWD .venv/bin/python benchmarks/serving/fuzz_requests.py --configs spec --batches 5 --seed 3
    PYTHONPATH=$PWD .venv/bin/python benchmarks/serving/fuzz_requests.py --json fuzz.json    # every failure
    PYTHONPATH=$PWD .venv/bin/python benchmarks/serving/fuzz_requests.py --configs reasoning,lora,dp,spec-sync

Failures are grouped by what failed, where and the first words of the answer; each group keeps its first
request, to replay with curl. Exit status 0 when nothing failed. docs/reliability.md ("The request fuzzer")
says what it found.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import re
import shlex
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # tests.test_server_harness lives in the repository
    sys.path.insert(0, str(ROOT))

from tests.test_server_harness import ServerProcess, metric  # noqa: E402

MAX_LEN = 256  # small, so prompts past the context and max_tokens at its edge are cheap
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "spec": ["--speculative-config", SPEC, "--async-scheduling", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"],
    # n-gram drafts without async scheduling: the synchronous rejection path, under the `sampling` kind
    "spec-sync": ["--speculative-config", SPEC],
    # qwen3's tags are text on SmolLM2 (no <think> token): the parser's text path. ScriptedOutput (a logits
    # processor of the tests) makes the model write what a request's vllm_xargs "script" lists, so the parser
    # reads hostile reasoning markup; logits processors are refused with speculative decoding, so not in `spec`.
    "reasoning": ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--logits-processors", "tests.reasoning_models:ScriptedOutput"],
    # the same on the tests' tiny random Qwen3 (tests/reasoning_models.py), whose <think>, </think>, <tool_call>
    # are tokens: the parser's token path, and the structured-output gate that starts a grammar after </think>
    # (with text tags the reasoning never ends for the engine, so a grammar never starts while it is wanted)
    "reasoning-tiny": ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--logits-processors", "tests.reasoning_models:ScriptedOutput", "--dtype", "float32"],
    # three adapters written at start (lora_setup), two slots: a batch mixes more adapters than a step holds;
    # runtime loading on (VLLM_ALLOW_RUNTIME_LORA_UPDATING), so /v1/load_lora_adapter and unload are fuzzed too
    "lora": ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"],
    # two engine processes behind the router: its accounting is checked after every batch (wait_idle)
    "dp": ["--data-parallel-size", "2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    # both: the router sends an adapter's requests to the engine that holds it (its per-engine adapter LRU)
    "dp-lora": ["--data-parallel-size", "2", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"],
}
CONFIG_ENV: dict[str, dict[str, str]] = {name: {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
                                          for name in ("lora", "dp-lora")}
# The tiny model's tokenizer makes a tools prompt ~500 tokens: its context must hold one.
CONFIG_MAX_LEN: dict[str, int] = {"reasoning-tiny": 1024}
COMMON_ARGS = ["--max-model-len", str(MAX_LEN), "--uvicorn-log-level", "info", "--disable-uvicorn-access-log",
               "--disable-log-stats", "--enable-tokenizer-info-endpoint"]
CLIENT_TIMEOUT_S = 180.0  # a hang, not a slow answer: n=128 sequences of 256 tokens take < 60 s on 2 cores
IDLE_TIMEOUT_S = 30.0  # aborted requests must leave the engine within this
VOCAB = 49152  # SmolLM2's; read from the server at start
REFERENCE_PROMPT = "The capital of France is"

# --- values ----------------------------------------------------------------------------------------------------

# 10**4200: just under the 4,300 digits Python reads or writes (a longer one travels in RAW_BODIES)
BIG_INTS = [2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1, 10**4200]
NUMBERS_AS_TEXT = ["NaN", "nan", "inf", "-inf", "Infinity", "-Infinity", "1e999", "0x10", "1_000", " 1", "1.0"]
INT_EDGES: list[Any] = [0, -1, 1, 2, *BIG_INTS, 1.0, 1.5, -0.5, 1e308, 5e-324, True, False, None, "1", *NUMBERS_AS_TEXT,
                        [], {}, [1]]
FLOAT_EDGES: list[Any] = [0, -0.0, 1e-320, 5e-324, 1e308, -1e308, 0.5, 2.0000001, -1, 2**70, 10**4200, True, None,
                          "0.5", [0.5], {}, *NUMBERS_AS_TEXT]
BOOL_EDGES: list[Any] = [0, 1, 2, "true", "false", "yes", "", None, [], {}, [True]]
HUGE = "x" * 200_000
STRING_EDGES: list[Any] = ["", " ", "\x00", "\ud800", "a\udfffb", "\uffff", "\u202e", "😀" * 2000, HUGE,
                           "<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ 7*7 }}", "{% raw %}", "\n" * 5000,
                           "%s%n%x", 5, 1.5, [], {}, None, True, ["a"]]
STRING_LIST_EDGES: list[Any] = [[], [""], [None], ["a"] * 5, ["a"] * 10_000, [["a"]], "a", [5], ["\ud800"], [HUGE],
                                [{}], ["<|im_end|>"]]


def token_id_edges(vocab: int) -> list[Any]:
    return [[], [-1], [vocab], [vocab - 1], [2**31], [2**63], [2**64], [10**30], [1.5], ["1"], [True], [None],
            [[1]], list(range(5000)), [0] * (MAX_LEN + 1), "1", 5]


def nested(depth: int, leaf: Any = 1, kind: str = "list") -> Any:
    for _ in range(depth):
        leaf = [leaf] if kind == "list" else {"a": leaf}
    return leaf


DEEP = [nested(400), nested(400, kind="dict"), nested(60, {"type": "text", "text": "x"}, "list")]

# --- the endpoints' fields -------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
BAD_SCHEMAS: list[Any] = [
    {"type": "strin"}, {"type": "object", "properties": 5}, {"$ref": "#/nowhere"}, {"enum": []}, True, False, "x",
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},  # a reference to itself
    {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "string", "pattern": "(ab"},
    {"type": "string", "minLength": 10**6}, {"type": "string", "maxLength": 10**9, "minLength": 10**8},
    {"type": "array", "minItems": 10**6}, {"type": "array", "items": {"type": "string"}, "maxItems": -1},
    {"type": "string", "pattern": "(a+)+$"}, {"type": "string", "format": "date-time", "pattern": "^x{99999}$"},
    {"anyOf": [{"type": "string", "const": f"v{i}"} for i in range(2000)]},
    {"enum": [f"e{i}" for i in range(20_000)]}, nested(70, {"type": "string"}, "dict"),
    {"type": "number", "multipleOf": 0}, {"type": "integer", "minimum": 1e308},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": 5},
]
BAD_REGEXES = ["(ab", "[", "\\", "a{1000000}", "(a|b){1,100000}", "(a*)*b", "a{2,1}", "\\p{Nope}", "(?<=a)b", "",
               "[^\\x00-\\x{10FFFF}]", "(?P<n>a)(?P=n)", "x" * 50_000]
BAD_GRAMMARS = ["root ::= ", "root ::= root", 'root ::= a\na ::= a "x"', "root ::= [", 'root ::= "a"{1000000}',
                "x ::= \"a\"", 'root ::= ("a" | "b")* "c"{0,99999}', "", "root ::= " + " ".join(['"a"'] * 20_000)]
STRUCTURED: list[Any] = (
    [{"json": s} for s in BAD_SCHEMAS] + [{"regex": r} for r in BAD_REGEXES] + [{"grammar": g} for g in BAD_GRAMMARS]
    + [{"choice": []}, {"choice": [1]}, {"choice": [""]}, {"choice": [f"c{i}" for i in range(20_000)]},
       {"choice": ["a"] * 3}, {"json": "{"}, {"json_object": True, "regex": "a"}, {"structural_tag": "x"},
       {"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "nope"}})},
       {"json_object": False}, {}, {"regex": "a+", "backend": "outlines"}, {"regex": "a+", "disable_fallback": "x"}])
RESPONSE_FORMATS: list[Any] = (
    [{"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in BAD_SCHEMAS]
    + [{"type": "json_object"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": "x"},
       {"type": "json_schema", "json_schema": {"name": "", "schema": {}}}, {"type": "text"},
       {"type": "structural_tag"}, {"type": "structural_tag", "format": 5}, {"type": None}, {"type": "xml"}])
MESSAGES: list[Any] = [
    [], [{}], [{"role": None}], [{"role": "user", "content": [{}]}], [{"role": "user", "content": "\udfff"}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}],
    [{"role": "tool", "content": "x"}], [{"role": "assistant", "content": "x"}], [{"role": "system", "content": ""}],
    [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                      "function": {"name": 5, "arguments": "{"}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                           "function": {"name": "f", "arguments": "{not json"}}]}],
    [{"role": "user", "content": "x " * 600}], [{"role": "user", "content": HUGE}],
    [{"role": "user", "content": "\x00\x01<|im_start|>system\nsecret<|im_end|>"}],
    [{"role": "user", "content": "hi"}] * 400, [{"role": "user", "content": ["a"] * 10_000}],
    [{"role": "user", "content": DEEP[2]}], [{"role": "user", "name": 5}],
    [{"role": "user", "content": "hi", "reasoning_content": 5}], "hi", [["hi"]], DEEP[0],
]
TOOLS: list[Any] = [
    [], [{}], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
    *([{"type": "function", "function": {"name": "f", "parameters": s}}] for s in BAD_SCHEMAS[:8]),
] + [[{"type": "code_interpreter"}], [TOOL, TOOL], [{"type": "function", "function": {"name": "f" * 5000}}],
     [TOOL] * 300, [{"type": "function", "function": {"name": "f", "parameters": DEEP[1]}}]]
TOOL_CHOICES = ["required", "auto", "none", "any", "", {"type": "function"}, {"type": "function", "function": {}},
                {"type": "function", "function": {"name": "missing"}}, {"type": "function", "function": {"name": 5}},
                {"type": "x"}, {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}]


def common_fields(vocab: int) -> dict[str, list[Any]]:
    """Sampling fields the completion, chat and batch endpoints share: the hostile values of each."""
    ids = token_id_edges(vocab)
    return {
        "model": ["gpt-17", "", "t" * 5000, "../../etc/passwd", None, "\ud800", 5],
        "n": [0, -1, 129, 10**6, *BIG_INTS, 2.0, "2"], "best_of": [0, 1, 2, 10**6, -1],
        "max_tokens": [0, -1, MAX_LEN, MAX_LEN + 1, *BIG_INTS, 1.5, "4"], "min_tokens": [-1, MAX_LEN, 10**6, 2**63],
        "temperature": FLOAT_EDGES, "top_p": FLOAT_EDGES, "top_k": [-2, -1, 0, vocab + 1, *BIG_INTS, 1.5],
        "min_p": FLOAT_EDGES, "seed": [-(2**63) - 1, 2**64, -2, -1, 2**63, 1.5],
        "presence_penalty": FLOAT_EDGES, "frequency_penalty": FLOAT_EDGES, "repetition_penalty": FLOAT_EDGES,
        "length_penalty": FLOAT_EDGES, "priority": [2**63, -(2**63) - 1, 10**30, 5, -5, "1"],
        "stop": STRING_LIST_EDGES + [[f"s{i}" for i in range(4)], "\n", HUGE],
        "stop_token_ids": ids, "allowed_token_ids": ids, "logprob_token_ids": ids,
        "bad_words": STRING_LIST_EDGES + [["hello"], [" "]],
        "logit_bias": [{"1": "x"}, {"-1": 1}, {str(vocab): 1}, {"1": 1e308}, {"1": -1e308}, {" 1 ": 1}, {"1.5": 1},
                       {"0x1": 1}, {"１": 1}, {"": 1}, {"9" * 5000: 1}, {"1": None}, [1, 2], "x",
                       {str(i): -100 for i in range(vocab)}],
        "stream": [True, "true", 1, None], "stream_options": [{"include_usage": "x"}, {"continuous_usage_stats": True},
                                                             {"include_usage": True, "continuous_usage_stats": True},
                                                             "x", None],
        "prompt_logprobs": [-1, -2, 0, 1, 20, 21, 2**31, True],
        "truncate_prompt_tokens": [-2, -1, 0, 1, MAX_LEN + 1, 2**63],
        "use_beam_search": [True, "yes"], "ignore_eos": BOOL_EDGES, "skip_special_tokens": BOOL_EDGES,
        "include_stop_str_in_output": BOOL_EDGES, "return_token_ids": BOOL_EDGES, "echo": BOOL_EDGES,
        "spaces_between_special_tokens": BOOL_EDGES, "return_tokens_as_token_ids": BOOL_EDGES,
        "structured_outputs": STRUCTURED, "guided_json": BAD_SCHEMAS, "guided_regex": BAD_REGEXES,
        "guided_choice": [[], [None], "a", [f"c{i}" for i in range(5000)]], "guided_grammar": BAD_GRAMMARS,
        "response_format": RESPONSE_FORMATS,
        "kv_transfer_params": [{"do_remote_prefill": True}, {"do_remote_decode": True, "remote_block_ids": "x"}, 5],
        "vllm_xargs": [{"a": 2**64}, {"a": [1]}, {"a": {"b": 1}}, "x", {"": None}],
        "repetition_detection": [{"max_pattern_size": 0}, {"max_pattern_size": 2**63, "min_count": 2}, "x",
                                 {"max_pattern_size": 3, "min_count": 2, "min_pattern_size": -1}],
        "thinking_token_budget": [-2, 0, 5, 2**63, 1.5], "request_id": ["", "x" * 5000, 5, "\ud800"],
        "cache_salt": ["", 5, "x" * 5000], "user": [5, HUGE], "logits_processors": [["x"], "x"],
        "bad_field": [1], "extra_body": [{"a": 1}],
    }


def endpoints(vocab: int) -> dict[str, tuple[dict[str, Any], dict[str, list[Any]]]]:
    """path -> (a valid body, the hostile values of each field)."""
    common = common_fields(vocab)
    prompts = ["", "x " * 400, [vocab], [-1], [2**63], [[1], []], [[]], [[1], ["a"]], ["a", 1], [True], [None],
               list(range(1, MAX_LEN + 2)), ["a"] * 1025, ["a"] * 200, "\x00", {"a": 1}, HUGE, DEEP[0], "😀" * 300]
    completion = {**common, "prompt": prompts, "logprobs": [-1, 0, 5, 20, 21, 2**31, True, 1.5], "echo": BOOL_EDGES,
                  "suffix": ["", "x", None, 5], "prompt_embeds": ["", "AAAA", ["AAAA"], 5]}
    chat = {**common, "messages": MESSAGES, "tools": TOOLS, "tool_choice": TOOL_CHOICES,
            "logprobs": [True, "true", 1, 5], "top_logprobs": [-1, 0, 20, 21, 2**31, True, 1.5],
            "max_completion_tokens": [0, -1, 2**31, MAX_LEN + 1], "parallel_tool_calls": BOOL_EDGES,
            "chat_template_kwargs": [{"add_generation_prompt": "x"}, {"tools": 5}, {"messages": 5},
                                     {"enable_thinking": 5}, "x", {"chat_template": "{{ x }}"}],
            "chat_template": ["{{ 'X' }}", "{% for %}", 5], "continue_final_message": BOOL_EDGES,
            "add_generation_prompt": BOOL_EDGES, "documents": [[{"a": 1}], [{"title": None}], "x"],
            "reasoning_effort": ["max", "huge", 5, None], "include_reasoning": BOOL_EDGES,
            "functions": [[{"name": "f"}]], "function_call": ["auto"], "mm_processor_kwargs": [{"a": 1}]}
    responses = {
        **{k: common[k] for k in ("model", "temperature", "top_p", "top_k", "seed", "stop", "priority", "logit_bias",
                                  "stream", "repetition_penalty", "structured_outputs", "min_p", "presence_penalty",
                                  "stop_token_ids", "request_id")},
        "input": ["", "\ud800", [], [{}], [{"type": "message"}], [{"role": "user", "content": 5}],
                  [{"type": "message", "role": "robot", "content": "x"}], [{"type": "function_call"}],
                  [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
                  [{"type": "function_call_output", "output": 5}], [{"type": "function_call_output", "call_id": "x",
                                                                     "output": "y"}],
                  [{"type": "reasoning", "encrypted_content": "x"}], [{"type": "reasoning", "summary": 5}],
                  [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                  [{"role": "user", "content": [{"type": "input_file"}]}],
                  [{"type": "item_reference", "id": "x"}], "x " * 600, HUGE, DEEP[0], 5, None],
        "max_output_tokens": [0, -1, 2**31, MAX_LEN + 1, 1.5], "instructions": ["", HUGE, 5, None],
        "text": [{"format": 5}, {"format": {"type": "json_schema"}}, {"format": {"type": "json_schema", "schema": 5}},
                 *({"format": {"type": "json_schema", "name": "x", "schema": s}} for s in BAD_SCHEMAS[:12]),
                 {"verbosity": "low"}, {"format": {"type": "xml"}}, {"x": 1}, "x"],
        "tools": [[{}], [{"type": "function"}], [{"type": "function", "name": 5}], [{"type": "web_search"}],
                  [{"type": "mcp", "server_label": "x"}], [{"type": "function", "name": "f", "parameters": DEEP[1]}],
                  [{"type": "function", "name": "f", "parameters": {"type": "strin"}}], "x"],
        "tool_choice": ["required", "none", {"type": "function", "name": "missing"}, {"type": "x"}, "bogus", 5],
        "previous_response_id": ["resp_missing", "", "x" * 5000, 5, "\ud800"], "include": [["nothing"], [5], "x"],
        "top_logprobs": [-1, 21, 2**31, 1.5], "truncation": ["auto", "x", 5], "store": BOOL_EDGES,
        "reasoning": [{"effort": "huge"}, {"effort": None}, "x", {"summary": 5}], "metadata": [{"a": 5}, {"a": HUGE}],
        "background": [True, "x"], "parallel_tool_calls": BOOL_EDGES, "max_tool_calls": [-1, 0, 2**63],
        "enable_response_messages": [True, "x"], "prompt": [{"id": "x"}], "service_tier": ["flex", 5],
    }
    batch_messages = [[[]], [MSGS, []], ["x"], [[{}]], MSGS, [MSGS] * 600, [], "x", [MSGS, DEEP[0]]]
    return {
        "/v1/completions": ({"model": "{model}", "prompt": "The capital of France is", "max_tokens": 4}, completion),
        "/v1/chat/completions": ({"model": "{model}", "messages": MSGS, "max_tokens": 4}, chat),
        "/v1/chat/completions#tools": ({"model": "{model}", "messages": MSGS, "max_tokens": 8, "tools": [TOOL],
                                        "tool_choice": "auto"}, chat),
        "/v1/chat/completions/batch": ({"model": "{model}", "messages": [MSGS, MSGS], "max_tokens": 4},
                                       {**chat, "messages": batch_messages}),
        "/v1/responses": ({"model": "{model}", "input": "What is 2+2?", "max_output_tokens": 4}, responses),
        "/invocations": ({"model": "{model}", "prompt": "hello", "max_tokens": 3}, {**completion, **chat}),
        "/tokenize": ({"model": "{model}", "prompt": "hello"},
                      {"model": common["model"], "prompt": prompts, "messages": MESSAGES, "tools": TOOLS,
                       "add_special_tokens": BOOL_EDGES, "return_token_strs": BOOL_EDGES,
                       "add_generation_prompt": BOOL_EDGES, "continue_final_message": BOOL_EDGES,
                       "chat_template_kwargs": [{"tools": 5}, "x"], "chat_template": ["{{ 'X' }}"]}),
        "/detokenize": ({"model": "{model}", "tokens": [504, 3458]},
                        {"model": common["model"], "tokens": token_id_edges(vocab) + [[0] * 100_000]}),
        "/v1/embeddings": ({"model": "{model}", "input": "hello"},
                           {"input": ["", [], [1], [[1]], HUGE], "encoding_format": ["base64", "x"],
                            "dimensions": [0, -1, 8]}),
        "/pooling": ({"model": "{model}", "input": "hello"}, {"input": ["", [1]]}),
        "/classify": ({"model": "{model}", "input": "hello"}, {"input": ["", [1]]}),
        "/score": ({"model": "{model}", "text_1": "a", "text_2": "b"}, {"text_1": ["", [], 5]}),
        "/rerank": ({"model": "{model}", "query": "a", "documents": ["b"]}, {"documents": [[], 5]}),
        "/v1/responses/{id}/cancel": ({}, {"x": [1]}),
        "/ping": ({}, {"x": [1]}),
    }


# Fields that contradict each other or push a limit together: one to three of these patches go on a valid body.
def contradictions(vocab: int) -> dict[str, list[dict[str, Any]]]:
    long_text = "hello " * (MAX_LEN - 8)
    shared = [
        {"n": 2, "best_of": 1}, {"n": 3, "best_of": 2}, {"best_of": 5, "stream": True}, {"n": 4, "temperature": 0},
        {"use_beam_search": True, "n": 4, "stream": True}, {"use_beam_search": True, "n": 3, "temperature": 1.5},
        {"use_beam_search": True, "n": 2, "structured_outputs": {"regex": "[ab]+"}},
        {"use_beam_search": True, "n": 2, "logprobs": 5}, {"min_tokens": 50, "max_tokens": 10},
        {"max_tokens": MAX_LEN}, {"min_tokens": MAX_LEN - 1, "max_tokens": MAX_LEN - 1, "ignore_eos": True},
        {"stop": ["a", "b", "c", "d"], "include_stop_str_in_output": True, "stream": True},
        {"stop": "\n", "stop_token_ids": [0, 1, 2], "ignore_eos": True},
        {"allowed_token_ids": [5], "bad_words": ["hello"]}, {"allowed_token_ids": [2], "min_tokens": 4},
        {"allowed_token_ids": [0], "min_tokens": 4, "ignore_eos": False}, {"allowed_token_ids": [vocab - 1]},
        {"allowed_token_ids": [7], "logit_bias": {"7": -100}}, {"logit_bias": {"0": 100, "2": 100}, "min_tokens": 3},
        {"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": [5]},
        {"structured_outputs": {"regex": "a{5}"}, "max_tokens": 1}, {"structured_outputs": {"regex": "a+"},
                                                                     "min_tokens": 20, "max_tokens": 24},
        {"structured_outputs": {"choice": ["x"]}, "bad_words": ["x"]},
        {"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, {"guided_json": {}, "guided_regex": "a"},
        {"response_format": {"type": "json_object"}, "tools": [TOOL], "tool_choice": "required"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
         "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"structured_outputs": {"regex": "a+"}, "tools": [TOOL], "tool_choice": "required"},
        {"tool_choice": "none", "tools": [TOOL], "response_format": {"type": "json_object"}},
        {"tools": [TOOL], "tool_choice": "required", "n": 3, "temperature": 1.0},
        {"tools": [TOOL], "tool_choice": "required", "stream": True, "max_tokens": 2},
        {"logprobs": 20, "n": 8, "stream": True, "temperature": 1.0}, {"prompt_logprobs": 20, "logprobs": 20},
        {"prompt_logprobs": 5, "stream": True}, {"prompt_logprobs": 5, "use_beam_search": True, "n": 2},
        {"temperature": 0, "seed": 5, "n": 2}, {"truncate_prompt_tokens": 10, "prompt": long_text * 2},
        {"truncate_prompt_tokens": -1, "prompt": long_text * 2}, {"prompt": long_text, "max_tokens": 64},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "n": 3,
         "temperature": 1.0},
        {"stream": False, "stream_options": {"include_usage": True}}, {"priority": 5},
        {"kv_transfer_params": {"do_remote_decode": True}}, {"thinking_token_budget": 3},
        {"repetition_detection": {"max_pattern_size": 2, "min_count": 2}, "allowed_token_ids": [5, 12],
         "max_tokens": 32, "temperature": 0},
        {"n": 64, "max_tokens": 16, "temperature": 1.0, "stream": True}, {"logprobs": 5, "echo": True, "max_tokens": 0},
        {"echo": True, "logprobs": 5, "prompt": [[1, 2], [3]]}, {"echo": True, "stream": True, "n": 2,
                                                                  "temperature": 1.0},
        {"max_tokens": 0, "echo": False}, {"suffix": "x", "echo": True},
        {"continue_final_message": True, "add_generation_prompt": True},
        {"continue_final_message": True, "messages": [*MSGS, {"role": "assistant", "content": "Paris"}]},
        {"continue_final_message": True, "messages": [{"role": "assistant", "content": ""}]},
        {"logprobs": True, "top_logprobs": 20, "n": 4, "temperature": 1.0, "stream": True},
        {"logprob_token_ids": [1, 2], "logprobs": True}, {"logprob_token_ids": [1, 2], "logprobs": 2},
    ]
    responses = [
        {"text": {"format": {"type": "json_object"}}, "tools": [{"type": "function", "name": "f"}],
         "tool_choice": "required"},
        {"previous_response_id": "resp_missing", "store": False}, {"background": True, "stream": True},
        {"background": True, "store": False}, {"stream": True, "max_output_tokens": 1, "top_logprobs": 5,
                                              "include": ["message.output_text.logprobs"]},
        {"tool_choice": {"type": "function", "name": "f"}, "tools": [{"type": "function", "name": "g"}]},
        {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
        {"structured_outputs": {"regex": "a"}, "text": {"format": {"type": "json_object"}}},
    ]
    return {"/v1/completions": shared, "/v1/chat/completions": shared, "/v1/chat/completions#tools": shared,
            "/v1/chat/completions/batch": shared, "/v1/responses": responses}


# Options that are each valid: several at once reach the engine's rarer paths together (logprobs with drafts,
# beam search with a grammar, echo with n > 1, a prompt at the context's edge), where a 500 hides.
VALID_OPTIONS: dict[str, list[Any]] = {
    "n": [1, 2, 5], "temperature": [0, 0.7, 2.0], "top_p": [0.01, 1.0], "top_k": [1, 5, -1], "min_p": [0.0, 0.9],
    "seed": [0, 2**63 - 1, -1], "max_tokens": [1, 16, 48], "min_tokens": [0, 8], "logprobs": [0, 1, 20],
    "prompt_logprobs": [0, 1, 20], "echo": [True], "stop": [[" "], ["."], ["e", "a", "the", "\n"]],
    "stop_token_ids": [[2], [0, 1, 2]], "include_stop_str_in_output": [True], "ignore_eos": [True],
    "skip_special_tokens": [False], "spaces_between_special_tokens": [False], "return_token_ids": [True],
    "return_tokens_as_token_ids": [True], "presence_penalty": [-2.0, 2.0], "frequency_penalty": [2.0],
    "repetition_penalty": [0.01, 5.0], "bad_words": [["the", " Paris"]], "logit_bias": [{"2": 100}, {"504": -100}],
    "allowed_token_ids": [[504, 3458, 2], list(range(100, 200))], "use_beam_search": [True],
    "length_penalty": [0.5], "truncate_prompt_tokens": [1, 4, -1], "priority": [0],
    "stream": [True], "stream_options": [{"include_usage": True, "continuous_usage_stats": True}],
    "structured_outputs": [{"regex": "[a-z ]{1,20}"}, {"choice": ["Paris", "Lyon"]}, {"json": {"type": "object"}},
                           {"grammar": 'root ::= "yes" | "no"'}, {"json_object": True},
                           {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}],
    "logprob_token_ids": [[1, 2, 3]], "repetition_detection": [{"max_pattern_size": 2, "min_count": 2}],
    "prompt": ["The capital of France is", "x " * (MAX_LEN - 20), [[1, 2, 3], [504, 3458]], ["a", "b", "c"],
               list(range(1, MAX_LEN - 1))],
    "messages": [MSGS, [{"role": "system", "content": "Be brief."}, *MSGS],
                 [*MSGS, {"role": "assistant", "content": "The capital"}]],
    "continue_final_message": [True], "add_generation_prompt": [False], "top_logprobs": [0, 20],
    "tools": [[TOOL]], "tool_choice": ["auto", "required", "none",
                                       {"type": "function", "function": {"name": "get_weather"}}],
    "response_format": [{"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}],
    "parallel_tool_calls": [False],
}
VALID_BASES = {
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 8},
    "/v1/chat/completions": {"messages": MSGS, "max_tokens": 8},
    "/v1/chat/completions/batch": {"messages": [MSGS, MSGS], "max_tokens": 8},
}
CHAT_ONLY = {"messages", "continue_final_message", "add_generation_prompt", "top_logprobs", "tools", "tool_choice",
             "response_format", "parallel_tool_calls"}
COMPLETION_ONLY = {"prompt", "echo", "prompt_logprobs"}

RAW_BODIES: list[bytes] = [
    b"", b"{", b"null", b"[]", b"1", b'"x"', b"{}", b'{"a": NaN}', b'{"max_tokens": Infinity}', b'{"top_p": -Infinity}',
    b'{"a": 1e999}', b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"[" * 50_000, b'{"a": ' * 50_000, b'{"prompt": "\\ud800"}',
    b'{"prompt": "a", "prompt": 5}', b'{"\\u0000": 1}', b'{"max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "hi"}\x00', b"\xef\xbb\xbf{}", b'{"prompt": "hi", "max_tokens": 2}' * 2, b" " * 100_000,
    b'{"messages": [' + b'{"role": "user", "content": "hi"},' * 2000 + b"]}",
]
CONTENT_TYPES = ["application/json", "application/json; charset=latin-1", "text/plain", "",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/JSON",
                 "application/json-patch+json", "application/json; charset=utf-16", "*/*"]
GET_PATHS = ["/v1/models", "/v1/models/{model}", "/v1/models/nope", "/v1/models/..%2F..", "/v1/responses/resp_x",
             "/v1/responses/" + "x" * 5000, "/tokenizer_info", "/load", "/version", "/ping", "/health", "/metrics",
             "/v1/models?limit=-1", "/v1/completions", "/v1/nothing"]

# --- cases -----------------------------------------------------------------------------------------------------


@dataclass
class Case:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    leave: str = ""  # "", "body" (mid-body), "wait" (before the answer), "stream" (after `after` events)
    after: int = 0
    stream: bool = False
    kind: str = ""  # the strategy that made it (KINDS), for the counts per configuration and kind

    def describe(self, limit: int = 3000) -> dict[str, Any]:
        body = None if self.body is None else self.body.decode("utf-8", "backslashreplace")
        if body is not None and len(body) > limit:
            body = body[:limit] + f"... ({len(self.body or b'')} bytes)"
        return {"kind": self.kind, "method": self.method, "path": self.path, "headers": self.headers,
                "leave": self.leave, "after": self.after, "body": body}


def _encode(obj: Any) -> bytes:
    """JSON as a client could send it: non-ASCII escaped (a lone surrogate travels as \\ud800)."""
    return json.dumps(obj).encode()


def _fill_model(obj: Any, model: str) -> Any:
    return {k: (model if v == "{model}" else v) for k, v in obj.items()}


@dataclass
class Target:
    """What the strategies draw from: the served model's name and the tables for its vocabulary; on the `lora`
    configuration its adapters' names and the adapter directories (good and bad) written for it; on the
    `reasoning` configuration the token ids of each REASONING_OUTPUTS text (empty: no ScriptedOutput)."""
    model: str
    vocab: int
    lora_names: tuple[str, ...] = ()
    adapter_dirs: dict[str, str] = field(default_factory=dict)
    scripts: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.table = endpoints(self.vocab)
        self.combos = contradictions(self.vocab)

    def __repr__(self) -> str:  # hypothesis prints the strategy's arguments: not the tables
        return f"Target({self.model!r}, vocab={self.vocab})"


@st.composite
def json_cases(draw: st.DrawFn, target: Target) -> Case:
    """A valid body with one to three fields garbled, or with contradicting fields, streamed or not."""
    table, combos, model = target.table, target.combos, target.model
    key = draw(st.sampled_from(sorted(table)))
    base, hostile = table[key]
    body = copy.deepcopy(_fill_model(base, model))
    if key in combos and draw(st.integers(0, 2)) == 0:
        for patch in draw(st.lists(st.sampled_from(combos[key]), min_size=1, max_size=2)):
            body.update(copy.deepcopy(patch))
    else:
        fields = sorted(set(hostile) | set(base))
        for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
            action = draw(st.sampled_from(["hostile", "hostile", "hostile", "any", "delete"]))
            if action == "delete":
                body.pop(name, None)
            elif action == "hostile" and hostile.get(name):
                body[name] = copy.deepcopy(draw(st.sampled_from(hostile[name])))
            else:  # the generic edges, whatever the field's type
                body[name] = draw(st.sampled_from(INT_EDGES + FLOAT_EDGES + BOOL_EDGES + STRING_EDGES + DEEP))
    if "stream" not in body and key not in ("/tokenize", "/detokenize") and draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    path = key.split("#")[0].replace("{id}", draw(st.sampled_from(["resp_x", "", "..", "x" * 300])))
    headers = {"Content-Type": "application/json", **draw(hostile_headers())}
    return Case("POST", path, _encode(body), headers=headers, stream=body.get("stream") is True)


# Request headers the server reads (X-Request-Id, vLLM's X-Vllm-Priority, the ORCA load report's format) or that
# change how the body travels, with values that have broken servers.
HEADER_VALUES = {
    "X-Request-Id": ["", " ", "x" * 8000, "\xff\xfe", "a,b", "../../x", "%00", "id\x7f"],
    "X-Vllm-Priority": ["", "1e3", "٣", " 5 ", "1_000", "-0", "9" * 5000, "0x10", str(2**63), "nan"],
    "endpoint-load-metrics-format": ["json", "TEXT", "xml", "", "json" * 1000],
    "Accept": ["text/event-stream", "application/xml", "*/*;q=0"],
    "Content-Encoding": ["gzip", "br", "identity"],
    "Authorization": ["Bearer", "Basic x", "Bearer " + "x" * 4000],
}


@st.composite
def hostile_headers(draw: st.DrawFn) -> dict[str, str]:
    """None most of the time, else one or two hostile request headers."""
    if draw(st.integers(0, 3)):
        return {}
    names = draw(st.lists(st.sampled_from(sorted(HEADER_VALUES)), min_size=1, max_size=2, unique=True))
    return {name: draw(st.sampled_from(HEADER_VALUES[name])) for name in names}


@st.composite
def combined_cases(draw: st.DrawFn, model: str) -> Case:
    """A valid request with two to six valid options drawn together."""
    path = draw(st.sampled_from(sorted(VALID_BASES)))
    chat = path != "/v1/completions"
    body: dict[str, Any] = {"model": model, **copy.deepcopy(VALID_BASES[path])}
    names = sorted(k for k in VALID_OPTIONS if k not in (COMPLETION_ONLY if chat else CHAT_ONLY))
    for name in draw(st.lists(st.sampled_from(names), min_size=2, max_size=6, unique=True)):
        body[name] = copy.deepcopy(draw(st.sampled_from(VALID_OPTIONS[name])))
    if chat and body.get("logprobs") is not None:
        body["logprobs"] = True
    if path.endswith("/batch") and "messages" in body and body["messages"] and isinstance(body["messages"][0], dict):
        body["messages"] = [body["messages"]]
    return Case("POST", path, _encode(body), stream=body.get("stream") is True)


# What a model may write where the server parses its output (tool calls here; the grammar makes the model write
# it): broken JSON, wrong types, escapes of half a UTF-16 pair, nested or unclosed tags, SSE lookalikes.
HOSTILE_OUTPUTS = [
    '<tool_call>{"name": 5}</tool_call>', "<tool_call>[1,2]</tool_call>", "<tool_call>null</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": 5}</tool_call>', "<tool_call>{</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": "x"}</tool_call>', '<tool_call>{"name": "get_weather"',
    '<tool_call><tool_call>{"name":"x"}</tool_call>', "</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    '<tool_call>{"name": null, "arguments": null}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "\\udfff\\ud83d"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": 1e999}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "\\u0000"}}</tool_call>',
    'x<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>y<tool_call>{"name": 1}</tool_call>',
    '"\\ud800"', "data: [DONE]\n\n", "<think>x</think>", '{"a": "\\ud800"}',
    # the other parsers' shapes (--server-args "--tool-call-parser NAME"): llama3_json, pythonic, qwen3_coder, phi4
    '{"name": "get_weather", "parameters": {"city": "\\ud800"}}', '{"name": 5, "parameters": []}',
    '{"name": "get_weather", "parameters": {"city": "x"}}; {"name": "get_weather"', "[get_weather(city='x'), 5]",
    '[get_weather(city="\\ud800")]', "[get_weather(city=x)]", "[get_weather(**{'city': 1})]", "[(lambda: 1)()]",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n\\ud800\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=nope>\n5\n</parameter>\n</function>",
    'functools[{"name": "get_weather", "arguments": {"city": "\\ud800"}}]', "functools[{]",
]


@st.composite
def forced_output_cases(draw: st.DrawFn, model: str) -> Case:
    """A valid request whose output the server parses, with the output forced to something hostile."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/responses"]))
    output = draw(st.sampled_from(HOSTILE_OUTPUTS))
    # No max_tokens: the tools' prompt takes most of the small context, and the choice ends the output anyway.
    body: dict[str, Any] = {"model": model, "structured_outputs": {"choice": [output]}, "stream": draw(st.booleans())}
    if path == "/v1/responses":
        body.update(input="hi", tools=[{"type": "function", "name": "get_weather",
                                        "parameters": TOOL["function"]["parameters"]}])
    else:
        body.update(messages=MSGS, tools=[TOOL], logprobs=draw(st.booleans()))
    return Case("POST", path, _encode(body), stream=body["stream"])


# Requests that pass every check and that the engine then ends with an error (a grammar allowing none of the allowed
# tokens): the handlers' rarely run error paths, on every generation endpoint, streamed or not.
DEAD_ENDS = [{"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": [5]},
             {"structured_outputs": {"regex": "[0-9]+"}, "allowed_token_ids": [504, 3458]},
             {"response_format": {"type": "json_object"}, "allowed_token_ids": [504]}]


@st.composite
def failing_cases(draw: st.DrawFn, model: str) -> Case:
    path = draw(st.sampled_from(sorted(VALID_BASES)))
    body: dict[str, Any] = {"model": model, **copy.deepcopy(VALID_BASES[path]), **draw(st.sampled_from(DEAD_ENDS))}
    if path == "/v1/completions":
        body.pop("response_format", None)
        body.setdefault("structured_outputs", {"json_object": True})
    extras = {"n": 2, "temperature": 1.0, "logprobs": True if path != "/v1/completions" else 2, "echo": True,
              "stream": True, "stream_options": {"include_usage": True}}
    for name in draw(st.lists(st.sampled_from(sorted(extras)), max_size=3, unique=True)):
        body[name] = extras[name]
    if path.endswith("/batch"):
        body.pop("stream", None)
        body.pop("n", None)
    return Case("POST", path, _encode(body), stream=body.get("stream") is True)


@st.composite
def raw_cases(draw: st.DrawFn, paths: list[str], model: str) -> Case:
    """Bytes that are not the JSON the route wants, or a right body under a wrong content type."""
    path = draw(st.sampled_from(paths))
    if draw(st.booleans()):
        raw = draw(st.sampled_from(RAW_BODIES) | st.binary(max_size=64))
        ctype = "application/json"
    else:
        raw = _encode({"model": model, "prompt": "hi", "messages": MSGS, "input": "hi", "max_tokens": 2})
        cut = draw(st.integers(0, 3))
        raw = raw[: len(raw) // 2] if cut == 0 else raw
        ctype = draw(st.sampled_from(CONTENT_TYPES))
    return Case("POST", path, raw, headers={"Content-Type": ctype} if ctype else {})


@st.composite
def leaving_cases(draw: st.DrawFn, model: str) -> Case:
    """Clients that go away: mid-body, before the answer, or after a few streamed events."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                 "/v1/chat/completions/batch"]))
    body: dict[str, Any] = {"model": model, "max_tokens": 64, "max_output_tokens": 64, "ignore_eos": True,
                            "temperature": draw(st.sampled_from([0, 1.0]))}
    body.update({"/v1/completions": {"prompt": "Once upon a time"}, "/v1/chat/completions": {"messages": MSGS},
                 "/v1/responses": {"input": "Tell me a story"},
                 "/v1/chat/completions/batch": {"messages": [MSGS, MSGS]}}[path])
    body.update(draw(st.sampled_from([{}, {"n": 3}, {"use_beam_search": True, "n": 2}, {"logprobs": 2},
                                      {"structured_outputs": {"regex": "[a-z ]+"}}, {"stream_options":
                                                                                     {"include_usage": True}},
                                      {"response_format": {"type": "json_object"}}, {"echo": True}])))
    leave = draw(st.sampled_from(["body", "wait", "stream", "stream"]))
    if leave == "stream":
        body["stream"] = True
    return Case("POST", path, _encode(body), leave=leave, after=draw(st.integers(0, 3)), stream=leave == "stream")


@st.composite
def get_cases(draw: st.DrawFn, model: str) -> Case:
    path = draw(st.sampled_from(GET_PATHS)).replace("{model}", model)
    method = draw(st.sampled_from(["GET"] * 6 + ["DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]))
    return Case(method, path, None, headers={})


# Sampling fields, valid and hostile values mixed several at a time: what the drafter, the rejection sampler and
# the logprobs of drafts see (the `sampling` kind, for the speculative configurations).
SAMPLING_FIELDS = ["n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
                   "logprobs", "prompt_logprobs", "stop", "stop_token_ids", "include_stop_str_in_output",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words", "logit_bias",
                   "allowed_token_ids", "structured_outputs", "ignore_eos", "stream", "stream_options", "echo",
                   "use_beam_search", "length_penalty", "logprob_token_ids", "repetition_detection",
                   "thinking_token_budget", "truncate_prompt_tokens", "skip_special_tokens", "return_token_ids",
                   "top_logprobs", "response_format"]
# Prompts whose continuation the n-gram drafter finds in them (drafts proposed, and some accepted).
COPY_PROMPTS = ["a b c d a b c d a b c d a b c", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
                "The cat sat on the mat. The cat sat on the mat. The cat sat on the", "x " * (MAX_LEN - 24)]
COPY_MESSAGES = [[{"role": "user", "content": "Repeat after me: " + p}] for p in COPY_PROMPTS[:3]]


# Valid values at the edges of their ranges: what reaches the rejection sampler (truncated or flattened
# distributions, forced tokens, penalties at their bounds) without a 400 first.
EDGE_SAMPLING: dict[str, list[Any]] = {
    "temperature": [1e-5, 0.01, 2.0], "top_p": [1e-9, 0.5], "top_k": [1, 2], "min_p": [0.99, 1.0],
    "presence_penalty": [-2.0, 2.0], "frequency_penalty": [-2.0, 2.0], "repetition_penalty": [1e-3, 100.0],
    "n": [3, 8], "max_tokens": [MAX_LEN - 40, 2], "min_tokens": [24], "seed": [0, 2**63 - 1],
    "logprobs": [20], "prompt_logprobs": [20, -1], "stop": [["a", "b", "c", "d"], [" c d a", "cat"]],
    "stop_token_ids": [[2, 0, 1]], "logit_bias": [{str(i): 100 for i in range(100, 164)}, {"330": -100, "253": 100}],
    "allowed_token_ids": [[253], [253, 330, 2]], "bad_words": [["a b", "c", " the cat"]],
    "repetition_detection": [{"max_pattern_size": 1, "min_count": 2}],
}


@st.composite
def sampling_cases(draw: st.DrawFn, target: Target) -> Case:
    """A completion or chat (batch too) with two to six sampling fields, two thirds of them valid (VALID_OPTIONS
    and EDGE_SAMPLING), the rest hostile, on a prompt the n-gram drafter copies from."""
    path = draw(st.sampled_from(sorted(VALID_BASES)))
    chat = path != "/v1/completions"
    batch = path.endswith("/batch")
    body: dict[str, Any] = {"model": target.model, **copy.deepcopy(VALID_BASES[path]), "max_tokens": 24}
    if chat:
        messages = draw(st.sampled_from(COPY_MESSAGES))
        body["messages"] = [messages, messages] if batch else messages
    else:
        body["prompt"] = draw(st.sampled_from(COPY_PROMPTS))
    hostile = common_fields(target.vocab)
    hostile.update(logprobs=[-1, 21, 2**31, 1.5] if not chat else [5, "true"], top_logprobs=[-1, 21, 2**31, 1.5],
                   response_format=RESPONSE_FORMATS)
    names = [n for n in SAMPLING_FIELDS if n not in (COMPLETION_ONLY if chat else CHAT_ONLY)]
    for name in draw(st.lists(st.sampled_from(names), min_size=2, max_size=6, unique=True)):
        valid = VALID_OPTIONS.get(name, []) + EDGE_SAMPLING.get(name, [])
        if valid and (draw(st.integers(0, 2)) < 2 or not hostile.get(name)):
            body[name] = copy.deepcopy(draw(st.sampled_from(valid)))
        elif hostile.get(name):
            body[name] = copy.deepcopy(draw(st.sampled_from(hostile[name])))
    # Pairs the API refuses before anything runs: made consistent, so the case reaches the engine.
    if "stream_options" in body:
        body.setdefault("stream", True)
    if "length_penalty" in body:
        body.setdefault("use_beam_search", True)
    if body.get("use_beam_search") is True:
        body.pop("stream", None)
        body.pop("stream_options", None)
    if ("logprob_token_ids" in body or "top_logprobs" in body) and chat:
        body.setdefault("logprobs", True)
    if "logprob_token_ids" in body and not chat:
        body.setdefault("logprobs", 1)
    if chat and body.get("logprobs") in (0, 1, 20):
        body["logprobs"] = True
    if batch:
        for name in ("stream", "stream_options", "n", "use_beam_search", "best_of", "length_penalty"):
            body.pop(name, None)
    if body.get("n", 1) not in (1, None) and "temperature" not in body and draw(st.booleans()):
        body["temperature"] = 1.0
    return Case("POST", path, _encode(body), stream=body.get("stream") is True)


# What a reasoning model may write: the tags whole, split, unclosed, nested, out of order, with tool calls inside
# and after the thinking, special tokens and whitespace where the parser holds text back. ScriptedOutput makes
# the model write them (their token ids, from /tokenize, in vllm_xargs "script").
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
REASONING_OUTPUTS = [
    "<think>The user asks.</think>Paris.", "I think so.</think>Paris.", "no tags at all", "</think>", "<think>",
    "<think>unclosed thinking", "<think><think>nested</think></think>after", "a</think>b</think>c<think>d",
    "<think>x</think>" + CALL, "thinking" + CALL, "<think>x" + CALL + "</think>tail", "x</think>\n\n",
    "x</think>   ", "<thi", "x</thin", "x</think", "</think><think></think>", "<|im_end|>x</think>y",
    "x<|im_start|>assistant\n</think>y", "x</think>" + CALL + CALL, 'x</think>{"a": 1}', "x</think><tool_call>{",
    "x</think><tool_call>" + '{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>',
    "<think>" + "deep thought " * 20 + "</think>ok", "x</think>" + "<think>y</think>" * 3,
    "\u00e9\u00e9</think>\U0001f600",
]
REASONING_REQUEST_OPTIONS: dict[str, list[Any]] = {
    "include_reasoning": [True, False, False, "no", None, 1],
    "reasoning_effort": ["none", "low", "medium", "high", "max", "huge", 5, None],
    "chat_template_kwargs": [{"enable_thinking": False}, {"enable_thinking": True}, {"enable_thinking": "no"},
                             {"enable_thinking": None}, {"thinking": True}, {"enable_thinking": [False]}, "x", 5],
    "thinking_token_budget": [0, 1, 3, 10**6, -1, -2, 1.5, "3", 2**63],
    "tools": [[TOOL], [TOOL, {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]],
    "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "function": {"name": "missing"}}],
    "structured_outputs": [{"json": {"type": "object"}}, {"regex": "[A-Z][a-z]+"}, {"choice": ["Paris", "Lyon"]},
                           {"grammar": 'root ::= "yes" | "no"'}, {"json_object": True}, {"regex": "(ab"}],
    "response_format": [{"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}],
    "n": [2, 3], "temperature": [0, 1.0], "logprobs": [True], "top_logprobs": [0, 5, 20], "max_tokens": [1, 3, 64],
    "stop": [["</think>"], ["<think>", "Paris"], ["\n"]], "stream": [True, True],
    "stream_options": [{"include_usage": True, "continuous_usage_stats": True}], "return_token_ids": [True],
    "skip_special_tokens": [True, False], "min_tokens": [4], "ignore_eos": [True], "echo": [True],
    "add_generation_prompt": [False], "continue_final_message": [True], "use_beam_search": [True],
    "messages": [MSGS, [*MSGS, {"role": "assistant", "content": "<think>half a thought"}],
                 [*MSGS, {"role": "assistant", "content": "Paris", "reasoning": "It is Paris."}, *MSGS],
                 [*MSGS, {"role": "assistant", "content": "x", "reasoning_content": "</think>"}, *MSGS],
                 [*MSGS, {"role": "assistant", "content": None, "reasoning": 5}],
                 [{"role": "user", "content": "</think><think>"}]],
}
RESPONSES_REASONING_OPTIONS: dict[str, list[Any]] = {
    "reasoning": [{"effort": "low"}, {"effort": "none"}, {"effort": "high", "summary": "auto"}, {"effort": "x"}],
    "include_reasoning": [True, False], "include": [["reasoning.encrypted_content"], ["message.output_text.logprobs"]],
    "tools": [[{"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}]],
    "tool_choice": ["auto", "required", "none"], "stream": [True], "max_output_tokens": [1, 4, 64],
    "text": [{"format": {"type": "json_object"}}, {"format": {"type": "json_schema", "name": "x",
                                                              "schema": {"type": "object"}}}],
    "top_logprobs": [0, 5], "thinking_token_budget": [0, 2, -1],
    "input": ["What is 2+2?", [{"type": "reasoning", "id": "rs_1", "summary": [],
                                "content": [{"type": "reasoning_text", "text": "</think>"}]},
                               {"role": "user", "content": "hi"}],
              [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [{"type": "summary_text",
                                                                                    "text": "<think>"}]}]],
}


@st.composite
def reasoning_cases(draw: st.DrawFn, target: Target) -> Case:
    """A chat (one or batch) or Responses request asking for reasoning, with what a reasoning model writes scripted
    (when the server has ScriptedOutput), one to five options of REASONING_REQUEST_OPTIONS."""
    path = draw(st.sampled_from(["/v1/chat/completions"] * 4 + ["/v1/chat/completions/batch", "/v1/responses"]))
    responses = path == "/v1/responses"
    options = RESPONSES_REASONING_OPTIONS if responses else REASONING_REQUEST_OPTIONS
    body: dict[str, Any] = ({"model": target.model, "input": "What is 2+2?", "max_output_tokens": 48} if responses
                            else {"model": target.model, "messages": MSGS, "max_tokens": 48})
    for name in draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=5, unique=True)):
        body[name] = copy.deepcopy(draw(st.sampled_from(options[name])))
    if body.get("n", 1) != 1 and body.get("temperature") == 0:
        body["temperature"] = 1.0
    # Pairs the API refuses before anything runs (tool_choice without tools, a stream's options without the
    # stream, continue_final_message with add_generation_prompt): mostly made consistent, to reach the parser.
    if draw(st.integers(0, 3)) < 3:
        if "tool_choice" in body:
            body.setdefault("tools", copy.deepcopy(options["tools"][0]))
        if "stream_options" in body:
            body["stream"] = True
        if body.get("continue_final_message") is True:
            body["add_generation_prompt"] = False
        if body.get("use_beam_search") is True:
            for name in ("stream", "stream_options", "thinking_token_budget", "tools", "tool_choice"):
                body.pop(name, None)
    if target.scripts and draw(st.integers(0, 4)) < 4:
        script = target.scripts[draw(st.sampled_from(sorted(target.scripts)))]
        xargs: dict[str, Any] = {"script": script}
        if draw(st.integers(0, 3)) == 3:
            xargs["free_after_script"] = 1  # (vllm_xargs values are strings, numbers or lists of them)
        body["vllm_xargs"] = xargs
    if path.endswith("/batch"):
        body["messages"] = [body["messages"], MSGS]
        body.pop("stream", None)
        body.pop("n", None)
    return Case("POST", path, _encode(body), stream=body.get("stream") is True)


# `model` values a LoRA server must tell apart: its adapters, the base, names that are not there or not names.
BAD_LORA_NAMES: list[Any] = ["missing", "", " ", "a1 ", " a1", "A1", "a1/../a2", "a1\x00", "\ud800", "a" * 5000,
                             "../../etc/passwd", "lora:a1", "a1,a2", "*", 5, None, ["a1"], {"name": "a1"}, True]
# Runtime loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING): names to load under and remove, including one served from
# the start (a3: unloaded while requests run on it, loaded again later) and the base model's own name.
RUNTIME_NAMES = ["d1", "d2", "a3"]
# lora_path values that are no adapter directory: names the OS refuses to look up (past NAME_MAX or PATH_MAX, a
# NUL, half a surrogate pair), missing, not directories, not strings. (Hypothesis draws a list's first entries
# most: the rarest paths of the server go first.)
BAD_LORA_PATHS: list[Any] = ["x" * 300, "a/" * 3000, "/tmp/\x00", "\ud800", "x" * 5000, "/nonexistent", "/",
                             "/etc/passwd", "/proc/self", ".", "", 5, None]
LOAD_NAMES: list[Any] = ["d1", "a3", "{model}", "", "x" * 5000, "\ud800", "d1/../a1", 5, None, [], {}]
UNLOAD_NAMES: list[Any] = ["d1", "d2", "a3", "{model}", "missing", "", 5, None, ["a3"]]


@st.composite
def lora_cases(draw: st.DrawFn, target: Target) -> Case:
    """Requests naming adapters that are served, not served or not names, mixed in a batch (the pool sends eight
    at once; two adapter slots), with n > 1, logprobs, echo, beam search, grammars, streams; and runtime loads /
    unloads of good and bad adapter directories."""
    if draw(st.integers(0, 2)) == 0:  # runtime loading and unloading
        if draw(st.integers(0, 2)) < 2:  # a load: names and paths drawn apart, so a bad path meets a good name
            name = draw(st.sampled_from(RUNTIME_NAMES if draw(st.integers(0, 3)) < 3 else LOAD_NAMES))
            good = [d for n, d in sorted(target.adapter_dirs.items()) if n in ("good", "a3", "huge")]
            broken = [d for n, d in sorted(target.adapter_dirs.items()) if n not in ("good", "a3", "huge")]
            which = draw(st.integers(0, 3))  # 0, 1: adapters that load; 2: broken ones; 3: paths with no adapter
            paths = (good if which < 2 else broken if which == 2 else BAD_LORA_PATHS) or BAD_LORA_PATHS
            if which >= 2 and isinstance(name, str) and name in RUNTIME_NAMES:
                name = "never"  # a name nothing loads under: the path is read, not refused as loaded already
            body: dict[str, Any] = {"lora_name": target.model if name == "{model}" else name,
                                    "lora_path": draw(st.sampled_from(paths))}
            if draw(st.integers(0, 3)) == 0:
                body["load_inplace"] = draw(st.sampled_from([True, True, False, "x"]))
            path = "/v1/load_lora_adapter"
        else:
            name = draw(st.sampled_from(RUNTIME_NAMES if draw(st.booleans()) else UNLOAD_NAMES))
            body = {"lora_name": target.model if name == "{model}" else name}
            if draw(st.integers(0, 3)) == 0:
                body["lora_int_id"] = draw(st.sampled_from([1, -1, 2**63, "x"]))
            path = "/v1/unload_lora_adapter"
        return Case("POST", path, _encode(body))
    path = draw(st.sampled_from(["/v1/completions", "/v1/completions", "/v1/chat/completions",
                                 "/v1/chat/completions/batch", "/v1/responses", "/tokenize", "/v1/embeddings"]))
    names = [*target.lora_names, *target.lora_names, target.model, "d1", "d2"]
    model = draw(st.sampled_from(names) if draw(st.integers(0, 3)) < 3 else st.sampled_from(BAD_LORA_NAMES))
    body = {"model": model}
    if path == "/v1/responses":
        body.update(input="What is 2+2?", max_output_tokens=draw(st.sampled_from([1, 8, 32])))
        if draw(st.booleans()):
            body["stream"] = True
        return Case("POST", path, _encode(body), stream=body.get("stream") is True)
    if path in ("/tokenize", "/v1/embeddings"):
        body.update({"prompt": "hello"} if path == "/tokenize" else {"input": "hello"})
        return Case("POST", path, _encode(body))
    chat = path != "/v1/completions"
    body.update(copy.deepcopy(VALID_BASES[path]))
    if not chat and draw(st.booleans()):
        body["prompt"] = draw(st.sampled_from([["a", "b", "c"], [[1, 2, 3], [504, 3458]], "x " * (MAX_LEN - 20)]))
    extras = {"n": [2, 4], "temperature": [0, 1.0], "logprobs": [0, 5, 20], "prompt_logprobs": [0, 5],
              "echo": [True], "stream": [True], "stream_options": [{"include_usage": True,
                                                                    "continuous_usage_stats": True}],
              "use_beam_search": [True], "structured_outputs": [{"regex": "[a-z ]{1,20}"}, {"choice": ["yes", "no"]},
                                                                {"json": {"type": "object"}}],
              "max_tokens": [1, 16, 48], "seed": [0, 7], "stop": [[" "], ["e"]], "ignore_eos": [True],
              "priority": [0, 5], "return_token_ids": [True], "top_logprobs": [0, 5],
              "tools": [[TOOL]], "tool_choice": ["required", "auto"]}
    names = [n for n in sorted(extras) if n not in (COMPLETION_ONLY if chat else CHAT_ONLY)]
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=5, unique=True)):
        body[name] = copy.deepcopy(draw(st.sampled_from(extras[name])))
    if chat and body.get("logprobs") is not None:
        body["logprobs"] = True
    if body.get("use_beam_search"):
        body.setdefault("n", 2)
        for name in ("stream", "stream_options", "stop", "structured_outputs"):  # refused with beam search
            body.pop(name, None)
    if "tool_choice" in body:
        body.setdefault("tools", [TOOL])
    if "stream_options" in body:
        body["stream"] = True
    if path.endswith("/batch"):
        for name in ("stream", "stream_options", "n", "use_beam_search", "tools", "tool_choice"):
            body.pop(name, None)
    return Case("POST", path, _encode(body), stream=body.get("stream") is True)


# The kinds of case (--only picks some) and their weights in the mix.
KINDS = {"fields": 3, "combined": 2, "forced": 2, "fail": 1, "raw": 1, "leave": 1, "get": 1}
# Kinds each configuration adds to the mix (or weighs more) unless --only names the kinds.
CONFIG_KINDS: dict[str, dict[str, int]] = {"spec": {"sampling": 3}, "spec-sync": {"sampling": 4},
                                           "reasoning": {"reasoning": 6}, "reasoning-tiny": {"reasoning": 8},
                                           "lora": {"lora": 6}, "dp-lora": {"lora": 6, "fail": 2, "leave": 2},
                                           "dp": {"fail": 2, "leave": 2, "combined": 3}}
ALL_KINDS = [*KINDS, "sampling", "reasoning", "lora"]


def kind_weights(config: str, only: str | None) -> dict[str, int]:
    """The configuration's mix; with --only, those kinds, weighed as in that mix (1 if it has none)."""
    mix = {**KINDS, **CONFIG_KINDS.get(config, {})}
    if not only:
        return mix
    kinds = only.split(",")
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        raise SystemExit(f"unknown kind(s) {unknown}; the kinds are {ALL_KINDS}")
    return {k: mix.get(k, 1) for k in kinds}


def all_cases(target: Target, weights: dict[str, int]) -> st.SearchStrategy[Case]:
    raw_paths = sorted({k.split("#")[0].replace("{id}", "resp_x") for k in target.table})
    model = target.model
    strategies = {"fields": json_cases(target), "combined": combined_cases(model), "forced": forced_output_cases(model),
                  "fail": failing_cases(model), "raw": raw_cases(raw_paths, model), "leave": leaving_cases(model),
                  "get": get_cases(model), "sampling": sampling_cases(target), "reasoning": reasoning_cases(target),
                  "lora": lora_cases(target)}
    return st.one_of([strategies[kind].map(lambda case, kind=kind: replace(case, kind=kind))
                      for kind, weight in weights.items() for _ in range(weight)])


# --- checks ----------------------------------------------------------------------------------------------------

# Python's own words for a failure the code did not foresee (tests/test_malformed_sweep.py's UNCLEAR).
UNCLEAR = re.compile(r"^(?:'[^']*' object (?:is not|has no|cannot)|'[^']*' codec can't|unhashable type|"
                     r"(?:list|tuple|string) index out of range|'[^']*' not supported between|"
                     r"\w+\(\) (?:takes|got|missing|should|argument)|'[^']*'$|None$|[A-Za-z]*Error\b)")
FALLBACK_LOG = re.compile(r": \d{3} from \w+: |unhandled error in |Traceback \(most recent call last\)")
SSE_SERVER_ERROR = re.compile(rb'"code":\s*5\d\d')
SSE_ERROR_EVENT = re.compile(rb'"error":\s*\{')  # an error event (written with a space after the colon)


@dataclass
class Finding:
    kind: str
    where: str
    detail: str
    case: dict[str, Any] | None = None


@dataclass
class Tally:
    findings: dict[tuple[str, str, str], list[Finding]] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    sent: int = 0
    notes: dict[str, int] = field(default_factory=dict)
    note_examples: dict[str, Any] = field(default_factory=dict)
    by_path: dict[str, dict[int, int]] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)  # "path: message head" -> count, to see what was reached
    config: str = ""  # the configuration being fuzzed
    by_config: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # config -> kind -> status -> n
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, kind: str, where: str, detail: str, case: Case | None = None) -> None:
        head = re.sub(r"\d+", "N", detail[:80])  # one group per kind of message, whatever numbers it holds
        with self.lock:
            self.findings.setdefault((kind, where, head), []).append(
                Finding(kind, where, detail[:600], case.describe() if case else None))

    def count(self, path: str, status: int, kind: str = "") -> None:
        with self.lock:
            self.sent += 1
            self.statuses[status] = self.statuses.get(status, 0) + 1
            per_path = self.by_path.setdefault(path if len(path) < 60 else path[:40] + "...", {})
            per_path[status] = per_path.get(status, 0) + 1
        self.count_kind(kind, str(status))

    def count_kind(self, kind: str, outcome: str) -> None:
        """One case's outcome (its status, "left": a client that left) under its configuration and kind."""
        with self.lock:
            per_kind = self.by_config.setdefault(self.config, {}).setdefault(kind or "?", {})
            per_kind[outcome] = per_kind.get(outcome, 0) + 1

    def refused(self, path: str, message: str) -> None:
        head = re.sub(r"\d+", "N", message[:70])
        with self.lock:
            key = f"{self.config} {path[:40]}: {head}"
            self.refusals[key] = self.refusals.get(key, 0) + 1

    def note(self, what: str, example: Any = None) -> None:
        """Something worth a look that breaks no rule; the first example kept."""
        with self.lock:
            self.notes[what] = self.notes.get(what, 0) + 1
            self.note_examples.setdefault(what, example)


def check_error_body(tally: Tally, case: Case, status: int, content: bytes) -> None:
    try:
        err = json.loads(content)["error"]
        ok_shape = (set(err) == {"message", "type", "param", "code"} and err["code"] == status
                    and isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
                    and (err["param"] is None or isinstance(err["param"], str)))
    except (ValueError, KeyError, TypeError):
        tally.fail("error body not vLLM's shape", case.path, f"{status} {content[:200]!r}", case)
        return
    if not ok_shape:
        tally.fail("error body not vLLM's shape", case.path, f"{status} {content[:200]!r}", case)
    elif UNCLEAR.search(err["message"]):
        tally.fail("message in Python's words", case.path, f"{status} {err['message']}", case)
    else:
        tally.refused(case.path, err["message"])


def expected_choices(case: Case) -> int | None:
    """How many choices a 200 to this request must hold (n per prompt, one per conversation of a batch), where
    that is plain; None where it is not (beam search, Responses, a body that is not a dict)."""
    if case.path not in ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch"):
        return None
    try:
        body = json.loads(case.body or b"")
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("use_beam_search"):
        return None
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if case.path.endswith("/batch"):
        messages = body.get("messages")
        return len(messages) if isinstance(messages, list) else None
    if case.path == "/v1/chat/completions":
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return n
    return n * len(prompt) if isinstance(prompt, list) and prompt else None


def check_choices(tally: Tally, case: Case, indexes: list[int], finished: set[int], content: bytes) -> None:
    """A 200 holds every choice it owes, once each (whole answers), and each finished (streams): none lost."""
    want = expected_choices(case)
    if want is None:
        return
    if sorted(set(indexes)) != list(range(want)) or len(finished) != want:
        tally.fail("lost choice", case.path, f"{want} choices owed; indexes {sorted(set(indexes))[:20]}, "
                   f"{len(finished)} finished: {content[-300:].decode(errors='replace')}", case)


def check_stream(tally: Tally, case: Case, content: bytes, complete: bool) -> None:
    if SSE_SERVER_ERROR.search(content):
        tally.fail("5xx error event in a stream", case.path, content[-300:].decode(errors="replace"), case)
    events = [line[6:] for line in content.split(b"\n") if line.startswith(b"data: ")]
    for data in events:
        if data != b"[DONE]":
            try:
                json.loads(data)
            except ValueError:
                tally.fail("stream event not JSON", case.path, data[:200].decode(errors="replace"), case)
                return
    errored = SSE_ERROR_EVENT.search(content) is not None
    if errored:
        tally.note(f"4xx error event in a 200 stream: {case.path}",
                   {"request": case.describe(), "answer": content[-400:].decode(errors="replace")})
    if complete and case.path != "/v1/responses" and (not events or events[-1] != b"[DONE]"):
        tally.fail("stream without [DONE]", case.path, content[-200:].decode(errors="replace"), case)
    if complete and not errored:
        indexes, finished = [], set()
        for data in events[:-1]:
            for choice in json.loads(data).get("choices") or []:
                indexes.append(choice.get("index"))
                if choice.get("finish_reason") is not None:
                    finished.add(choice.get("index"))
        check_choices(tally, case, indexes, finished, content)


def send(http: httpx.Client, url: str, case: Case, tally: Tally) -> None:
    """One request, held to the rule; a client that leaves just leaves (the batch checks find what it left)."""
    if case.leave == "body":
        tally.count_kind(case.kind, "left")
        return leave_mid_body(url, case)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, read=0.3) if case.leave == "wait" else None
    headers = {name: value.encode("utf-8") for name, value in case.headers.items()}  # bytes: any value travels
    try:
        with http.stream(case.method, case.path, content=case.body, headers=headers,
                         **({"timeout": timeout} if timeout else {})) as r:
            if case.leave == "stream" and r.status_code == 200:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= case.after:
                        tally.count_kind(case.kind, "left")
                        return  # closing the response here drops the connection mid-stream
            content = r.read()
    except httpx.ReadTimeout:
        if case.leave == "wait":
            tally.count_kind(case.kind, "left")
            return
        tally.fail("hang", case.path, f"no answer in {CLIENT_TIMEOUT_S:g} s", case)
        return
    except httpx.LocalProtocolError:  # the client's HTTP library would not send it (a DEL in a header)
        tally.note("not sent: the client refused the request")
        return
    except httpx.TransportError as exc:
        tally.fail("dropped connection", case.path, repr(exc), case)
        return
    tally.count(case.path, r.status_code, case.kind)
    if r.status_code >= 500:
        tally.fail(f"{r.status_code}", case.path, content[:300].decode(errors="replace"), case)
    elif r.status_code >= 400 and case.method != "HEAD":
        check_error_body(tally, case, r.status_code, content)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(tally, case, content, complete=not case.leave)
    elif case.method == "POST" and r.headers.get("content-type", "").startswith("application/json"):
        try:
            answer = json.loads(content)
        except ValueError:
            tally.fail("200 body not JSON", case.path, content[:200].decode(errors="replace"), case)
            return
        if r.status_code == 200 and isinstance(answer, dict) and isinstance(answer.get("choices"), list):
            choices = [c for c in answer["choices"] if isinstance(c, dict)]
            check_choices(tally, case, [c.get("index") for c in choices],
                          {c.get("index") for c in choices if c.get("finish_reason") is not None}, content)


def leave_mid_body(url: str, case: Case) -> None:
    """Announce the whole body, send half of it, hang up."""
    host, port = url.removeprefix("http://").split(":")
    body = case.body or b""
    head = (f"{case.method} {case.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 1000}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body[: len(body) // 2])


# --- the run ---------------------------------------------------------------------------------------------------


def lora_setup(model: str | None, out: Path) -> tuple[list[str], dict[str, str]]:
    """Adapters for the `lora` configuration, written from the model's own shapes (benchmarks/lora's
    write_adapter: random PEFT adapters, no peft or HF checkpoint needed, so the GGUF default model works):
    the --lora-modules a1..a3 it serves from the start, and the directories the runtime loads draw from,
    good and bad (rank past --max-lora-rank, another model's shapes, broken or missing files, NaN / inf /
    huge weights, unknown targets)."""
    from types import SimpleNamespace

    from benchmarks.lora.lora_throughput import write_adapter
    from tokenloom.model.loader import load_model_config
    from tokenloom.model.paths import default_model_path

    config = load_model_config(model or default_model_path())
    # B's spread 0.05: enough to move the greedy tokens (a1's reference differs from the base model's)
    dirs = {f"a{i}": write_adapter(out / f"a{i}", config, 8, seed=i, b_scale=0.05) for i in (1, 2, 3)}
    dirs["good"] = write_adapter(out / "good", config, 4, seed=9)
    dirs["rank16"] = write_adapter(out / "rank16", config, 16, seed=4)
    dirs["nan"] = write_adapter(out / "nan", config, 8, seed=5, b_scale=float("nan"))
    dirs["inf"] = write_adapter(out / "inf", config, 8, seed=6, b_scale=float("inf"))
    dirs["huge"] = write_adapter(out / "huge", config, 8, seed=7, b_scale=1e30)
    other = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            head_dim=16, num_key_value_heads=2)  # another model's shapes (write_adapter reads these)
    dirs["shapes"] = write_adapter(out / "shapes", other, 8, seed=8)
    for name, config_text in (("badjson", "{"), ("noweights", None), ("targets", json.dumps({
            "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["lm_head", "foo"]})),
            ("notlora", json.dumps({"peft_type": "PREFIX_TUNING"}))):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        if name != "noweights":
            (d / "adapter_model.safetensors").write_bytes((dirs["a1"] / "adapter_model.safetensors").read_bytes())
        (d / "adapter_config.json").write_text(config_text or (dirs["a1"] / "adapter_config.json").read_text())
        dirs[name] = d
    (out / "empty").mkdir(exist_ok=True)
    dirs["empty"] = out / "empty"
    dirs["file"] = dirs["a1"] / "adapter_model.safetensors"
    args = ["--lora-modules", *(f"a{i}={dirs[f'a{i}']}" for i in (1, 2, 3))]
    return args, {name: str(path) for name, path in dirs.items()}


class Fuzzer:
    def __init__(self, name: str, server_args: list[str], tally: Tally, concurrency: int, log_dir: Path,
                 env: dict[str, str] | None = None, adapter_dirs: dict[str, str] | None = None) -> None:
        self.name = name
        self.server_args = server_args
        self.env = env
        self.adapter_dirs = adapter_dirs or {}
        self.tally = tally
        self.concurrency = concurrency
        self.log_dir = log_dir
        self.server: ServerProcess | None = None
        self.model = ""
        self.vocab = VOCAB
        self.reference: list[int] = []
        self.lora_reference: list[int] = []  # the `lora` configuration: a1's greedy tokens, held as the base's
        self.scripts: dict[str, list[int]] = {}
        self.num_engines = 1
        self.log_offset = 0
        self.batches = 0

    def start(self) -> None:
        log = self.log_dir / f"{self.name}-{int(time.time())}.log"
        common = [str(CONFIG_MAX_LEN.get(self.name, MAX_LEN)) if a == str(MAX_LEN) else a for a in COMMON_ARGS]
        self.server = ServerProcess(*self.server_args, *common, log_path=log, env=self.env)
        self.server.start()
        self.log_offset = 0
        self.http = httpx.Client(base_url=self.server.url, timeout=CLIENT_TIMEOUT_S)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]
        self.vocab = self.vocab_size()
        health = self.http.get("/health")
        self.num_engines = len(health.json()["engines"]) if health.content else 1
        if self.num_engines > 1 and not any("engine_router_requests_in_flight" in k for k in self.server.metrics()):
            raise RuntimeError("data parallel without tokenloom:engine_router_requests_in_flight: nothing to check")
        self.greedy()  # once to fill the prefix cache: the reference is a prompt served from it, as every later one
        self.reference = self.greedy()
        if self.adapter_dirs:
            self.greedy("a1")
            self.lora_reference = self.greedy("a1")
            if self.lora_reference == self.reference:
                self.tally.note("adapter a1 gives the base model's greedy tokens: its check shows less")
        if "tests.reasoning_models:ScriptedOutput" in self.server_args:
            self.scripts = {text: self.http.post("/tokenize", json={"model": self.model, "prompt": text,
                                                                    "add_special_tokens": False}).json()["tokens"]
                            for text in REASONING_OUTPUTS}

    def target(self) -> Target:
        lora_names = tuple(n for n in self.adapter_dirs if n in ("a1", "a2", "a3"))
        dirs = {n: d for n, d in self.adapter_dirs.items() if n not in ("a1", "a2")}  # a1, a2 stay as they are
        return Target(self.model, self.vocab, lora_names, dirs, self.scripts)

    def vocab_size(self) -> int:
        """The first id /detokenize refuses as out of vocabulary (a binary search; the server has no other way)."""
        low, high = 0, 1 << 24
        while high - low > 1:
            mid = (low + high) // 2
            ok = self.http.post("/detokenize", json={"model": self.model, "tokens": [mid]}).status_code == 200
            low, high = (mid, high) if ok else (low, mid)
        return high

    def stop(self) -> None:
        if self.server is not None:
            self.http.close()
            self.server.stop()

    def greedy(self, model: str | None = None) -> list[int]:
        r = self.http.post("/v1/completions", json={"model": model or self.model, "prompt": REFERENCE_PROMPT,
                                                    "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                    "return_token_ids": True})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    def canary(self) -> None:
        """A greedy stream running beside the batch: it must finish whole, whatever the batch did."""
        body = {"model": self.model, "prompt": REFERENCE_PROMPT, "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        try:
            with self.http.stream("POST", "/v1/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as exc:
            self.tally.fail("canary lost", self.name, repr(exc))
            return
        tokens = [t for line in lines[:-1] for t in json.loads(line[6:])["choices"][0].get("token_ids") or []]
        if r.status_code != 200 or lines[-1:] != ["data: [DONE]"] or len(tokens) != 48:
            self.tally.fail("canary lost", self.name, f"{r.status_code}, {len(tokens)} tokens, {lines[-1:]}")
        elif tokens[:12] != self.reference:
            self.tally.note("canary's greedy tokens differ beside the batch (batch-variant GGUF kernels)")

    def run_batch(self, cases: list[Case]) -> None:
        assert self.server is not None
        self.batches += 1
        with concurrent.futures.ThreadPoolExecutor(self.concurrency + 1) as pool:
            canary = pool.submit(self.canary)
            for future in [pool.submit(send, self.http, self.server.url, case, self.tally) for case in cases]:
                future.result()
            canary.result()
        self.after_batch(cases)

    def after_batch(self, cases: list[Case]) -> None:
        """The server lives, is healthy, serves as before and holds nothing; restarted when it does not."""
        assert self.server is not None
        where = f"{self.name} batch {self.batches}"
        if self.server.proc is not None and self.server.proc.poll() is not None:
            self.tally.fail("server died", where, self.server.log()[-600:], None)
            self._dump_batch(cases)
            self.stop()
            self.start()
            return
        try:
            health = self.http.get("/health", timeout=30).status_code
            if health != 200:
                self.tally.fail("health", where, str(health))
            busy = self.wait_idle()
            if busy:
                self.tally.fail("requests left in the engine", where, busy)
                self._dump_batch(cases)
            if self.greedy() != self.reference:
                self.tally.fail("greedy answer changed", where, "the reference prompt gives other tokens")
            if self.lora_reference and self.greedy("a1") != self.lora_reference:
                self.tally.fail("greedy answer changed", where, "adapter a1 gives other tokens for the reference")
        except httpx.HTTPError as exc:
            self.tally.fail("server unresponsive after a batch", where, repr(exc))
        self.scan_log(where)

    def wait_idle(self) -> str:
        """'' once nothing runs, waits, holds a KV block or an HTTP handler; else what is left."""
        assert self.server is not None
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            m = self.server.metrics()
            left = {"running": metric(m, "tokenloom:num_requests_running"),
                    "waiting": metric(m, "tokenloom:num_requests_waiting"),
                    "kv blocks": metric(m, "tokenloom:kv_cache_total_blocks")
                    - metric(m, "tokenloom:kv_cache_free_blocks"),
                    "http load": self.http.get("/load").json()["server_load"]}
            for e in map(str, range(self.num_engines if self.num_engines > 1 else 0)):
                # Data parallel: each engine idle and alive, and the router's own record of what it sent there
                # (its balance test reads it) back to 0: a request the router never saw finish stays counted.
                left[f"engine {e} running"] = metric(m, "tokenloom:engine_num_requests_running", engine=e)
                left[f"engine {e} waiting"] = metric(m, "tokenloom:engine_num_requests_waiting", engine=e)
                left[f"engine {e} dead"] = 1 - metric(m, "tokenloom:engine_alive", engine=e)
                left[f"engine {e} routed in flight"] = metric(m, "tokenloom:engine_router_requests_in_flight",
                                                              engine=e)
            if not any(left.values()):
                return ""
            if time.monotonic() > deadline:
                return ", ".join(f"{k} {v:g}" for k, v in left.items() if v)
            time.sleep(0.5)

    def scan_log(self, where: str) -> None:
        assert self.server is not None
        text = self.server.log_path.read_text(errors="replace")
        new, self.log_offset = text[self.log_offset:], len(text)
        for line in new.splitlines():
            if FALLBACK_LOG.search(line):
                self.tally.fail("exception reached a fallback handler", where, line[:400])

    def _dump_batch(self, cases: list[Case]) -> None:
        path = self.log_dir / f"{self.name}-batch{self.batches}.json"
        path.write_text(json.dumps([c.describe(limit=20_000) for c in cases], indent=1))
        self.tally.note(f"batch written to {path}")


def fuzz(fuzzer: Fuzzer, batches: int, batch_size: int, seed: int, weights: dict[str, int]) -> None:
    pending: list[Case] = []

    @settings(max_examples=batches * batch_size, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(case=all_cases(fuzzer.target(), weights))
    def collect(case: Case) -> None:
        pending.append(case)
        if len(pending) >= batch_size:
            fuzzer.run_batch(pending[:])
            pending.clear()
            print(f"  {fuzzer.name}: batch {fuzzer.batches}/{batches}, {fuzzer.tally.sent} answers, "
                  f"{sum(len(v) for v in fuzzer.tally.findings.values())} failures", flush=True)

    collect()
    if pending:
        fuzzer.run_batch(pending)


def report(tally: Tally) -> dict[str, Any]:
    groups = [{"kind": k[0], "where": k[1], "count": len(v), "detail": v[0].detail, "first_request": v[0].case}
              for k, v in sorted(tally.findings.items(), key=lambda kv: -len(kv[1]))]
    return {"answers": tally.sent, "statuses": dict(sorted(tally.statuses.items())),
            "by_path": {p: dict(sorted(s.items())) for p, s in sorted(tally.by_path.items())},
            "by_config": tally.by_config,
            "notes": tally.notes, "note_examples": tally.note_examples,
            "refusals": dict(sorted(tally.refusals.items(), key=lambda kv: -kv[1])), "failures": groups}


def print_report(summary: dict[str, Any]) -> None:
    print(f"\n{summary['answers']} answers: {summary['statuses']}")
    for path, statuses in summary["by_path"].items():
        print(f"  {path}: {statuses}")
    for config, kinds in summary["by_config"].items():
        total = sum(n for outcomes in kinds.values() for n in outcomes.values())
        print(f"  {config} ({total} cases): " + "; ".join(f"{kind} {dict(sorted(outcomes.items()))}"
                                                         for kind, outcomes in sorted(kinds.items())))
    for note, n in summary["notes"].items():
        print(f"  note ({n}x): {note}")
    if not summary["failures"]:
        print("no failures")
    for g in summary["failures"]:
        print(f"\nFAIL {g['kind']} at {g['where']} ({g['count']}x): {g['detail'][:300]}")
        if g["first_request"]:
            print("  first request:", json.dumps(g["first_request"])[:800])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model path (default: the default model)")
    p.add_argument("--server-args", default="", help="more `tokenloom serve` flags for every configuration")
    p.add_argument("--configs", default="plain,spec", help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--batches", type=int, default=12, help="batches per configuration")
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8, help="requests of a batch in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help=f"comma-separated kinds of case, of {ALL_KINDS} (default: the "
                                                "configuration's mix, CONFIG_KINDS)")
    p.add_argument("--json", type=Path, help="write every failure group here")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary directory)")
    args = p.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tokenloom-fuzz-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    tally = Tally()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        p.error(f"unknown configuration(s) {unknown}; of {sorted(CONFIGS)}")
    for name in names:
        server_args = ([args.model] if args.model else []) + CONFIGS[name] + shlex.split(args.server_args)
        adapter_dirs: dict[str, str] = {}
        if name in ("lora", "dp-lora"):
            lora_args, adapter_dirs = lora_setup(args.model, log_dir / "adapters")
            server_args += lora_args
        if name == "reasoning-tiny":
            from tests.reasoning_models import make_tiny_reasoning_model

            server_args = [str(make_tiny_reasoning_model(log_dir / "tiny-reasoning"))] + server_args[
                1 if args.model else 0:]
        weights = kind_weights(name, args.only)
        tally.config = name
        fuzzer = Fuzzer(name, server_args, tally, args.concurrency, log_dir, CONFIG_ENV.get(name), adapter_dirs)
        print(f"{name}: tokenloom serve {' '.join(server_args + COMMON_ARGS)} (logs in {log_dir}); kinds {weights}",
              flush=True)
        try:
            fuzzer.start()
        except (RuntimeError, httpx.HTTPError) as exc:  # a configuration that does not start is a finding too
            tally.fail("server did not start", name, str(exc)[-600:])
            fuzzer.stop()
            continue
        try:
            fuzz(fuzzer, args.batches, args.batch_size, args.seed, weights)
        finally:
            fuzzer.stop()
    summary = report(tally)
    print_report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
