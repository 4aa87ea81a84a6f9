"""--generation-config auto|vllm: the model's generation_config.json as default sampling parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloom.config import ConfigError, EngineConfig, engine_args
from tokenloom.engine.generation_config import load_generation_defaults
from tokenloom.sampling_params import SamplingParams
from tokenloom.server.params import chat_params
from tokenloom.server.protocol import ChatCompletionRequest

QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _model_dir(tmp_path: Path, gen: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_auto_reads_defaults_and_extra_eos(tmp_path: Path) -> None:
    d = load_generation_defaults(_model_dir(tmp_path, {**QWEN3_GENERATION, "max_new_tokens": 64}), "auto", 151645)
    assert d.params == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert d.eos_token_ids == [151643]  # the tokenizer's EOS is not repeated
    p = d.sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 64)
    assert d.apply_eos(SamplingParams(stop_token_ids=[7])).stop_token_ids == [7, 151643]
    assert not d.apply_eos(SamplingParams(ignore_eos=True)).stop_token_ids


def test_vllm_mode_and_missing_file_give_plain_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(_model_dir(tmp_path, QWEN3_GENERATION), "vllm", 1).params == {}
    assert load_generation_defaults(tmp_path / "nowhere", "auto", 1).params == {}


def test_request_fields_override_model_defaults(tmp_path: Path) -> None:
    d = load_generation_defaults(_model_dir(tmp_path, {**QWEN3_GENERATION, "max_new_tokens": 50}), "auto", 151645)
    msgs = [{"role": "user", "content": "hi"}]
    unset = chat_params(ChatCompletionRequest(messages=msgs), 10, 1000, 32000, 20, d.params)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.95, 20, 50)
    explicit = chat_params(ChatCompletionRequest(messages=msgs, temperature=0.0, top_k=5, max_tokens=7), 10, 1000,
                           32000, 20, d.params)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.max_tokens) == (0.0, 0.95, 5, 7)
    plain = chat_params(ChatCompletionRequest(messages=msgs), 10, 1000, 32000, 20, {})
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 990)


def test_penalty_defaults_as_vllm(tmp_path: Path) -> None:
    # vLLM 0.32's get_diff_sampling_param reads presence_penalty and frequency_penalty too, and its chat,
    # completion and Responses requests fall back to them (vLLM's test_penalty_default_resolution.py, which the
    # HTTP-level peer run had checked against vLLM's own request classes); tokenloom took 0.0 for both.
    d = load_generation_defaults(_model_dir(tmp_path, {"presence_penalty": 1.5, "frequency_penalty": 0.5}), "auto",
                                 None)
    assert d.params == {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    msgs = [{"role": "user", "content": "hi"}]
    unset = chat_params(ChatCompletionRequest(messages=msgs), 10, 1000, 32000, 20, d.params)
    assert (unset.presence_penalty, unset.frequency_penalty) == (1.5, 0.5)
    explicit = chat_params(ChatCompletionRequest(messages=msgs, presence_penalty=0.2), 10, 1000, 32000, 20, d.params)
    assert (explicit.presence_penalty, explicit.frequency_penalty) == (0.2, 0.5)
    assert d.sampling_params().presence_penalty == 1.5


def test_bad_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        load_generation_defaults(_model_dir(tmp_path, {"temperature": -1}), "auto", None)
    with pytest.raises(ConfigError, match="generation_config"):
        EngineConfig(generation_config="hf")
    assert any(a.name == "generation_config" and a.choices == ("auto", "vllm") for a in engine_args())
