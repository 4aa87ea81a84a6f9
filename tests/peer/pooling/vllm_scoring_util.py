# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/entrypoints/pooling/scoring/util.py: EncoderScoringHfRunner, unchanged but for
# the plumbing (its HfRunner is tests/peer/pooling/vllm_shim.py's). Left out: ColBERTScoringHfRunner (it downloads
# a ColBERT model's linear weights from the Hub) and the image helpers (multimodal scoring, not vendored).
"""vLLM's bi-encoder scoring reference: sentence-transformers' embeddings of each text, their cosine."""

import torch
import torch.nn.functional as F

from tests.peer.pooling.vllm_shim import HfRunner


class EncoderScoringHfRunner(HfRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, is_sentence_transformer=True)

    @torch.inference_mode()
    def predict(self, prompts: list[list[str]], *args, **kwargs):
        hf_embeddings = [self.encode(prompt) for prompt in prompts]
        hf_outputs = [
            F.cosine_similarity(*map(torch.tensor, pair), dim=0)
            for pair in hf_embeddings
        ]
        return torch.as_tensor(hf_outputs)
