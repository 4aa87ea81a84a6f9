"""Reasoning in chat and Responses answers: one choice's output split into reasoning, content and tool calls, as
vLLM 0.32's DelegatingParser (vllm/parser/abstract_parser.py) composes a reasoning parser with the tool-call
parser.

- Whole output (`parse`): the reasoning parser splits it (`extract_reasoning`); the tool calls are read from the
  content after the reasoning only.
- Streamed (`parse_delta`): the prompt is asked first: a prompt that already ended the reasoning (Qwen3 with
  `enable_thinking: false` writes an empty think block) means every delta is content. Otherwise each delta
  goes to the reasoning parser until it reports the end of reasoning; what came after the end in that delta
  (and what the parser held back) opens the content, which from then on passes through as it comes, or
  through the tool-call parser when the request reads tool calls.
- `include_reasoning: false` drops the reasoning (and a delta that had nothing else); the engine then
  constrains a structured output from the first token (`reasoning_ended`, vLLM's rule).

Without --reasoning-parser the tool-call handling is tokenloom/server/tool_calls.py's, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.reasoning import ReasoningParser
from tokenloom.reasoning.protocol import DeltaMessage
from tokenloom.server.tool_calls import StreamingToolParser, parse_output
from tokenloom.server.tools import ToolSetup


@dataclass
class ReasoningSetup:
    """A request's reasoning parsing on a server with --reasoning-parser: the parser class, the tokenizer, and
    the request's chat_template_kwargs (Qwen3's enable_thinking), which every parser of the request is built
    with: one per choice (parsers keep streaming state), one for the engine's question below."""

    parser_cls: type[ReasoningParser]
    tokenizer: Any
    chat_template_kwargs: dict[str, Any]

    def make(self) -> ReasoningParser:
        return self.parser_cls(self.tokenizer, chat_template_kwargs=self.chat_template_kwargs)

    def engine_kwargs(self, include_reasoning: bool, prompt_token_ids: Sequence[int]) -> dict[str, Any]:
        """What the engine's grammar gate is told with the request (vLLM's _engine_reasoning_kwargs)."""
        return {"reasoning_ended": reasoning_ended(include_reasoning, self.make(), prompt_token_ids),
                "reasoning_parser_kwargs": {"chat_template_kwargs": self.chat_template_kwargs}}

    def adjust_request(self, request: Any) -> None:
        """The parser's request hook (vLLM calls it whenever a reasoning parser is set): Qwen3's keeps special
        tokens in the text."""
        self.make().adjust_request(request)


def reasoning_ended(include_reasoning: bool, reasoner: ReasoningParser | None,
                    prompt_token_ids: Sequence[int]) -> bool | None:
    """vLLM's resolve_reasoning_ended, what the engine's grammar gate is told: True (constrain from the first
    token) when the reasoning is not wanted; else whether the prompt ended it; None without a parser."""
    if not include_reasoning:
        return True
    if reasoner is not None:
        return reasoner.is_reasoning_end(prompt_token_ids)
    return None


