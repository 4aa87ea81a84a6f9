# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0: check_embeddings_close, matryoshka_fy, softmax, ModelInfo / EmbedModelInfo
# (tests/models/utils.py; ModelInfo keeps the fields the pooling tests read, its pooling types spelled as strings)
# and float_embeddings, run_embedding_correctness_test (tests/models/language/pooling/embed_utils.py), unchanged
# but for the plumbing: the HfRunner and EmbeddingResponse types are tokenloom's stand-ins.
"""vLLM's test helpers that the vendored pooling tests call."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def check_embeddings_close(
    *,
    embeddings_0_lst: Sequence[list[float]],
    embeddings_1_lst: Sequence[list[float]],
    name_0: str,
    name_1: str,
    tol: float = 1e-3,
) -> None:
    assert len(embeddings_0_lst) == len(embeddings_1_lst)

    for prompt_idx, (embeddings_0, embeddings_1) in enumerate(
        zip(embeddings_0_lst, embeddings_1_lst)
    ):
        assert len(embeddings_0) == len(embeddings_1), (
            f"Length mismatch: {len(embeddings_0)} vs. {len(embeddings_1)}"
        )

        sim = F.cosine_similarity(
            torch.tensor(embeddings_0), torch.tensor(embeddings_1), dim=0
        )

        fail_msg = (
            f"Test{prompt_idx}:"
            f"\nCosine similarity: \t{sim:.4f}"
            f"\n{name_0}:\t{embeddings_0[:16]!r}"
            f"\n{name_1}:\t{embeddings_1[:16]!r}"
        )

        assert sim >= 1 - tol, fail_msg


def matryoshka_fy(tensor: torch.Tensor, dimensions: int):
    tensor = torch.tensor(tensor)
    tensor = tensor[..., :dimensions]
    tensor = F.normalize(tensor, p=2, dim=1)
    return tensor


def softmax(data):
    if data.shape[-1] == 1:
        return F.sigmoid(data)
    else:
        return F.softmax(data, dim=-1)


@dataclass
class ModelInfo:
    name: str
    revision: str | None = None
    architecture: str = ""
    dtype: str = "auto"
    max_model_len: int | None = None
    hf_dtype: str = "float32"
    hf_overrides: dict[str, Any] | None = None
    seq_pooling_type: str | None = None
    tok_pooling_type: str | None = None
    attn_type: str | None = None
    is_prefix_caching_supported: bool | None = None
    is_chunked_prefill_supported: bool | None = None
    enable_test: bool = True


@dataclass
class EmbedModelInfo(ModelInfo):
    mteb_score: float | None = None
    # Per-model MTEB score tolerance; falls back to MTEB_EMBED_TOL.
    mteb_tol: float | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None


def float_embeddings(response: Any) -> list[list[float]]:
    embeddings = []
    for d in response.data:
        assert isinstance(d.embedding, list)
        embeddings.append(d.embedding)
    return embeddings


def run_embedding_correctness_test(
    hf_model: Any,
    inputs: list[str],
    vllm_outputs: Sequence[list[float]],
    dimensions: int | None = None,
):
    hf_outputs = hf_model.encode(inputs)
    if dimensions:
        hf_outputs = matryoshka_fy(hf_outputs, dimensions)

    check_embeddings_close(
        embeddings_0_lst=hf_outputs,
        embeddings_1_lst=vllm_outputs,
        name_0="hf",
        name_1="vllm",
        tol=1e-2,
    )
