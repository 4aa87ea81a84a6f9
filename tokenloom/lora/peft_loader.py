"""Read a PEFT LoRA adapter and check it against the base model (vLLM's `LoRAModel.from_local_checkpoint`).

An adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...)
and `adapter_model.safetensors` (or the older `adapter_model.bin`), whose tensors are named
`base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). The delta of a target linear is `x @ A^T @ B^T * scaling`, with
scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

Everything is checked here, once, so that a bad adapter is refused with its reason when it is added,
never in the middle of a step: rank above `max_lora_rank`, a target the engine does not build
(embeddings, the LM head: "not supported"), DoRA, trained biases, `modules_to_save`, a layer index
or a shape that does not match the base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The linears an adapter may target, by PEFT's module name (Llama / Qwen2 names).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Targets PEFT can train that tokenloom does not apply (vLLM builds embeddings / LM-head LoRA; not yet here).
UNSUPPORTED_MODULES = ("embed_tokens", "lm_head")

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\."
                  r"lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoRALayerWeights:
    """One target linear's adapter: A [r, in], B [out, r] (float32, on the host), and its scaling."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAModel:
    """A loaded adapter: its id, rank and weights per (layer index, module name)."""

    id: int
    name: str
    rank: int
    loras: dict[tuple[int, str], LoRALayerWeights] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(w.lora_a.numel() * 4 + w.lora_b.numel() * 4 for w in self.loras.values())


class LoRAError(ValueError):
    """An adapter that cannot run on this engine; the message says why."""


class LoRANotFoundError(LoRAError):
    """No adapter at the path: it does not exist, or holds no adapter_config.json (vLLM's
    LoRAAdapterNotFoundError, a 404 on the server)."""


def _exists(path: Path, kind: str = "") -> bool:
    """Whether `path` exists (as a directory: kind "dir"); False for a name the OS cannot even look up: a client
    may send any string as lora_path, and Path.is_dir raises OSError for a name over NAME_MAX (a 500 once)."""
    try:
        return path.is_dir() if kind == "dir" else path.exists()
    except (OSError, ValueError):
        return False


def _read_config(path: Path, name: str) -> dict[str, Any]:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRANotFoundError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {cfg_file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (only LORA)")
    return cfg


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except Exception as exc:  # a truncated or foreign file: say which
            raise LoRAError(f"LoRA adapter {name!r}: cannot read {st}: {exc}") from None
    pt = path / "adapter_model.bin"
    if pt.is_file():
        try:
            return torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise LoRAError(f"LoRA adapter {name!r}: cannot read {pt}: {exc}") from None
    raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors (or adapter_model.bin) in {path}")


def _check_options(cfg: dict[str, Any], name: str) -> None:
    if cfg.get("use_dora"):
        raise LoRAError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"LoRA adapter {name!r}: trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not supported "
                        "(whole replaced modules, e.g. a new LM head)")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError(f"LoRA adapter {name!r}: fan_in_fan_out (Conv1D, GPT-2 style) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: per-module {key} is not supported (one r and lora_alpha)")
    targets = cfg.get("target_modules")
    named = [targets] if isinstance(targets, str) else targets or []
    if not isinstance(named, list) or not all(isinstance(t, str) for t in named):
        raise LoRAError(f"LoRA adapter {name!r}: target_modules must be a module name or a list of them, "
                        f"got {str(targets)[:80]}")
    bad = [t for t in named if t in UNSUPPORTED_MODULES]
    if bad:
        raise LoRAError(f"LoRA adapter {name!r}: target module {bad[0]!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_MODULES)})")


def load_peft_adapter(path: str | Path, lora_id: int, name: str, *, num_layers: int,
                      target_shapes: dict[str, tuple[int, int]], max_lora_rank: int) -> LoRAModel:
    """The adapter at `path`, checked: `target_shapes` maps each supported module name to the base
    linear's (in_features, out_features); raises LoRAError saying what does not fit."""
    path = Path(path)
    if not _exists(path, "dir"):
        if not _exists(path):
            raise LoRANotFoundError(f"LoRA adapter {name!r}: {path} does not exist")
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory")
    cfg = _read_config(path, name)
    _check_options(cfg, name)
    r = cfg.get("r")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise LoRAError(f"LoRA adapter {name!r}: LoRA rank {r} is greater than max_lora_rank {max_lora_rank} "
                        "(raise --max-lora-rank)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    if not abs(scaling) <= _FLOAT32_MAX:  # NaN or infinite in the float32 the kernels compute in
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha {alpha!r} with r {r} is not a finite scaling")
    tensors = _read_tensors(path, name)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            module = next((u for u in UNSUPPORTED_MODULES if f"{u}." in key), None)
            if module is not None:  # e.g. ...embed_tokens.lora_embedding_A, ...lm_head.lora_A.weight
                raise LoRAError(f"LoRA adapter {name!r}: a LoRA on {module} ({key}) is not supported "
                                f"(supported targets: {', '.join(SUPPORTED_MODULES)})")
            raise LoRAError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (expected "
                            "base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight)")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES or module not in target_shapes:
            raise LoRAError(f"LoRA adapter {name!r}: target module {module!r} ({key}) is not supported "
                            f"(supported: {', '.join(m for m in SUPPORTED_MODULES if m in target_shapes)})")
        if layer >= num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key} is for layer {layer}, but the base model has "
                            f"{num_layers} layers (an adapter for another base model?)")
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise LoRAError(f"LoRA adapter {name!r}: {path} holds no LoRA weights")
    model = LoRAModel(id=lora_id, name=name, rank=r)
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has lora_{next(iter(pair))} without its other half")
        a, b = pair["A"], pair["B"]
        in_f, out_f = target_shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
            raise LoRAError(f"LoRA adapter {name!r}: {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            "are not a rank-r pair ([r, in] and [out, r])")
        if a.shape[0] > max_lora_rank:
            raise LoRAError(f"LoRA adapter {name!r}: {where}: LoRA rank {a.shape[0]} is greater than "
                            f"max_lora_rank {max_lora_rank}")
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise LoRAError(f"LoRA adapter {name!r}: {where}: shapes lora_A {tuple(a.shape)}, lora_B "
                            f"{tuple(b.shape)} do not match the base model's {module} ({out_f} x {in_f}: "
                            f"expected lora_A [r, {in_f}], lora_B [{out_f}, r]); is the adapter for this "
                            "base model?")
        a, b = a.float().contiguous(), b.float().contiguous()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            # They would turn every logit of a request using the adapter into NaN (a grammar then
            # rejects whatever is sampled): refused here, where the client learns which file is broken.
            raise LoRAError(f"LoRA adapter {name!r}: {where} holds NaN or infinite weights (in float32)")
        model.loras[(layer, module)] = LoRALayerWeights(a, b, scaling)
    return model
