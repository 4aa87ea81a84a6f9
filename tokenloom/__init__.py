"""tokenloom: iteration-level scheduling for LLM inference.

`from tokenloom import LLM, SamplingParams` mirrors `from vllm import LLM, SamplingParams`. The
names load lazily, so importing the pure-Python scheduler core never imports torch.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tokenloom.engine.llm",
    "LLMEngine": "tokenloom.engine.llm_engine",
    "SamplingParams": "tokenloom.sampling_params",
    "RequestOutput": "tokenloom.engine.outputs",
    "CompletionOutput": "tokenloom.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")


__all__ = list(_LAZY)