class OutputParser:
    """One choice's output: its reasoning (`reasoner`: the request's parser, None without --reasoning-parser)
    and its tool calls (`tools`, when the request reads them)."""

    def __init__(self, reasoner: ReasoningParser | None, tools: ToolSetup | None, include_reasoning: bool = True,
                 request: Any = None) -> None:
        self.reasoner = reasoner
        self.tools = tools if tools is not None and tools.parses_calls else None
        self.include_reasoning = include_reasoning
        self.request = request
        # Streaming state (vLLM's StreamState).
        self._prompt_checked = False
        self.reasoning_ended = reasoner is None
        self._previous_text = ""
        self._previous_ids: list[int] = []
        self._tool_stream: StreamingToolParser | None = None

    # Whole -----------------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning, content, tool calls) of a whole output; tool calls only when the request reads them."""
        if self.reasoner is not None:
            reasoning, content = self.reasoner.extract_reasoning(text, self.request)
        else:
            reasoning, content = None, text
        calls: list[dict[str, Any]] = []
        if self.tools is not None and (content is not None or self.tools.mode != "auto"):
            content, calls = parse_output(content or "", self.tools)
        if not self.include_reasoning:
            reasoning = None
        return reasoning, content, calls

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        return self.reasoner.count_reasoning_tokens(token_ids) if self.reasoner is not None else 0

    # Streamed --------------------------------------------------------------------------------------
    def parse_delta(self, delta_text: str, delta_ids: Sequence[int], prompt_ids: Sequence[int] | None,
                    finished: bool) -> DeltaMessage | None:
        """The chunk's delta for this step of the choice (None: nothing to send for it)."""
        reasoner = self.reasoner
        if not self._prompt_checked and prompt_ids is not None:
            self._prompt_checked = True
            if reasoner is None or reasoner.is_reasoning_end(prompt_ids):
                self.reasoning_ended = True
            else:
                reasoner.adjust_initial_state_from_prompt(prompt_ids)
        delta_ids = list(delta_ids)
        delta: DeltaMessage | None = None
        transitioned = False
        if not self.reasoning_ended:
            assert reasoner is not None
            delta, delta_text, delta_ids, transitioned = self._reasoning_step(reasoner, delta_text, delta_ids)
        if self.reasoning_ended and self.tools is not None:
            delta = self._tool_step(delta, delta_text, finished)
        elif delta is None and not transitioned and self.reasoning_ended:
            delta = DeltaMessage(content=delta_text)
        if finished and reasoner is not None and reasoner.engine_based_streaming and not self.reasoning_ended:
            delta = _merged(delta, reasoner.finish_streaming())  # what the parser held back, at the end
        if delta is not None and not self.include_reasoning:
            delta.reasoning = None
            if not delta.content and not delta.tool_calls:
                delta = None
        return delta

    def _reasoning_step(self, reasoner: ReasoningParser, delta_text: str, delta_ids: list[int]
                        ) -> tuple[DeltaMessage | None, str, list[int], bool]:
        """The reasoning parser's reading of the delta; at the end of reasoning, the content it opens becomes
        the delta's text (and ids) for what follows."""
        engine_based = reasoner.engine_based_streaming
        if engine_based:  # the parser keeps its own state: it is given only the delta (vLLM's StreamState)
            previous_text, previous_ids, current_text, current_ids = "", [], delta_text, delta_ids
        else:
            previous_text, previous_ids = self._previous_text, self._previous_ids
            current_text, current_ids = previous_text + delta_text, previous_ids + delta_ids
        delta = reasoner.extract_reasoning_streaming(previous_text, current_text, delta_text, previous_ids,
                                                     current_ids, delta_ids)
        if engine_based:
            ended = reasoner.has_engine_confirmed_reasoning_end()
        else:
            ended = reasoner.is_reasoning_end_streaming(current_ids, delta_ids)
        self._previous_text, self._previous_ids = current_text, current_ids
        if not ended:
            return delta, delta_text, delta_ids, False
        self.reasoning_ended = True
        flushed = reasoner.finish_streaming() if engine_based else None  # e.g. a held-back "<" of "<tool_call>"
        content = ((delta.content if delta else None) or "") + ((flushed.content if flushed else None) or "")
        if self.tools is None and content:
            delta = delta or DeltaMessage()
            delta.content = content
        elif delta is not None:
            delta.content = None  # the tool-call parser reads it
        return delta, content, reasoner.extract_content_ids(delta_ids), True

    def _tool_step(self, delta: DeltaMessage | None, content: str, finished: bool) -> DeltaMessage | None:
        """The content through the tool-call parser (from the first text after the reasoning on)."""
        assert self.tools is not None
        if self._tool_stream is None:
            self._tool_stream = StreamingToolParser(self.tools)
        out = self._tool_stream.feed(content, finished) or {}
        reasoning = delta.reasoning if delta is not None else None
        if not (out or reasoning):
            return None
        return DeltaMessage(content=out.get("content"), tool_calls=out.get("tool_calls") or [], reasoning=reasoning)

    def finish_reason(self, reason: str | None) -> str | None:
        """A streamed choice's finish reason ("tool_calls" once a call went out, as the tool parser says)."""
        return self._tool_stream.finish_reason(reason) if self._tool_stream is not None else reason


def _merged(delta: DeltaMessage | None, extra: DeltaMessage | None) -> DeltaMessage | None:
    if extra is None:
        return delta
    if delta is None:
        return extra
    if extra.content:
        delta.content = (delta.content or "") + extra.content
    if extra.reasoning:
        delta.reasoning = (delta.reasoning or "") + extra.reasoning
    return delta
