# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/test_pooling_params.py, unchanged but for the plumbing: the imports point at
# tokenloom (PoolingParams, tokenloom.config's PoolerConfig, the server's request bodies in
# tokenloom/server/protocol_pooling.py) and at tests/peer/pooling (EmbedModelInfo; ModelConfig, which is tokenloom's
# PoolingInfo of the named model's local stand-in: the Hub is out of reach, tests/peer/pooling/standins.py).
# test_removed_pooling_parameters is a strict xfail: tokenloom's VLLMValidationError is a ValueError, which pydantic
# wraps in its ValidationError (the same message, the same 400); tests/test_pooling.py checks the rule itself.
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from tests.peer.pooling.vllm_shim import ModelConfig
from tests.peer.pooling.vllm_test_utils import EmbedModelInfo
from tokenloom import PoolingParams
from tokenloom.config import PoolerConfig
from tokenloom.exceptions import VLLMValidationError
from tokenloom.server.protocol_pooling import ClassificationRequest, EmbeddingRequest, PoolingRequest

EMBEDDING_MODELS = [
    EmbedModelInfo("intfloat/multilingual-e5-small", is_matryoshka=False),
    EmbedModelInfo(
        "Snowflake/snowflake-arctic-embed-m-v1.5",
        is_matryoshka=True,
        matryoshka_dimensions=[256],
    ),
]

classify_parameters = ["use_activation"]
embed_parameters = ["dimensions", "use_activation"]
step_pooling_parameters = ["step_tag_id", "returned_token_ids"]


@dataclass()
class MockModelConfig:
    pooler_config: PoolerConfig


@pytest.mark.parametrize(
    ("parameter", "value", "message"),
    [
        (
            "normalize",
            False,
            "Parameter `normalize` was removed; use `use_activation` instead.",
        ),
        ("task", "score", "`score` task was removed; use `classify` instead."),
        (
            "task",
            "encode",
            "`encode` task was removed; use `token_embed` or `token_classify` instead.",
        ),
    ],
)
@pytest.mark.xfail(strict=True, reason="tokenloom's VLLMValidationError is also a ValueError "
                   "(tokenloom/exceptions.py), so pydantic wraps the refusal in its ValidationError, vLLM's "
                   "sentence inside (the server's 400 is the same); vLLM's escapes validate_python as itself")
def test_removed_pooling_parameters(parameter: str, value: Any, message: str):
    data = {"input": "hello", parameter: value}
    for request_type in (EmbeddingRequest, ClassificationRequest, PoolingRequest):
        with pytest.raises(VLLMValidationError, match=message):
            TypeAdapter(request_type).validate_python(data)

    # PoolerConfig still raises bare ValueError for `normalize`
    # (wrapped to ValidationError by Pydantic), but `check_removed_pooling_task`
    # raises VLLMValidationError for removed tasks.
    if parameter == "normalize":
        with pytest.raises(ValidationError, match=message) as exc_info:
            TypeAdapter(PoolerConfig).validate_python({parameter: value})
        assert len(exc_info.value.errors()) == 1
    else:
        with pytest.raises(VLLMValidationError, match=message):
            TypeAdapter(PoolerConfig).validate_python({parameter: value})

    if parameter == "task":
        with pytest.raises(VLLMValidationError, match=message):
            PoolingParams(task=value)


def test_embed():
    task = "embed"
    model_config = MockModelConfig(pooler_config=PoolerConfig(seq_pooling_type="CLS"))

    pooling_params = PoolingParams(task=task, use_activation=None)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=True)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=False)
    pooling_params.verify(model_config)

    invalid_parameters = classify_parameters + step_pooling_parameters
    for p in set(invalid_parameters) - set(embed_parameters):
        with pytest.raises(VLLMValidationError):
            pooling_params = PoolingParams(task=task, **{p: True})
            pooling_params.verify(model_config)


@pytest.mark.parametrize("model_info", EMBEDDING_MODELS)
def test_embed_dimensions(model_info: EmbedModelInfo):
    task = "embed"
    model_config = ModelConfig(
        model_info.name,
        tokenizer=model_info.name,
        tokenizer_mode="auto",
        trust_remote_code=False,
        seed=0,
        dtype="float16",
    )

    pooling_params = PoolingParams(task=task, dimensions=None)
    pooling_params.verify(model_config)

    with pytest.raises(VLLMValidationError):
        pooling_params = PoolingParams(task=task, dimensions=1)
        pooling_params.verify(model_config)

    if model_info.is_matryoshka:
        assert model_info.matryoshka_dimensions is not None
        pooling_params = PoolingParams(
            task=task, dimensions=model_info.matryoshka_dimensions[0]
        )
        pooling_params.verify(model_config)


@dataclass()
class MockMatryoshkaModelConfig:
    pooler_config: PoolerConfig
    is_matryoshka: bool = True
    matryoshka_dimensions: list[int] | None = None
    served_model_name: str = "mock-matryoshka-model"
    embedding_size: int = 32


def test_embed_dimensions_matryoshka_without_list_upper_bound():
    task = "embed"
    model_config = MockMatryoshkaModelConfig(
        pooler_config=PoolerConfig(seq_pooling_type="CLS"),
        matryoshka_dimensions=None,
        embedding_size=32,
    )

    PoolingParams(task=task, dimensions=16).verify(model_config)

    with pytest.raises(VLLMValidationError):
        PoolingParams(task=task, dimensions=64).verify(model_config)


@pytest.mark.parametrize("task", ["classify"])
def test_classify(task):
    model_config = MockModelConfig(pooler_config=PoolerConfig(seq_pooling_type="CLS"))

    pooling_params = PoolingParams(task=task, use_activation=None)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=True)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=False)
    pooling_params.verify(model_config)

    invalid_parameters = embed_parameters + step_pooling_parameters
    for p in set(invalid_parameters) - set(classify_parameters):
        with pytest.raises(VLLMValidationError):
            pooling_params = PoolingParams(task=task, **{p: True})
            pooling_params.verify(model_config)


@pytest.mark.parametrize("pooling_type", ["ALL", "STEP"])
def test_token_embed(pooling_type: str):
    task = "token_embed"
    model_config = MockModelConfig(
        pooler_config=PoolerConfig(tok_pooling_type=pooling_type)
    )

    pooling_params = PoolingParams(task=task, use_activation=None)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=True)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=False)
    pooling_params.verify(model_config)

    invalid_parameters = classify_parameters
    if pooling_type != "STEP":
        invalid_parameters = classify_parameters + step_pooling_parameters

    for p in set(invalid_parameters) - set(embed_parameters):
        with pytest.raises(VLLMValidationError):
            pooling_params = PoolingParams(task=task, **{p: True})
            pooling_params.verify(model_config)


@pytest.mark.parametrize("pooling_type", ["ALL", "STEP"])
def test_token_classify(pooling_type: str):
    task = "token_classify"
    model_config = MockModelConfig(
        pooler_config=PoolerConfig(tok_pooling_type=pooling_type)
    )

    pooling_params = PoolingParams(task=task, use_activation=None)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=True)
    pooling_params.verify(model_config)

    pooling_params = PoolingParams(task=task, use_activation=False)
    pooling_params.verify(model_config)

    invalid_parameters = embed_parameters
    if pooling_type != "STEP":
        invalid_parameters = embed_parameters + step_pooling_parameters

    for p in set(invalid_parameters) - set(classify_parameters):
        with pytest.raises(VLLMValidationError):
            pooling_params = PoolingParams(task=task, **{p: True})
            pooling_params.verify(model_config)
