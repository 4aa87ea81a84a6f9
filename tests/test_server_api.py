"""vLLM's API extensions through a live `tokenloom serve` (tiny model): every accepted parameter does
what it says — echo, prompt_logprobs, truncation, logit_bias, allowed_token_ids,
return_tokens_as_token_ids, stream_options, return_token_ids, bad_words — plus request ids, ORCA headers, the
batch chat endpoint, /load, /invocations, /tokenizer_info, --root-path, vLLM-named metrics, and (with vLLM's
flags) X-Request-Id on every response and usage.prompt_tokens_details."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.test_server_harness import ServerProcess
from tests.tiny_models import TINY_VOCAB, make_tiny_hf_model

pytestmark = pytest.mark.slow
MODEL = "tiny"
PROMPT_IDS = [5, 17, 42, 9, 101, 33, 7, 250, 64, 12]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)
    args = [str(model_dir), "--dtype", "float32", "--num-blocks", "1024", "--block-size", "4",
            "--served-model-name", MODEL, "--root-path", "/llm", "--enable-tokenizer-info-endpoint",
            "--max-logprobs", "-1", "--enable-request-id-headers", "--enable-prompt-tokens-details",
            "--allowed-origins", '["http://trusted.example"]']
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _post(http, path: str, body: dict) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_completion_echo_with_logprobs_and_prompt_logprobs(http) -> None:
    plain = _post(http, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4, **GREEDY})
    echo = _post(http, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4, "echo": True, "logprobs": 2,
                                           **GREEDY})
    c = echo["choices"][0]
    assert c["text"] == "Hello there" + plain["choices"][0]["text"]
    n_prompt = echo["usage"]["prompt_tokens"]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == n_prompt + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == n_prompt  # echo implies them
    only = _post(http, "/v1/completions", {"prompt": "Hello there", "max_tokens": 0, "echo": True})
    assert only["choices"][0]["text"] == "Hello there"
    chunks = _stream(http, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4, "echo": True, **GREEDY})
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == c["text"]
    scored = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 1})
    plp = scored["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT_IDS)
    assert all(str(t) in e for t, e in zip(PROMPT_IDS[1:], plp[1:]))
    # vLLM's order within a position: the prompt's (or the sampled) token first, then the top-n by rank
    assert [next(iter(e)) for e in plp[1:]] == [str(t) for t in PROMPT_IDS[1:]]
    assert [next(iter(e)) for e in lp["top_logprobs"][1:]] == lp["tokens"][1:]
    # (test_vllm_return_tokens_as_ids.py's check: each position's first top_logprobs key is its token)
    as_ids = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 4, "echo": True, "logprobs": 1,
                                             "return_tokens_as_token_ids": True, **GREEDY})["choices"][0]["logprobs"]
    assert [next(iter(e)) for e in as_ids["top_logprobs"][1:]] == as_ids["tokens"][1:]


def test_minus_one_logprobs_mean_the_whole_vocabulary_with_max_logprobs_minus_one(http) -> None:
    chat = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                "logprobs": True, "top_logprobs": -1, "prompt_logprobs": -1})
    top = chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == TINY_VOCAB and len({e["logprob"] for e in top}) > 1
    assert chat["prompt_logprobs"][0] is None
    assert all(len(e) == TINY_VOCAB for e in chat["prompt_logprobs"][1:])


def test_chat_echo_continues_the_final_message(http) -> None:
    messages = [{"role": "user", "content": "Say something"}, {"role": "assistant", "content": "An apple a day"}]
    body = {"messages": messages, "max_tokens": 3, "echo": True, "continue_final_message": True,
            "add_generation_prompt": False, **GREEDY}
    full = _post(http, "/v1/chat/completions", body)
    assert full["choices"][0]["message"]["content"].startswith("An apple a day")
    chunks = _stream(http, "/v1/chat/completions", body)
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == full["choices"][0]["message"]["content"]
    both = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400  # vLLM's sentence, as its pooling and tokenize bodies say it too
    assert both.json()["error"]["message"] == ("Cannot set both `continue_final_message` and `add_generation_prompt` "
                                               "to True.")


def test_chat_without_generation_prompt_answers_in_the_last_role(http) -> None:
    """vLLM's get_chat_request_role: without a generation prompt the model goes on with the last turn, so the
    response carries that message's role, and echo prepends its content."""
    body = {"messages": [{"role": "user", "content": "Count with me: one, two"}], "max_tokens": 3, "echo": True,
            "add_generation_prompt": False, **GREEDY}
    full = _post(http, "/v1/chat/completions", body)
    message = full["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Count with me: one, two")
    chunks = _stream(http, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "user"
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == message["content"]
    plain = _post(http, "/v1/chat/completions", {**body, "add_generation_prompt": True, "echo": False})
    assert plain["choices"][0]["message"]["role"] == "assistant"


def test_logit_bias_allowed_tokens_and_tokens_as_ids(http) -> None:
    biased = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 5, "logit_bias": {"77": 100},
                                             "return_token_ids": True, **GREEDY})
    assert biased["choices"][0]["token_ids"] == [77] * 5
    allowed = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 1.0,
                                              "allowed_token_ids": [11, 22], "return_token_ids": True,
                                              "ignore_eos": True})
    assert set(allowed["choices"][0]["token_ids"]) <= {11, 22}
    as_ids = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 3, "logprobs": 1,
                                             "return_tokens_as_token_ids": True, "return_token_ids": True, **GREEDY})
    c = as_ids["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    chat = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "logprobs": True, "return_tokens_as_token_ids": True, **GREEDY})
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_bad_words_on_both_endpoints(http) -> None:
    """vLLM's bad_words: allowed_token_ids leave " on" and " the", a +100 bias makes " on" win every step, so
    the tokens say what the ban did whatever the weights: "on" (one token either way) is never generated;
    "on on" only after " on", so the two alternate."""
    def ids(text: str) -> list[int]:
        return _post(http, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    (on,), (the,) = ids(" on"), ids(" the")
    steer = {"allowed_token_ids": [on, the], "logit_bias": {str(on): 100}, "return_token_ids": True, **GREEDY}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **steer}
    for words, want in ((None, [on] * 5), (["on"], [the] * 5), (["on on"], [on, the, on, the, on])):
        extra = {} if words is None else {"bad_words": words}
        completion = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 5, **steer, **extra})
        assert completion["choices"][0]["token_ids"] == want, words
        answer = _post(http, "/v1/chat/completions", {**chat, **extra})
        assert answer["choices"][0]["token_ids"] == want, words
    for value, message in (("on", "valid list"), ([1], "valid string"), (["  "], "at least one token")):
        for path, body in (("/v1/completions", {"prompt": PROMPT_IDS}), ("/v1/chat/completions", chat)):
            bad = http.post(path, json={"model": MODEL, **body, "bad_words": value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words", bad.text
            assert message in bad.json()["error"]["message"], bad.text
    # Refused where nothing would apply it: beam search, and /v1/responses (its request has no bad_words).
    beams = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "n": 2, "use_beam_search": True,
                                               "max_tokens": 2, "bad_words": ["on"]})
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "bad_words", beams.text
    responses = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "bad_words": ["on"]})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "bad_words", responses.text


