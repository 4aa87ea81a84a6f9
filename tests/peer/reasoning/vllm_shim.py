"""Plumbing for vLLM's reasoning-parser tests (tests/peer/reasoning): vLLM's names for tokenloom's, and local
stand-ins for the Hub tokenizers the tests load.

There is no Hub here, so `AutoTokenizer.from_pretrained(name)` gives, for every model the tests name, the
default model's tokenizer (SmolLM2's: a GPT-2-style byte-level BPE, as Qwen2 / Qwen3's and the DeepSeek-R1
distills' are) with that model's reasoning tokens added the way the model's own tokenizer has them: as added,
non-special tokens (`<think>`, `</think>`, and for Qwen3 `<tool_call>`, `</tool_call>`; ChatML's
`<|im_start|>` / `<|im_end|>` are SmolLM2's own special tokens already). The tests only need those tokens
to be single tokens and the rest of the text to tokenize into pieces whose strings join back to the text.
Each call returns a fresh tokenizer, since a test may add tokens to its own.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

from tokenloom.server.protocol import ChatCompletionRequest  # noqa: F401  (vLLM's, for the tests' requests)

# The reasoning tokens of each model the vendored tests name, as its tokenizer has them.
_THINK = ["<think>", "</think>"]
_ADDED_TOKENS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": _THINK,
    "Qwen/Qwen3-0.6B": [*_THINK, "<tool_call>", "</tool_call>"],
    "Qwen/Qwen3.5-397B-A17B": [*_THINK, "<tool_call>", "</tool_call>"],
    "Qwen/Qwen3-4B-Thinking-2507": [*_THINK, "<tool_call>", "</tool_call>"],
}


@functools.cache
def _default_tokenizer() -> Any:
    """The default model's tokenizer through transformers (tokenloom converts and caches the GGUF's once)."""
    from transformers import AutoTokenizer as _AutoTokenizer

    from tokenloom.model.paths import default_cache_dir, resolve_model_path
    from tokenloom.model.tokenizer import _gguf_cache_entry, load_tokenizer

    path = resolve_model_path(os.environ.get("TOKENLOOM_PEER_MODEL") or None)
    if path.is_file():
        load_tokenizer(path)
        path = _gguf_cache_entry(path, default_cache_dir())
    return _AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class AutoTokenizer:
    @staticmethod
    def from_pretrained(model_name: str, **kwargs: Any) -> Any:
        tokenizer = copy.deepcopy(_default_tokenizer())
        tokenizer.add_tokens(_ADDED_TOKENS[model_name])
        return tokenizer


def is_mistral_tokenizer(tokenizer: Any) -> bool:
    """vLLM's check for its Mistral tokenizer class: tokenloom has none (the Mistral cases are not vendored)."""
    return False
