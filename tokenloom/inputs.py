"""vLLM's prompt shapes (`vllm.inputs`): what `LLM.generate` and `LLMEngine.add_request` take besides a plain
string. TypedDicts, so a plain dict of the same keys is one too. The models here read text, so the input
processor refuses the keys vLLM's have for other inputs (multi_modal_data, prompt_embeds, ...) by name
rather than run the text alone (engine/input_processor.py)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str  # tokenized with the model's tokenizer (its BOS as the tokenizer adds it)


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]  # run as they are
    prompt: NotRequired[str]  # the text they stand for, handed back as RequestOutput.prompt


PromptType = str | TextPrompt | TokensPrompt | list[int]

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
