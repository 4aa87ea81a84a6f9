"""Reasoning parsers driven by a tag state machine: what vLLM 0.32's parser engine (vllm/parser/engine/) does for
a reasoning format when it parses reasoning only (its ReasoningAdapter: tool-call markup is left to the tool
parser, as content).

A format is a few tags and two states, REASONING and CONTENT:

- in REASONING, the start tag is swallowed, the end tag is swallowed and ends reasoning, and an implicit end
  (Qwen3's `<tool_call>`: a tool call straight out of the thinking) ends reasoning and is content itself;
- in CONTENT, a stray end tag is swallowed; a start tag is content unless the format reopens reasoning on it;
- any other special token of the tokenizer is dropped from the text (these parsers ask for the special tokens
  to be kept in the text, `adjust_request`, so that tags which are special tokens survive detokenization).

Tags are found in the token ids when the tag is one token of the vocabulary and the caller gives ids (then
the same characters in the text are content, not a tag: the model wrote them, it did not emit the tag), else
in the text; text that may be the beginning of a tag is held back until the next delta shows whether it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from tokenloom.reasoning.abs_reasoning_parsers import ReasoningParser
from tokenloom.reasoning.protocol import DeltaMessage


class Tag(Enum):
    START = "start"
    END = "end"
    IMPLICIT_END = "implicit_end"
    DROP = "drop"


@dataclass(frozen=True)
class ReasoningFormat:
    """One model family's reasoning markup (vLLM: the reasoning part of its ParserEngineConfig)."""

    start: str | None
    end: str
    implicit_ends: tuple[str, ...] = ()  # end reasoning and are content themselves (a tool call's opening)
    turn_boundaries: tuple[str, ...] = ()  # where is_reasoning_end stops looking back (the last turn's start)
    starts_in_reasoning: bool = True  # the output begins inside the reasoning (the template opened it)
    start_reopens: bool = False  # a start tag in CONTENT opens reasoning again
    wait_for_reasoning: bool = True  # no tag seen: reasoning has not ended (is_reasoning_end's answer)
    strip_trailing_reasoning_whitespace: bool = False


class ReasoningEnd(NamedTuple):
    """Where reasoning ends in a token sequence (vLLM's)."""

    offset: int  # index of the first end token, or the sequence's length
    implicit: bool  # that token is content too (a tool call's opening), so the grammar reads it


class _Item(NamedTuple):
    tag: Tag | None  # None: plain text
    text: str


class _TextLexer:
    """Finds tags in text that arrives in pieces, holding back a tail that may grow into one."""

    def __init__(self, tags: dict[str, Tag]) -> None:
        self.tags = tags
        self.pending = ""

    def feed(self, text: str) -> list[_Item]:
        text, self.pending = self.pending + text, ""
        items: list[_Item] = []
        while text:
            hit = self._first_tag(text)
            if hit is None:
                keep = self._partial_tail(text)
                if keep:
                    text, self.pending = text[:-keep], text[-keep:]
                if text:
                    items.append(_Item(None, text))
                break
            pos, literal = hit
            if pos:
                items.append(_Item(None, text[:pos]))
            items.append(_Item(self.tags[literal], literal))
            text = text[pos + len(literal):]
        return items

    def flush(self) -> list[_Item]:
        text, self.pending = self.pending, ""
        return [_Item(None, text)] if text else []

    def _first_tag(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for literal in self.tags:
            pos = text.find(literal)
            if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(literal) > len(best[1]))):
                best = (pos, literal)
        return best

    def _partial_tail(self, text: str) -> int:
        longest = 0
        for literal in self.tags:
            for k in range(min(len(literal) - 1, len(text)), longest, -1):
                if text.endswith(literal[:k]):
                    longest = k
                    break
        return longest


