"""vLLM's hf_overrides and disable_sliding_window: what engine arguments change in a model's configuration
before the model is built (vLLM's ModelConfig applies both, in that order).

    config.json (a Hugging Face directory)  ─┐ hf_overrides: a dict, or a callable resolved first to the dict of
    a GGUF's metadata in HF's names         ─┘ what it changed  →  config_from_hf  →  ModelConfig
        (model/hf.py hf_dict_from_config,                          →  disable_sliding_window: no window, the
         override_gguf_config)                                         context capped at it

Every place that reads a model's config goes through here with the engine's `ModelOverrides`: the engine core's
load, the tensor-parallel workers' (which get the resolved dict), pooling's reads of the config (matryoshka
dimensions, the architecture that picks the runner), the BERT loader, the simulator's profiler. A key the
decoder does not read still reaches every reader of the Hugging Face config, as in vLLM.

An overridden num_hidden_layers below the checkpoint's loads its first layers (the later ones are not read, and
the start-up log says so): vLLM's own tests lower it with load_format="dummy" (random weights, not built here),
and vLLM refuses a real checkpoint with more layers than its config ("There is no module or parameter named
..."); tokenloom runs the truncated model instead, which is what such a test needs. layer_types (one entry per
layer) keeps its first entries then, as vLLM's models index it by layer.

Pure Python (torch-free), importing no other loader module: the engine's front end resolves a callable before any
process starts (model/loader.py resolve_hf_overrides).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenloom.model.config import ModelConfig

logger = logging.getLogger(__name__)

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


def apply_hf_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (a config.json) with `overrides` applied as vLLM's ModelConfig applies a dict: a value sets its key
    (config.update), and a dict given for a nested config (text_config, vision_config: a dict with a model_type)
    updates it key by key, recursively (vLLM's _update_nested); any other dict value replaces the key's whole
    value (rope_parameters). A lowered num_hidden_layers keeps the first entries of layer_types. `cfg` is left
    as it was."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and "model_type" in current:
            _update_nested(current, value)
        else:
            out[key] = copy.deepcopy(value)
    layers, layer_types = out.get("num_hidden_layers"), out.get("layer_types")
    if ("num_hidden_layers" in overrides and "layer_types" not in overrides and isinstance(layers, int)
            and isinstance(layer_types, list) and 0 < layers < len(layer_types)):
        out["layer_types"] = layer_types[:layers]
    return out


def _update_nested(target: dict[str, Any], updates: dict[str, Any]) -> None:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _update_nested(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def read_hf_config(path: Path, overrides: ModelOverrides | None = None) -> dict[str, Any]:
    """A model's Hugging Face config as the engine sees it: its config.json ({} for a GGUF file, whose config is
    its metadata) with the engine's hf_overrides applied, so that what pooling and the runner choice read (the
    architecture, matryoshka_dimensions, num_labels) is what vLLM's hf_config would say."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text()) if path.is_dir() and cfg_file.is_file() else {}
    return overrides.hf_config(cfg) if overrides is not None else cfg


