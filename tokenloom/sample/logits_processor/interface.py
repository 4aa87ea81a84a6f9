"""The logits processor interface, vLLM V1's (vllm/v1/sample/logits_processor/interface.py), name for name.

A custom logits processor works on the whole batch at once and keeps its own view of it: which request sits in
which row of the logits tensor. The engine tells it how the batch changed before every step
(`update_state(BatchUpdate | None)`), then hands it the step's logits (`apply`). Rows follow vLLM's persistent
batch: a request keeps its row while it runs; when requests leave, the last rows move down into the holes
(`MoveDirectionality.UNIDIRECTIONAL`), and new requests take the lowest free rows first.

What tokenloom passes as vLLM's `vllm_config` is a `LogitsProcessorConfig` (below): the engine's scheduler,
cache and parallel configs, and a model config with vLLM's `get_vocab_size()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from tokenloom.config import CacheConfig, ParallelConfig, SchedulerConfig, StructuredOutputsConfig
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class MoveDirectionality(Enum):
    # A request moved from row a to row b (row a is left empty).
    UNIDIRECTIONAL = auto()
    # The requests of rows a and b swapped rows.
    SWAP = auto()


# A removed request's row.
RemovedRequest = int

# A request added to the batch: (row, its params, its prompt's token ids, its output token ids). The output list
# is the engine's own, appended to as the request samples: a processor that keeps it sees every new token.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]

# (row a, row b, how it moved).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step. Apply the changes in this order: removed, added, moved
    (an added or moved request may take a row that a removed one left)."""

    batch_size: int  # requests in the batch after the changes (the logits tensor's rows)
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM V1's batch-level logits processor. Subclasses implement `__init__(vllm_config, device,
    is_pin_memory)`, `apply`, `is_argmax_invariant` and `update_state`; `validate_params` is optional."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Check a request's params (its `extra_args` above all) when it is added. Raise VLLMValidationError
        (tokenloom.exceptions), or a ValueError, which the engine turns into one: the request alone is
        refused (a 400 from the server, a ValueError from LLM.generate)."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """`vllm_config`: a LogitsProcessorConfig; `device`: where the logits live; `is_pin_memory`: whether
        host tensors may be pinned (CUDA)."""
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits, [batch_size, vocab] float32, a row per request in the batch: return them
        processed (changing them in place is allowed)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token is the most likely one. Such a processor runs only
        when some request samples randomly, after temperature, and greedy requests ignore it (vLLM's rule)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step; `batch_update` is None when the batch did not change."""
        raise NotImplementedError


@dataclass(frozen=True)
class ProcessorModelConfig:
    """The part of vLLM's ModelConfig a processor may read."""

    model: str  # the model's path or name
    vocab_size: int  # the logits' width
    max_model_len: int
    dtype: str  # the model's run dtype ("float32", "bfloat16")
    seed: int = 0
    runner_type: str = "generate"

    def get_vocab_size(self) -> int:
        """vLLM's ModelConfig.get_vocab_size()."""
        return self.vocab_size


@dataclass(frozen=True)
class LogitsProcessorConfig:
    """What tokenloom passes as vLLM's `vllm_config`, with the attribute names vLLM's VllmConfig has:
    `scheduler_config.max_num_seqs` bounds the batch (the rows a processor may see), `model_config` gives the
    vocabulary size. `speculative_config` is always None: custom processors refuse speculative decoding."""

    model_config: ProcessorModelConfig
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: None = None
