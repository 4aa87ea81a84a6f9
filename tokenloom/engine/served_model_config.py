"""vLLM's `LLM.model_config`, the part of vLLM's ModelConfig that code written for vLLM reads from an LLM: the
model's name and context, which runner it got, and for a pooling model its pooling description (embedding size,
pooler config, matryoshka sizes: tokenloom's PoolingInfo, tokenloom/engine/pooling.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.engine.pooling import PoolingInfo


@dataclass(frozen=True)
class ServedModelConfig:
    model: str
    served_model_name: str
    max_model_len: int
    runner_type: str  # "generate" or "pooling"
    pooling: PoolingInfo | None = None
    hf_config: Any = None  # the model's own config (tokenloom/model/config.py), when the engine runs in-process

    @property
    def pooler_config(self) -> Any:
        return None if self.pooling is None else self.pooling.pooler_config

    @property
    def embedding_size(self) -> int:
        """An embedding's length (vLLM's): the pooling model's, else the hidden size."""
        if self.pooling is not None:
            return self.pooling.embedding_size
        return int(getattr(self.hf_config, "hidden_size", 0))

    @property
    def is_matryoshka(self) -> bool:
        return self.pooling is not None and self.pooling.is_matryoshka

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return None if self.pooling is None else self.pooling.matryoshka_dimensions
