"""`tokenloom serve` end to end with the official openai client: a live server on loopback, tiny model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model, reference_logprobs

pytestmark = pytest.mark.slow
KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = [str(model_dir), "--dtype", "float32", "--num-blocks", "4096", "--block-size", "4",
            "--served-model-name", MODEL, "--max-request-body-bytes", "64KiB"]
    with ServerProcess(*args, api_key=KEY, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _detokenize(server, tokens: list[int]) -> str:
    r = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_health_version_and_tokenize(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # open without the key
    assert httpx.get(server.url + "/version", timeout=5).json()["version"]
    ids = _tokenize(server, "Hello, world!")
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers, timeout=10)
    assert back.json() == {"prompt": "Hello, world!"}
    chat = httpx.post(server.url + "/tokenize", headers=server.headers, timeout=10,
                      json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    body = chat.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 256


def test_completion_usage_and_streaming_agree(server, client) -> None:
    prompt = "The quick brown fox"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(_tokenize(server, prompt))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert finishing[0].model_extra["metrics"]["queue_time_s"] >= 0


def test_chat_streaming_and_not(client) -> None:
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
              max_completion_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings(client) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    # A stop string from the middle of the greedy text, free of replacement characters.
    start = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = text[: text.find(stop)]
    got = client.completions.create(**kw, stop=[stop, "never-seen"]).choices[0]
    assert (got.text, got.finish_reason, got.model_extra["stop_reason"]) == (cut, "stop", stop)
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                     stop=stop)
    assert kept.choices[0].text == cut + stop


def test_n_completions_and_seed_reproducibility(client) -> None:
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=10, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # different seeds per child
    assert a.usage.completion_tokens == 30 and a.usage.prompt_tokens == b.usage.prompt_tokens
    streamed = list(client.completions.create(**kw, stream=True))
    for i in range(3):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) == a.choices[i].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, seed=1,
                                          max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]


def test_batch_of_prompts(client) -> None:
    out = client.completions.create(model=MODEL, prompt=["first prompt", "second"], max_tokens=4, n=2,
                                    temperature=0.8, seed=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2


def test_logprobs(server, client, model_dir) -> None:
    prompt_ids = _tokenize(server, "abc")
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0.0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # The values: greedy tokens and their logprobs from transformers' own logits, step by step.
    ids = list(prompt_ids)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        want = reference_logprobs(model_dir, ids)[-1]
        best = want.topk(3)
        assert chosen == pytest.approx(best.values[0].item(), abs=1e-4)
        # top-3 plus the sampled token; tokens that decode alike (partial UTF-8: U+FFFD) share a key
        assert 1 <= len(top) <= 4
        for value in top.values():
            assert min(abs(value - v) for v in best.values.tolist()) < 1e-4, (value, best.values)
        ids.append(int(best.indices[0]))
    assert _detokenize(server, ids[len(prompt_ids):]) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                          top_logprobs=2, max_completion_tokens=4, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6) for t in content)
    streamed = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0.0, logprobs=1,
                                              stream=True, extra_body={"ignore_eos": True}))
    values = [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_client_error_classes(client) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert nf.value.status_code == 404 and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    assert br.value.param == "temperature" and "temperature" in br.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_completion_tokens=2)
    bad_key = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_prompt_of_max_model_len_minus_one_with_the_default_max_tokens(server) -> None:
    """No max_tokens: the server's default leaves room for exactly one token, finish_reason "length"."""
    max_len = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=server.headers,
                         timeout=10).json()["max_model_len"]
    body = {"model": MODEL, "prompt": [(7 * j) % 300 + 3 for j in range(max_len - 1)], "temperature": 0.0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {"prompt_tokens": max_len - 1, "completion_tokens": 1, "total_tokens": max_len}
    assert r.json()["choices"][0]["finish_reason"] == "length"
    too_long = httpx.post(server.url + "/v1/completions", json={**body, "prompt": body["prompt"] + [5]},
                          headers=server.headers, timeout=60)
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]


def test_without_vllm_flags_no_request_id_header_and_null_prompt_tokens_details(server) -> None:
    """vLLM's defaults: X-Request-Id only with --enable-request-id-headers, prompt_tokens_details only with
    --enable-prompt-tokens-details (null in a whole response, absent from a stream's usage chunk)."""
    body = {"model": MODEL, "prompt": [5, 17, 42, 9, 101, 33], "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={**server.headers, "X-Request-Id": "x-1"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-x-1" and "x-request-id" not in r.headers
    assert r.json()["usage"]["prompt_tokens_details"] is None
    chat = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.json()["usage"]["prompt_tokens_details"] is None and "x-request-id" not in chat.headers
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert "x-request-id" not in s.headers
        last = [ln for ln in s.iter_lines() if ln.startswith("data: {")][-1]
    assert "prompt_tokens_details" not in json.loads(last[6:])["usage"]
    assert "x-request-id" not in httpx.get(server.url + "/health", timeout=5).headers


def test_cors_is_closed_by_default_and_preflights_skip_the_api_key(server) -> None:
    """vLLM's defaults: no allowed origin, so no Access-Control-Allow-Origin and a preflight refused with 400;
    the preflight is CORS's to answer, not the API key's (vLLM lets OPTIONS through its key check)."""
    attacker = {"Origin": "http://attacker.example"}
    models = httpx.get(server.url + "/v1/models", headers={**server.headers, **attacker}, timeout=10)
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers
    preflight = httpx.options(server.url + "/v1/chat/completions", timeout=10,
                              headers={**attacker, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    assert httpx.get(server.url + "/v1/models", headers=attacker, timeout=10).status_code == 401
