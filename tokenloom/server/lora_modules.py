"""`--lora-modules` entries (vLLM's LoRAModulePath) and their parsing: what the command line needs of LoRA
serving, kept apart from serving_models.py so that parsing `tokenloom serve`'s flags imports no web
framework (tests/test_startup.py checks what a start-up imports)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or the JSON object form with "name", "path" and optionally "base_model_name"."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: not JSON: {text!r} ({exc.msg})") from None
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str) or unknown:
            raise ValueError(f"--lora-modules: expected {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}, "
                             f"got {text!r}")
        return LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)
