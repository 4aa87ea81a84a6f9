"""A tiny reasoning model for tests: tests/tiny_models.py's random Qwen3, its tokenizer given Qwen3's reasoning
and tool-call tokens (added, non-special tokens, as Qwen3's own tokenizer has them) and a ChatML template that
writes Qwen3's empty think block when `enable_thinking` is false. Its answers are random, so tests script them:
`ScriptedOutput` (a custom logits processor, --logits-processors) forces the token ids a request lists in its
extra_args / vllm_xargs "script", then EOS (or, with "free_after_script", lets the model, or its grammar, go on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenloom.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

REASONING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
EOS = 2  # <|im_end|>, as in tests/tiny_models.py
QWEN3_LIKE_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def make_tiny_reasoning_model(tmp_path: str | Path) -> Path:
    """A tiny random Qwen3 whose tokenizer has <think>, </think>, <tool_call>, </tool_call> (ids 320-323)."""
    from tests.tiny_models import TINY_VOCAB, make_tiny_hf_model, make_tiny_tokenizer

    # Room for a tools system prompt, which the tiny tokenizer makes ~500 tokens.
    out = make_tiny_hf_model(tmp_path, arch="qwen3", vocab_size=TINY_VOCAB + len(REASONING_TOKENS),
                             max_position_embeddings=1024)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(REASONING_TOKENS)
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


class ScriptedOutput(LogitsProcessor):
    """A request with extra_args {"script": [ids]} samples exactly those ids, then EOS; with
    {"free_after_script": true} the model (under its grammar, if any) picks what follows."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], bool, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def entry(params: Any, _: Any, outputs: list[int]) -> tuple[list[int], bool, list[int]] | None:
            args = params.extra_args or {}
            return (list(args["script"]), bool(args.get("free_after_script")), outputs) if "script" in args else None

        process_dict_updates(self.rows, batch_update, entry)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (script, free_after, outputs) in self.rows.items():
            position = len(outputs)
            if position >= len(script) and free_after:
                continue
            logits[row] = float("-inf")
            logits[row, script[position] if position < len(script) else EOS] = 0.0
        return logits
