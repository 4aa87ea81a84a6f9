"""vllm.config.ModelConfig, as far as the peer tests use it: the served model's vocabulary size."""

from __future__ import annotations

import os
from typing import Any


class ModelConfig:
    def __init__(self, model: str, **unused: Any) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        from tokenloom.model.loader import resolve_model_path
        from tokenloom.model.tokenizer import load_tokenizer

        return load_tokenizer(resolve_model_path(os.environ.get("TOKENLOOM_PEER_MODEL"))).vocab_size
