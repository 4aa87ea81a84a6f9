"""vLLM's BaseThinkingReasoningParser (vllm/reasoning/basic_parsers.py): reasoning between a start and an end
token (`<think>...</think>`), both single tokens of the vocabulary. A subclass names the two tokens.

The rules, vLLM's, as its tests pin them:
- whole output: a start token, if any, is dropped with what precedes it; no end token means the output is
  all reasoning (the model was cut off, or its template opened `<think>` in the prompt); after the first end
  token is content (None when empty);
- streaming, delta by delta: a delta that is the start or end token alone says nothing; before an end token
  the text is reasoning, after it content; a model that never writes the start token is read as if its
  prompt had;
- the end of reasoning is the last start / end token of the sequence (`is_reasoning_end`), or an end token
  among the step's new ones (`is_reasoning_end_streaming`);
- reasoning tokens are those inside start ... end (nested pairs counted once, a stray end ignored).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

from tokenloom.reasoning.abs_reasoning_parsers import ReasoningParser
from tokenloom.reasoning.protocol import DeltaMessage


class BaseThinkingReasoningParser(ReasoningParser):
    @property
    def start_token(self) -> str:
        raise NotImplementedError

    @property
    def end_token(self) -> str:
        raise NotImplementedError

    @property
    def reasoning_start_str(self) -> str:
        return self.start_token

    @property
    def reasoning_end_str(self) -> str:
        return self.end_token

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        if not self.model_tokenizer:
            raise ValueError("The model tokenizer must be passed to the ReasoningParser constructor during "
                             "construction.")
        if not self.start_token or not self.end_token:
            raise ValueError("start_token and end_token must be defined in subclasses")
        start_token_id = self.vocab.get(self.start_token)
        end_token_id = self.vocab.get(self.end_token)
        if start_token_id is None or end_token_id is None:
            # vLLM's words: the start-up check quotes them (--reasoning-parser ... cannot be used with ...).
            raise RuntimeError(f"{type(self).__name__} reasoning parser could not locate think start/end tokens "
                               "in the tokenizer!")
        self.start_token_id: int = start_token_id
        self.end_token_id: int = end_token_id

    # The engine's questions ------------------------------------------------------------------------
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token_id in reversed(input_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        return self.end_token_id in delta_ids

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        # An end token that is the last id has no content after it (yet).
        if self.end_token_id not in islice(input_ids, 0, max(0, len(input_ids) - 1)):
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1:]

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        count = depth = 0
        for token_id in token_ids:
            if token_id == self.start_token_id:
                depth += 1
            elif token_id == self.end_token_id:
                depth = max(depth - 1, 0)
            elif depth > 0:
                count += 1
        return count

    # The server's questions ------------------------------------------------------------------------
    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        before, start, after = model_output.partition(self.start_token)
        text = after if start else before
        if self.end_token not in text:
            return text, None
        reasoning, _, content = text.partition(self.end_token)
        return reasoning, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if len(delta_token_ids) == 1 and delta_token_ids[0] in (self.start_token_id, self.end_token_id):
            return None
        if self.start_token_id in previous_token_ids:
            if self.end_token_id in delta_token_ids:
                return self._split_at_end(delta_text)
            if self.end_token_id in previous_token_ids:
                return DeltaMessage(content=delta_text)
            return DeltaMessage(reasoning=delta_text)
        if self.start_token_id in delta_token_ids:
            if self.end_token_id in delta_token_ids:
                start = delta_text.find(self.start_token) + len(self.start_token)
                end = delta_text.find(self.end_token)
                content = delta_text[end + len(self.end_token):]
                return DeltaMessage(reasoning=delta_text[start:end], content=content or None)
            return DeltaMessage(reasoning=delta_text)
        # No start token yet: vLLM's base reads this as content (DeepSeek-R1 overrides it).
        return DeltaMessage(content=delta_text)

    def _split_at_end(self, delta_text: str) -> DeltaMessage:
        """A delta holding the end token: reasoning before it, content (None when empty) after it."""
        end = delta_text.find(self.end_token)
        content = delta_text[end + len(self.end_token):]
        return DeltaMessage(reasoning=delta_text[:end], content=content or None)
