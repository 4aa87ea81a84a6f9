"""`--reasoning-parser deepseek_r1` (vLLM's DeepSeekR1ReasoningParser): `<think>...</think>`, for DeepSeek-R1
and its distills (Qwen2 / Llama files here), whose newer chat templates write the `<think>` into the prompt,
so the output starts inside the reasoning and only the `</think>` shows. Streaming therefore reads text
before any `</think>` as reasoning even when no `<think>` was generated (the base class reads it as content).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.reasoning.basic_parsers import BaseThinkingReasoningParser
from tokenloom.reasoning.protocol import DeltaMessage


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    @property
    def start_token(self) -> str:
        return "<think>"

    @property
    def end_token(self) -> str:
        return "</think>"

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        ret = super().extract_reasoning_streaming(previous_text, current_text, delta_text, previous_token_ids,
                                                  current_token_ids, delta_token_ids)
        started = self.start_token_id in previous_token_ids or self.start_token_id in delta_token_ids
        if ret is None or started:
            return ret
        # The prompt opened the reasoning: before the end token it is reasoning, after it content.
        if self.end_token_id in delta_token_ids:
            return self._split_at_end(delta_text)
        if self.end_token_id in previous_token_ids:
            return DeltaMessage(content=delta_text)
        return DeltaMessage(reasoning=delta_text)
