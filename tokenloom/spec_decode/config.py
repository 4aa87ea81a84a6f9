"""SpeculativeConfig: vLLM 0.32's names, defaults and checks (vllm/config/speculative.py).

Built from `--speculative-config JSON` or `LLM(speculative_config={...})`, checked before the model
loads. Only the n-gram proposer ("prompt lookup") runs here; vLLM's other methods are named in the
error so that a config written for vLLM fails clearly instead of silently doing nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from tokenloom.config import ConfigError

SUPPORTED_METHODS = ("ngram",)
# vLLM 0.32's other methods (SpeculativeMethod): recognised, refused with a clear message.
_VLLM_ONLY_METHODS = (
    "ngram_gpu", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
    "extract_hidden_states", "mtp", "dflash", "dspark",
)


@dataclass
class SpeculativeConfig:
    """Speculative decoding with n-gram drafts.

    `num_speculative_tokens` (K > 0): drafts proposed per request per step. `prompt_lookup_min/max`:
    the n-gram lengths matched against the request's own context; neither set -> both 5, one set ->
    the other copies it (vLLM's rule; its docstring's "min defaults to 1" is not what it does).

    tokenloom's own, off by default (then every decision is vLLM's):
    `adaptive`: stop drafting while the batch is compute-bound or acceptance is low
    (tokenloom/spec_decode/adaptive.py); `adaptive_min_acceptance` and `adaptive_max_batch_tokens`
    are its thresholds.
    """

    num_speculative_tokens: int | None = None
    method: str | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = False
    adaptive_min_acceptance: float = 0.2
    adaptive_max_batch_tokens: int = 256

    def __post_init__(self) -> None:
        # vLLM: method None + model "ngram" selects ngram; method None otherwise means draft_model.
        if self.method is None:
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if not isinstance(self.method, str) or self.method not in SUPPORTED_METHODS:
            if self.method in _VLLM_ONLY_METHODS:
                hint = "a draft model" if self.method == "draft_model" else f"method {self.method!r}"
                raise ConfigError(
                    f"speculative_config.method: {hint} is not supported by tokenloom; use "
                    '{"method": "ngram", "num_speculative_tokens": K}'
                )
            raise ConfigError(
                f"speculative_config.method must be one of {', '.join(SUPPORTED_METHODS)}, got {self.method!r}"
            )
        if self.num_speculative_tokens is None:
            raise ConfigError("speculative_config.num_speculative_tokens must be provided (an integer > 0)")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 1)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise ConfigError(
                f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.model is None:
            self.model = "ngram"
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if not 0.0 <= float(self.adaptive_min_acceptance) <= 1.0:
            raise ConfigError(
                f"speculative_config.adaptive_min_acceptance must be in [0, 1], got {self.adaptive_min_acceptance}"
            )
        _check_int("adaptive_max_batch_tokens", self.adaptive_max_batch_tokens, 1)

    # vLLM's sizing (config/speculative.py:1888, config/vllm.py:615): n-gram drafts need no
    # lookahead KV slots and no extra drafting slots in the input budget.
    @property
    def num_lookahead_tokens(self) -> int:
        return 0

    @property
    def max_num_new_slots_for_drafting(self) -> int:
        return 0

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a SpeculativeConfig, a dict, a JSON string, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})"
            )
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"speculative_config.{name} must be >= {minimum}, got {value}")


def check_long_prefill_threshold(threshold: int, spec: SpeculativeConfig | None) -> None:
    """vLLM fails an assertion (scheduler.py:1155, 1371) when a padded first decode (1 + K tokens)
    meets a long_prefill_token_threshold below 1 + K; refuse that configuration at start-up."""
    if spec is None or threshold <= 0:
        return
    k = spec.num_speculative_tokens
    if threshold < 1 + k:  # type: ignore[operator]
        raise ConfigError(
            f"long_prefill_token_threshold={threshold} is below 1 + num_speculative_tokens = {1 + k} "
            "(a decode with its drafts must fit one chunk; vLLM's scheduler fails an assertion here); "
            f"raise it to >= {1 + k} or set it to 0"
        )