class TagReasoningParser(ReasoningParser):
    """A reasoning parser for one ReasoningFormat; a subclass builds its format in `__init__` (from the
    request's `chat_template_kwargs` where the format depends on the template) and calls `_setup`."""

    engine_based_streaming = True

    def _setup(self, fmt: ReasoningFormat) -> None:
        self.format = fmt
        vocab = self.vocab
        tags = {fmt.end: Tag.END, **{t: Tag.IMPLICIT_END for t in fmt.implicit_ends}}
        if fmt.start:
            tags[fmt.start] = Tag.START
        self._tag_ids = {vocab[t]: (tag, t) for t, tag in tags.items() if t in vocab}
        self._drops = self._special_tokens(set(tags))
        self._text_tags = tags  # before any token id arrives (a whole output given as text)
        # With token ids, only tags that are no single token are looked for in the text.
        self._text_only_tags = {t: tag for t, tag in tags.items() if t not in vocab}
        self.start_token_id = vocab.get(fmt.start) if fmt.start else None
        self.end_token_id = vocab.get(fmt.end)
        self._boundary_ids = frozenset(vocab[t] for t in fmt.turn_boundaries if t in vocab)
        self._end_ids = self._derive_end_ids(vocab)
        self._init_stream()

    def _special_tokens(self, tags: set[str]) -> dict[int, str]:
        """The tokenizer's other special tokens (id -> text), dropped from the text (vLLM's drop terminals)."""
        try:
            texts = list(self.model_tokenizer.all_special_tokens)
            ids = list(self.model_tokenizer.all_special_ids)
        except (AttributeError, NotImplementedError):
            return {}
        return {tid: text for text, tid in zip(texts, ids) if text not in tags}

    def _derive_end_ids(self, vocab: dict[str, int]) -> frozenset[int]:
        """The tokens that end reasoning, when every end is a single token (vLLM's rule: an end tag missing
        from the vocabulary leaves none, and the gate falls back to asking is_reasoning_end)."""
        if self.end_token_id is None:
            return frozenset()
        return frozenset([self.end_token_id, *(vocab[t] for t in self.format.implicit_ends if t in vocab)])

    # The engine's questions (the structured-output gate) -------------------------------------------
    @property
    def reasoning_start_str(self) -> str | None:
        return self.format.start

    @property
    def reasoning_end_str(self) -> str | None:
        return self.format.end

    @property
    def reasoning_end_token_ids(self) -> frozenset[int]:
        return self._end_ids

    def _start_opens_reasoning(self) -> bool:
        return self.format.starts_in_reasoning or self.format.start_reopens

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Looking back from the end, within the last turn: an end token says yes, a start token that opens
        reasoning says no; neither, the format's default."""
        for token_id in reversed(input_ids):
            if token_id in self._end_ids:
                return True
            if token_id == self.start_token_id:
                if self._start_opens_reasoning():
                    return False
                break
            if token_id in self._boundary_ids:
                break
        return not self.format.wait_for_reasoning

    def find_reasoning_end(self, token_ids: Sequence[int]) -> ReasoningEnd | None:
        """The first end of reasoning in `token_ids` (a step's new tokens, or its drafts)."""
        if not self._end_ids:
            return None
        for offset, token_id in enumerate(token_ids):
            if token_id in self._end_ids:
                return ReasoningEnd(offset, token_id != self.end_token_id)
        return ReasoningEnd(len(token_ids), False)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if not self.format.wait_for_reasoning:
            return input_ids
        if self.end_token_id is not None:
            for i in range(len(input_ids) - 1, -1, -1):
                if input_ids[i] == self.end_token_id:
                    return input_ids[i + 1:]
        if self._end_ids:
            turn_start = 0
            for i in range(len(input_ids) - 1, -1, -1):
                if input_ids[i] in self._boundary_ids:
                    turn_start = i + 1
                    break
            for i in range(turn_start, len(input_ids)):
                if input_ids[i] in self._end_ids:
                    return input_ids[i:]  # an implicit end is content itself
        return input_ids

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """The generated tokens read in the REASONING state (tags and dropped special tokens not counted)."""
        in_reasoning = self.format.starts_in_reasoning
        count = 0
        for token_id in token_ids:
            tag = self._tag_ids.get(token_id, (None, ""))[0]
            if tag is None and token_id in self._drops:
                continue
            if tag is None:
                count += in_reasoning
            elif in_reasoning:
                in_reasoning = tag is Tag.START
            elif tag is Tag.START and self.format.start_reopens:
                in_reasoning = True
        return count

    def adjust_request(self, request: Any) -> Any:
        # Tags may be special tokens: keep special tokens in the text (the others are dropped when parsed).
        request.skip_special_tokens = False
        return request

    # The server's questions ------------------------------------------------------------------------
    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        machine = _Machine(self)
        items = machine.lex(model_output, ()) + machine.finish_items()
        reasoning, content = machine.run(items)
        text = "".join(reasoning)
        if self.format.strip_trailing_reasoning_whitespace:
            text = text.rstrip()
        return text or None, "".join(content) or None

    def _init_stream(self) -> None:
        self._stream = _Machine(self)
        self._deferred_content = ""  # whitespace-only content, held until something else follows
        self._content_has_nonws = False
        self._deferred_reasoning = ""  # trailing whitespace of reasoning (formats that strip it)

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self._stream.reasoning_ended

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        machine = self._stream
        reasoning, content = machine.run(machine.lex(delta_text, delta_token_ids))
        return self._strip_trailing_reasoning(self._delta(reasoning, content, finished=False))

    def finish_streaming(self) -> DeltaMessage | None:
        """What the stream held back (a partial tag's text, deferred whitespace), at its end."""
        machine = self._stream
        reasoning, content = machine.run(machine.finish_items())
        if machine.in_reasoning:  # the stream ended inside the reasoning: that ends it (vLLM's finish)
            machine.in_reasoning, machine.reasoning_ended = False, True
        return self._delta(reasoning, content, finished=True)

    def _delta(self, reasoning: list[str], content: list[str], finished: bool) -> DeltaMessage | None:
        """vLLM's _events_to_delta: whitespace-only content waits until other content (or the end) comes."""
        text = self._deferred_content + "".join(content)
        self._deferred_content = ""
        if text and not self._content_has_nonws:
            if text.strip():
                self._content_has_nonws = True
            elif not finished:
                self._deferred_content, text = text, ""
        thought = "".join(reasoning)
        if not (text or thought):
            return None
        return DeltaMessage(content=text or None, reasoning=thought or None)

    def _strip_trailing_reasoning(self, delta: DeltaMessage | None) -> DeltaMessage | None:
        """Formats that strip trailing reasoning whitespace hold it back until more reasoning follows."""
        if not self.format.strip_trailing_reasoning_whitespace:
            return delta
        if delta is not None and delta.reasoning is not None:
            combined = self._deferred_reasoning + delta.reasoning
            trimmed = combined.rstrip()
            self._deferred_reasoning = combined[len(trimmed):]
            delta.reasoning = trimmed or None
            if delta.reasoning is None and delta.content is None:
                return None
        elif self._deferred_reasoning and self._stream.reasoning_ended:
            self._deferred_reasoning = ""
        return delta