def test_truncate_prompt_tokens_keeps_the_requested_side(http) -> None:
    long = list(range(3, 303))  # longer than max_model_len (256)
    left = _post(http, "/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10,
                                           "return_token_ids": True})
    assert left["choices"][0]["prompt_token_ids"] == long[-10:] and left["usage"]["prompt_tokens"] == 10
    right = _post(http, "/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10,
                                            "truncation_side": "right", "return_token_ids": True})
    assert right["choices"][0]["prompt_token_ids"] == long[:10]
    fit = _post(http, "/v1/completions", {"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert fit["usage"]["prompt_tokens"] == 255


def test_stream_options_and_token_ids_as_vllm(http) -> None:
    msgs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **GREEDY}
    # continuous_usage_stats alone does nothing: it needs include_usage.
    quiet = _stream(http, "/v1/chat/completions", {**msgs, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in ch for ch in quiet)
    loud = _stream(http, "/v1/chat/completions",
                   {**msgs, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(ch.get("usage") for ch in loud)
    assert loud[0]["choices"][0]["delta"]["role"] == "assistant" and loud[0]["usage"]["completion_tokens"] == 0
    assert loud[-1]["choices"] == [] and loud[-1]["usage"]["completion_tokens"] == 3
    ids = _stream(http, "/v1/chat/completions", {**msgs, "return_token_ids": True})
    assert ids[0]["prompt_token_ids"] and sum(len(ch["choices"][0].get("token_ids", [])) for ch in ids) == 3
    cmpl = _stream(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 3, "return_token_ids": True,
                                             **GREEDY})
    assert cmpl[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    assert "prompt_token_ids" not in cmpl[-1]["choices"][0]
    # Without return_token_ids the keys are there, null, as vLLM sends them.
    plain = _post(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2})
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0]["prompt_token_ids"] is None
    chat = _post(http, "/v1/chat/completions", msgs)
    assert chat["prompt_token_ids"] is None and chat["choices"][0]["token_ids"] is None
    # vLLM's stream_interval (a 400 "not supported yet" before): the first token alone, then 4 at a time or more
    # (more when a slow reader merged two), the last chunk what is left; below 1 is pydantic's 400.
    every4 = _stream(http, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 10, "return_token_ids": True,
                                               "ignore_eos": True, "stream_interval": 4, **GREEDY})
    sizes = [len(ch["choices"][0]["token_ids"]) for ch in every4 if ch["choices"] and ch["choices"][0]["token_ids"]]
    assert sizes[0] == 1 and sum(sizes) == 10 and len(sizes) > 2 and all(size >= 4 for size in sizes[1:-1])
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream_interval": 0})
    assert r.status_code == 400 and "stream_interval" in r.text


def test_request_id_orca_header_and_extra_routes(server, http) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                  headers={"X-Request-Id": "my-id-1", "endpoint-load-metrics-format": "json"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1" and r.json()["id"] == "cmpl-my-id-1"
    orca = r.headers["endpoint-load-metrics"]
    assert orca.startswith("JSON ") and "kv_cache_usage_perc" in json.loads(orca[5:])["named_metrics"]
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).headers["x-request-id"]
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and "chat_template" in info
    assert http.get("/llm/v1/models").json()["data"][0]["id"] == MODEL  # --root-path
    inv = _post(http, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert inv["object"] == "chat.completion"
    assert _post(http, "/invocations", {"prompt": "hi", "max_tokens": 2})["object"] == "text_completion"
    batch = _post(http, "/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "hi"}],
                                                                    [{"role": "user", "content": "yo"}]],
                                                       "max_tokens": 2, **GREEDY})
    assert [c["index"] for c in batch["choices"]] == [0, 1] and batch["usage"]["completion_tokens"] == 4
    assert batch["usage"]["prompt_tokens_details"] is None  # vLLM's batch endpoint never reports them
    metrics = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
                 "tokenloom:num_requests_running", "vllm:request_params_n", "vllm:request_params_max_tokens",
                 "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:cache_config_info",
                 'vllm:num_requests_waiting_by_reason{model_name="tiny",reason="capacity"}'):
        assert name in metrics, name
    # vLLM's cache info names what the cache stores: --dtype float32, so a float32 cache
    assert re.search(r'vllm:cache_config_info\{[^}]*cache_dtype="float32"[^}]*num_gpu_blocks="1024"', metrics)
    # the default token budget is automatic under a 2,048 ceiling, and /metrics says so
    assert 'tokenloom:token_budget_info{auto_budget_prefill_ms="1500",max_num_batched_tokens="2048",mode="auto"} 1.0' \
        in metrics