@dataclass(frozen=True)
class ModelOverrides:
    """The engine arguments that change the model's config: hf_overrides (a dict here; a callable is resolved by
    `resolve_hf_overrides` first) and disable_sliding_window. Picklable: workers get it as it is."""

    hf_overrides: dict[str, Any] = field(default_factory=dict)
    disable_sliding_window: bool = False

    @classmethod
    def of(cls, hf_overrides: dict[str, Any] | None, disable_sliding_window: bool = False) -> ModelOverrides | None:
        """The overrides an engine config asks for (its hf_overrides already a dict), or None when there are none."""
        if not hf_overrides and not disable_sliding_window:
            return None
        return cls(dict(hf_overrides or {}), disable_sliding_window)

    def hf_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """A config.json with hf_overrides applied (vLLM's semantics: apply_hf_overrides)."""
        return apply_hf_overrides(cfg, self.hf_overrides) if self.hf_overrides else cfg

    def finish(self, config: ModelConfig) -> ModelConfig:
        """disable_sliding_window, as vLLM's ModelConfig: the window is dropped (every layer attends to the whole
        sequence; Gemma 3's sliding layers keep their local rope base, by layer type) and the context is capped
        at the window when that is shorter (vLLM's derived max_model_len, `sliding_window` its key). A model
        without a window is unchanged."""
        if self.hf_overrides:
            logger.info("hf_overrides applied to %s's config: %s", config.name, _shown(self.hf_overrides))
        if not self.disable_sliding_window or config.sliding_window is None:
            return config
        window = config.sliding_window
        cap = window if window < config.context_length else config.max_model_len_cap
        logger.info("disable_sliding_window: %s's %d-token sliding window is off (full attention on every layer)%s",
                    config.name, window, f", max_model_len capped at {window}" if cap == window else "")
        return replace(config, sliding_window=None, max_model_len_cap=cap)

    def drops_layer(self, index: int, config: ModelConfig) -> bool:
        """A checkpoint layer past an overridden num_hidden_layers: not loaded."""
        return "num_hidden_layers" in self.hf_overrides and index >= config.num_hidden_layers

    def drops_tensor(self, hf_name: str, config: ModelConfig) -> bool:
        """An HF-named tensor (model.layers.N...) of a layer that is not loaded."""
        m = _HF_LAYER.match(hf_name)
        return m is not None and self.drops_layer(int(m.group(1)), config)

    def drops_gguf_tensor(self, gguf_name: str, config: ModelConfig) -> bool:
        """A GGUF tensor (blk.N...) of a layer that is not loaded, before it is read."""
        m = _GGUF_LAYER.match(gguf_name)
        return m is not None and self.drops_layer(int(m.group(1)), config)

    def fingerprint(self) -> dict[str, Any]:
        """What the overrides add to a KV fingerprint (kv_transfer/spec.py): blocks computed under other overrides
        hold other numbers. Empty without overrides, so the fingerprint of a plain engine is unchanged."""
        out: dict[str, Any] = {}
        if self.hf_overrides:
            out["hf_overrides"] = json.dumps(self.hf_overrides, sort_keys=True, default=repr)
        if self.disable_sliding_window:
            out["disable_sliding_window"] = True
        return out


def note_dropped_layers(path: Path, config: ModelConfig, overrides: ModelOverrides | None, dropped: int) -> None:
    """The start-up log's line for the layers an overridden num_hidden_layers left unread."""
    if overrides is not None and dropped:
        logger.warning("%s: hf_overrides num_hidden_layers=%d: %d tensors of the checkpoint's later layers are not "
                       "loaded; the model runs its first %d layers (vLLM refuses a checkpoint with more layers than "
                       "its config unless load_format='dummy')", path.name, config.num_hidden_layers, dropped,
                       config.num_hidden_layers)


def run_hf_overrides_callable(fn: Callable[[Any], Any], base: dict[str, Any]) -> dict[str, Any]:
    """vLLM's hf_overrides_fn as a dict: `fn` run once on the model's Hugging Face config `base` (a transformers
    config object, as vLLM gives it: the family's class where transformers knows the model_type), and the keys
    it changed kept. What the engine processes and workers then apply, so a callable never has to be pickled
    (model/loader.py resolve_hf_overrides reads `base`)."""
    config = _transformers_config(base)
    before = config.to_dict()
    result = fn(config)
    from transformers import PretrainedConfig

    if not isinstance(result, PretrainedConfig):
        raise ValueError(f"hf_overrides: the callable must return the Hugging Face config it was given (a "
                         f"transformers PretrainedConfig), got {type(result).__name__}")
    after = result.to_dict()
    changed = {k: v for k, v in after.items() if k not in before or before[k] != v}
    logger.info("hf_overrides callable %s changed %s", getattr(fn, "__name__", fn), _shown(changed) or "nothing")
    return changed


def _transformers_config(cfg: dict[str, Any]) -> Any:
    """A transformers config object for `cfg`: the model_type's own class (LlamaConfig, ...) when transformers
    has it, else a plain PretrainedConfig holding every key."""
    import warnings

    from transformers import AutoConfig, PretrainedConfig

    kwargs = {k: v for k, v in copy.deepcopy(cfg).items() if k != "model_type"}
    with warnings.catch_warnings():  # transformers' notes on older spellings (rope_scaling) are not the user's
        warnings.simplefilter("ignore")
        try:
            return AutoConfig.for_model(cfg.get("model_type", ""), **kwargs)
        except Exception:  # noqa: BLE001 - an unknown model_type, or a value its class's strict checks refuse
            try:
                return PretrainedConfig(**kwargs)
            except Exception as exc:  # noqa: BLE001 - transformers' own validation, in its words
                raise ValueError(f"hf_overrides: transformers cannot make a config object of this model's config "
                                 f"for the callable ({exc}); give hf_overrides as a dict instead") from None


def _shown(overrides: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    return text if len(text) <= 300 else text[:297] + "..."
