"""The model's own sampling defaults, as vLLM applies them (`--generation-config auto|vllm`).

`auto` (vLLM's default): a Hugging Face directory's generation_config.json supplies the defaults that
a request's explicit parameters override: temperature, top_p, top_k, min_p, repetition_penalty,
presence_penalty, frequency_penalty and max_new_tokens (as max_tokens), the fields vLLM's
`ModelConfig.get_diff_sampling_param` reads; its
eos_token_id list adds stop tokens (vLLM's `SamplingParams.update_from_generation_config`).
`vllm`: the file is ignored, SamplingParams' own defaults apply. A GGUF file carries no generation
config (as in vLLM).

Qwen2.5/Qwen3 and Gemma ship such defaults (e.g. Qwen3: temperature 0.6, top_p 0.95, top_k 20);
without them tokenloom would sample differently from vLLM for the same request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field (vLLM's get_diff_sampling_param).
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")


@dataclass
class GenerationDefaults:
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> default
    eos_token_ids: list[int] = field(default_factory=list)  # extra stop ids (the model's EOS excluded)

    def sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's defaults (what a request that sets nothing gets)."""
        return SamplingParams(**self.params)

    def apply_eos(self, params: SamplingParams) -> SamplingParams:
        """Add the model's extra EOS ids as stop tokens (unless the request ignores EOS)."""
        if not self.eos_token_ids or params.ignore_eos:
            return params
        extra = [t for t in self.eos_token_ids if t not in (params.stop_token_ids or [])]
        return replace(params, stop_token_ids=list(params.stop_token_ids or []) + extra) if extra else params


def load_generation_defaults(model_path: Path, mode: str, eos_token_id: int | None) -> GenerationDefaults:
    if mode not in MODES:
        raise ValueError(f"generation_config must be one of {', '.join(MODES)}, got {mode!r}")
    path = Path(model_path) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return GenerationDefaults()
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from None
    params = {ours: cfg[theirs] for theirs, ours in _FIELDS.items() if cfg.get(theirs) is not None}
    try:
        SamplingParams(**params)  # a bad value fails here, naming the field, before the engine starts
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    extra = [int(t) for t in eos_ids if t != eos_token_id]
    if params or extra:
        logger.info("default sampling parameters from %s: %s%s (--generation-config vllm ignores them)", path,
                    params, f", extra EOS ids {extra}" if extra else "")
    return GenerationDefaults(params=params, eos_token_ids=extra)


def server_default(defaults: dict[str, Any], name: str, requested: Any, fallback: Any) -> Any:
    """A request field: what the request set, else the model's default, else SamplingParams'."""
    if requested is not None:
        return requested
    return defaults.get(name, fallback)