def test_client_disconnect_mid_request_logs_no_error(server) -> None:
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, **GREEDY}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.05))
    ok = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    log = server.log()
    assert "InvalidStateError" not in log and "Exception in ASGI application" not in log, log[-2000:]


def test_request_id_header_on_every_response_with_the_flag(http) -> None:
    """--enable-request-id-headers is vLLM's middleware: every response (probes, 404s, 400s, streams) carries
    X-Request-Id once, the request's own or a fresh uuid4 hex, which is not the body's request_id."""
    assert http.get("/health", headers={"X-Request-Id": "probe-1"}).headers["x-request-id"] == "probe-1"
    fresh = http.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh) and fresh != http.get("/health").headers["x-request-id"]
    missing = http.get("/no/such/route", headers={"X-Request-Id": "nf-1"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "nf-1"
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -1},
                    headers={"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers.get_list("x-request-id") == ["bad-1"]
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"X-Request-Id": "gen-1"})
    assert ok.headers.get_list("x-request-id") == ["gen-1"] and ok.json()["id"] == "cmpl-gen-1"
    with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "sse-1"},
                     json={"model": MODEL, "stream": True, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["sse-1"]
        r.read()
    by_body = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                 "request_id": "body-1"})
    assert by_body.json()["id"] == "cmpl-body-1"
    assert re.fullmatch(r"[0-9a-f]{32}", by_body.headers["x-request-id"])