class _Machine:
    """One parse: the lexer's state, the REASONING / CONTENT state, whether reasoning has ended."""

    def __init__(self, parser: TagReasoningParser) -> None:
        self.parser = parser
        self.in_reasoning = parser.format.starts_in_reasoning
        self.reasoning_ended = False
        self.token_mode = False  # token ids have been given: tags that are one token come from the ids
        self.lexer = _TextLexer({**parser._text_tags, **{t: Tag.DROP for t in parser._drops.values()}})

    def lex(self, text: str, token_ids: Sequence[int]) -> list[_Item]:
        if token_ids and not self.token_mode:
            self.token_mode = True
            self.lexer.tags = dict(self.parser._text_only_tags)
        if not self.token_mode:
            return self.lexer.feed(text)
        return self._lex_with_ids(text, token_ids)

    def _lex_with_ids(self, text: str, token_ids: Sequence[int]) -> list[_Item]:
        """Split the delta's text at the tags its ids hold, in order; the text between goes through the lexer
        (for tags that are not one token). A tag id whose text is not in the delta (detokenized away) takes
        effect after the delta's text."""
        items: list[_Item] = []
        cursor = 0
        late: list[_Item] = []
        for marker in self._markers(token_ids):
            pos = text.find(marker.text, cursor) if marker.text else -1
            if pos < 0:
                if marker.tag is not Tag.DROP:
                    late.append(marker)
                continue
            items += self.lexer.feed(text[cursor:pos]) + self.lexer.flush()
            items.append(marker)
            cursor = pos + len(marker.text)
        items += self.lexer.feed(text[cursor:])
        if late:
            items += self.lexer.flush() + late
        return items

    def _markers(self, token_ids: Iterable[int]) -> list[_Item]:
        parser = self.parser
        out = []
        for token_id in token_ids:
            if token_id in parser._tag_ids:
                tag, text = parser._tag_ids[token_id]
                out.append(_Item(tag, text))
            elif token_id in parser._drops:
                out.append(_Item(Tag.DROP, parser._drops[token_id]))
        return out

    def finish_items(self) -> list[_Item]:
        return self.lexer.flush()

    def run(self, items: list[_Item]) -> tuple[list[str], list[str]]:
        """(reasoning pieces, content pieces) of the items, advancing the state."""
        reasoning: list[str] = []
        content: list[str] = []
        reopens = self.parser.format.start_reopens
        for tag, text in items:
            if tag is None:
                (reasoning if self.in_reasoning else content).append(text)
            elif tag is Tag.DROP:
                continue
            elif self.in_reasoning:
                if tag is not Tag.START:
                    self.in_reasoning, self.reasoning_ended = False, True
                    if tag is Tag.IMPLICIT_END:
                        content.append(text)
            elif tag is Tag.START:
                if reopens:
                    self.in_reasoning = True
                else:
                    content.append(text)
            elif tag is Tag.IMPLICIT_END:
                content.append(text)
        return reasoning, content
