"""`--reasoning-parser qwen3` (vLLM 0.32's Qwen3 parser engine, read for its reasoning: vllm/parser/qwen3.py).

Qwen3 thinks by default: the output starts inside the reasoning (Qwen3.5 and the -Thinking models' templates
write the `<think>` into the prompt; the older ones let the model write it, swallowed here), `</think>` ends
it, and a `<tool_call>` straight out of the thinking ends it too and is content (the tool parser reads it).
So an output with no `</think>` is all reasoning: the model was cut off mid-thought. With
`chat_template_kwargs={"enable_thinking": false}` the template writes an empty think block into the prompt
and the whole output is content. `is_reasoning_end` looks back only to the last turn's start (`<|im_start|>`
/ `<|im_end|>`), so an earlier turn's `</think>` does not count.
"""

from __future__ import annotations

from typing import Any

from tokenloom.reasoning.tag_reasoning_parser import ReasoningFormat, TagReasoningParser

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
CHATML_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


def qwen3_format(thinking: bool) -> ReasoningFormat:
    return ReasoningFormat(start=THINK_START, end=THINK_END, implicit_ends=(TOOL_CALL_START,),
                           turn_boundaries=CHATML_TURN_BOUNDARIES, starts_in_reasoning=thinking,
                           wait_for_reasoning=thinking)


class Qwen3ReasoningParser(TagReasoningParser):
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        chat_kwargs = kwargs.get("chat_template_kwargs") or {}
        self.thinking_enabled = bool(chat_kwargs.get("enable_thinking", True))
        self._setup(qwen3_format(self.thinking_enabled))

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if not self.thinking_enabled:
            return None, model_output
        return super().extract_reasoning(model_output, request)