def test_prompt_tokens_details_as_vllm_builds_them(http) -> None:
    """--enable-prompt-tokens-details (block size 4 here): completions report cached_tokens (of the last prompt
    in a whole response), chat also created_cache_tokens; a whole response has vLLM's nulls, a stream's usage
    chunk leaves them out; beam search has none."""
    prompt = [(11 * j) % 280 + 9 for j in range(10)]  # used by no other test: nothing cached yet
    greedy = {"max_tokens": 2, **GREEDY}
    first = _post(http, "/v1/completions", {"prompt": prompt, **greedy})["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                              "multimodal_tokens": None}
    assert first["completion_tokens_details"] is None
    again = _post(http, "/v1/completions", {"prompt": prompt, **greedy})["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == 8  # two full blocks; never the last token
    fresh = [(13 * j) % 280 + 11 for j in range(10)]
    assert _post(http, "/v1/completions", {"prompt": [prompt, fresh], **greedy}
                 )["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the last prompt's
    stream = _stream(http, "/v1/completions", {"prompt": prompt, "stream_options": {"include_usage": True},
                                               **greedy})
    assert stream[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert all("prompt_tokens_details" not in (ch.get("usage") or {}) for ch in stream[:-1])
    beam = _post(http, "/v1/completions", {"prompt": prompt, "use_beam_search": True, "n": 2, "max_tokens": 2,
                                           "temperature": 0.0})
    assert beam["usage"]["prompt_tokens_details"] is None

    chat = {"messages": [{"role": "user", "content": "Which blocks did this prompt write to the cache?"}],
            **greedy}
    one = _post(http, "/v1/chat/completions", chat)["usage"]
    n, d = one["prompt_tokens"], one["prompt_tokens_details"]
    assert set(d) == {"cached_tokens", "created_cache_tokens", "multimodal_tokens"} and d["multimodal_tokens"] is None
    assert d["cached_tokens"] + d["created_cache_tokens"] == n // 4 * 4  # the template's head may be cached
    hit = (n - 1) // 4 * 4
    two = _post(http, "/v1/chat/completions", chat)["usage"]["prompt_tokens_details"]
    assert (two["cached_tokens"], two["created_cache_tokens"]) == (hit, n // 4 * 4 - hit)
    last = _stream(http, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})[-1]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": hit, "created_cache_tokens": n // 4 * 4 - hit}


def test_x_vllm_priority_header_is_read_by_both_generation_endpoints(http) -> None:
    """vLLM 0.32 takes `priority` from X-Vllm-Priority too (tests/test_server_headers.py has the rules); the
    server here is FCFS, so a valid value changes nothing, and one outside 64 bits is a 400 naming it."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/v1/chat/completions", chat)):
        assert http.post(path, json={"model": MODEL, **body}, headers={"X-Vllm-Priority": "3"}).status_code == 200
        bad = http.post(path, json={"model": MODEL, **body}, headers={"X-Vllm-Priority": str(1 << 64)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Vllm-Priority", bad.text


def test_cors_for_a_listed_origin(http) -> None:
    """--allowed-origins (vLLM's flag, a JSON list): a listed origin gets CORS headers and its preflight a 200;
    another origin neither (tests/test_server.py has the default: no origin at all)."""
    trusted = {"Origin": "http://trusted.example"}
    assert http.get("/v1/models", headers=trusted).headers["access-control-allow-origin"] == "http://trusted.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = http.options("/v1/chat/completions", headers={**trusted, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://trusted.example"
    other = {"Origin": "http://elsewhere.example"}
    assert "access-control-allow-origin" not in http.get("/v1/models", headers=other).headers
    assert http.options("/v1/chat/completions", headers={**other, **preflight}).status_code == 400


def test_chat_runs_the_prompt_ids_forwarded_in_kv_transfer_params(http) -> None:
    """vLLM 0.32's decode-side token reuse: a chat request carrying the prefill stage's prompt ids in
    kv_transfer_params["prompt_token_ids"] runs those ids, not its own messages rendered (vLLM's
    test_kv_transfer_prompt_token_ids_round_trip); malformed ids are a 400; the batch endpoint refuses them."""
    baseline = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to three"}],
                                                    "max_tokens": 4, "return_token_ids": True, **GREEDY})
    ids = baseline["prompt_token_ids"]
    other = {"messages": [{"role": "user", "content": "Something else entirely"}], "max_tokens": 4,
             "return_token_ids": True, **GREEDY}
    reused = _post(http, "/v1/chat/completions", {**other, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert reused["prompt_token_ids"] == ids
    assert reused["choices"][0]["token_ids"] == baseline["choices"][0]["token_ids"]
    assert reused["usage"]["prompt_tokens"] == len(ids)
    chunks = _stream(http, "/v1/chat/completions", {**other, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) \
        == baseline["choices"][0]["message"]["content"]
    for bad, words in (([], "must be a non-empty list"), ([1, True], "must be a non-empty list"),
                       ([1, TINY_VOCAB], f"Token id {TINY_VOCAB} is out of vocabulary")):
        r = http.post("/v1/chat/completions", json={"model": MODEL, **other,
                                                    "kv_transfer_params": {"prompt_token_ids": bad}})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions/batch", json={
        "model": MODEL, "messages": [other["messages"], other["messages"]],
        "kv_transfer_params": {"prompt_token_ids": ids}})
    assert r.status_code == 400 and "Batch chat completions do not support" in r.text, r.text
