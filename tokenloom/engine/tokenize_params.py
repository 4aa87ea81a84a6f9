"""How a pooling prompt is tokenized, truncated, padded and bounded: vLLM 0.32's TokenizeParams
(vllm/renderers/params.py), the part its pooling front ends use, with its rules and its words.

    truncate_prompt_tokens   keep k tokens (-1: max_model_len); a text is cut by the tokenizer itself (its
                             truncation side, [CLS] ... [SEP] kept), token ids by a slice on the same side
    truncation_side          'left' keeps the last k, 'right' the first k (None: the tokenizer's side); a text
                             given a side is tokenized whole and sliced like token ids
    pad_prompt_tokens        pad with the tokenizer's pad token up to k (-1: max_model_len), after truncating
    max_total_tokens         the bound (max_model_len; an embedding's max_embed_len): a longer prompt is
                             refused with vLLM's "Please reduce the length of the input prompt."

The offline API (LLM.encode's tokenization_kwargs) and the server (a request's truncate_prompt_tokens,
truncation_side, padding) build one of these, so both refuse and cut alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.core.prompt_fit import EMPTY_PROMPT
from tokenloom.exceptions import VLLMValidationError

# The tokenization arguments LLM.encode / embed / classify / score take (vLLM's TokenizeParams.with_kwargs).
TOKENIZATION_KWARGS = ("truncate_prompt_tokens", "truncation_side", "add_special_tokens", "padding",
                       "pad_prompt_tokens", "max_length", "truncation", "do_lower_case")


@dataclass(frozen=True)
class TokenizeParams:
    max_total_tokens: int | None  # None: no bound (chunked processing without max_embed_len)
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    pad_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    do_lower_case: bool = False
    max_total_tokens_param: str = "max_model_len"

    def __post_init__(self) -> None:
        if self.truncation_side not in (None, "left", "right"):
            raise VLLMValidationError("`truncation_side` must be either 'left' or 'right'.",
                                      parameter="truncation_side", value=self.truncation_side)
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1):
            raise VLLMValidationError(f"truncate_prompt_tokens must be -1, a positive int, or None, got {k!r}"[:200],
                                      parameter="truncate_prompt_tokens")
        max_input = self.max_input_tokens
        if max_input is not None and k is not None and k > max_input:
            raise VLLMValidationError(f"truncate_prompt_tokens={k} cannot be greater than "
                                      f"{self.max_total_tokens_param} = {max_input}. Please request a smaller "
                                      "truncation size.", parameter="truncate_prompt_tokens", value=k)

    @property
    def max_input_tokens(self) -> int | None:
        """A pooling request generates nothing: the whole context is its prompt's."""
        return self.max_total_tokens

    @classmethod
    def from_kwargs(cls, max_total_tokens: int | None, kwargs: dict[str, Any] | None) -> TokenizeParams:
        """vLLM's with_kwargs: LLM.encode's tokenization_kwargs (max_length, truncation and padding in
        transformers' names too); an argument it does not know is refused by name."""
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - set(TOKENIZATION_KWARGS))
        if unknown:
            raise VLLMValidationError(f"tokenization_kwargs: unknown argument(s) {', '.join(unknown)} "
                                      f"(known: {', '.join(TOKENIZATION_KWARGS)})", parameter="tokenization_kwargs")
        max_length = kwargs.pop("max_length", max_total_tokens)
        truncate = kwargs.pop("truncate_prompt_tokens", None)
        pad = kwargs.pop("pad_prompt_tokens", None)
        padding = kwargs.pop("padding", None)
        if padding == "max_length":
            pad = max_length
        elif padding not in (None, False, "do_not_pad"):
            raise VLLMValidationError(f"padding must be 'max_length' or 'do_not_pad', got {padding!r}",
                                      parameter="padding")
        truncation = kwargs.pop("truncation", None)
        if truncation in (True, "longest_first"):
            truncate = max_length
        elif truncation not in (None, False, "do_not_truncate"):
            raise VLLMValidationError(f"truncation must be True, False, 'longest_first' or 'do_not_truncate', got "
                                      f"{truncation!r}", parameter="truncation")
        return cls(max_total_tokens, truncate, kwargs.pop("truncation_side", None), pad,
                   kwargs.pop("add_special_tokens", True), kwargs.pop("do_lower_case", False))

    def encode_text(self, tokenizer: Any, text: str) -> list[int]:
        """A text prompt's token ids, truncated and bounded (vLLM's get_encode_kwargs, then the token rules)."""
        if self.do_lower_case:
            text = text.lower()
        hf = getattr(tokenizer, "hf", tokenizer)
        ids = list(hf(text, **self.encode_kwargs())["input_ids"])
        return self.validate_tokens(tokenizer, ids)

    def encode_kwargs(self) -> dict[str, Any]:
        """The tokenizer call's arguments (vLLM's get_encode_kwargs): truncation to k, or to one token past the
        bound so that the length check sees a prompt too long without tokenizing all of a huge text."""
        max_length = self.truncate_prompt_tokens
        if max_length is not None and max_length < 0:
            max_length = self.max_input_tokens
        elif max_length is None and self.max_input_tokens is not None:
            max_length = self.max_input_tokens + 1  # no more than the length check needs to see
        if self.truncation_side is not None and self.truncate_prompt_tokens is not None:
            # The requested side may not be the tokenizer's: tokenize whole, slice in validate_tokens.
            return {"truncation": False, "add_special_tokens": self.add_special_tokens}
        return {"truncation": max_length is not None, "max_length": max_length,
                "add_special_tokens": self.add_special_tokens}

    def validate_tokens(self, tokenizer: Any, tokens: list[int]) -> list[int]:
        """Truncation, then padding, then the length bound (vLLM's order)."""
        tokens = self.truncate(tokenizer, tokens)
        tokens = self._pad(tokenizer, tokens)
        if not tokens:
            raise VLLMValidationError(EMPTY_PROMPT, parameter="prompt")
        max_input = self.max_input_tokens
        if max_input is not None and len(tokens) > max_input:
            # The tokenizer may have cut a text at max_input + 1 tokens: then it holds at least that many.
            qualifier = "at least " if len(tokens) == max_input + 1 else ""
            raise VLLMValidationError(f"This model's maximum context length is {self.max_total_tokens} tokens. "
                                      f"However, your prompt contains {qualifier}{len(tokens)} input tokens, which "
                                      "exceeds this limit even without any output tokens. Please reduce the length "
                                      "of the input prompt.", parameter="input_tokens", value=len(tokens))
        return tokens

    def truncate(self, tokenizer: Any, tokens: list[Any]) -> list[Any]:
        """Keep truncate_prompt_tokens items of `tokens` (or of anything parallel to them) from its side."""
        k = self.truncate_prompt_tokens
        if k is not None and k < 0:
            k = self.max_input_tokens
        if k is None or k >= len(tokens):
            return tokens
        side = self.truncation_side or getattr(tokenizer, "truncation_side", None)
        return tokens[len(tokens) - k:] if side == "left" else tokens[:k]

    def _pad(self, tokenizer: Any, tokens: list[int]) -> list[int]:
        pad_length = self.pad_prompt_tokens
        if pad_length is not None and pad_length < 0:
            pad_length = self.max_input_tokens
        if pad_length is None or pad_length <= len(tokens):
            return tokens
        pad_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad_id is None:
            raise VLLMValidationError("Cannot pad tokens: the tokenizer has no pad token", parameter="padding")
        return tokens + [pad_id] * (pad_length - len(tokens))
