"""Reasoning parsers (vLLM 0.32's vllm/reasoning): `--reasoning-parser NAME` splits a reasoning model's output
into `reasoning` and `content`, and holds structured outputs back until the reasoning ends.

The names registered are vLLM's for the families tokenloom runs: `deepseek_r1` (DeepSeek-R1 and its Qwen2 /
Llama distills) and `qwen3` (Qwen3, Qwen3-MoE). A user's parser registers itself from a plugin module
(`--reasoning-parser-plugin PATH`, vLLM's flag) with `@ReasoningParserManager.register_module("name")`.

This room imports nothing of tokenloom's, and no torch: the server uses the parsers, and so does the engine's
structured-output gate (tokenloom/core), each building its own from the tokenizer.
"""

from __future__ import annotations

from tokenloom.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from tokenloom.reasoning.protocol import DeltaMessage

# name -> (module in this package, class): imported when first asked for (vLLM's lazy registration).
_REASONING_PARSERS_TO_REGISTER = {
    "deepseek_r1": ("deepseek_r1_reasoning_parser", "DeepSeekR1ReasoningParser"),
    "qwen3": ("qwen3_reasoning_parser", "Qwen3ReasoningParser"),
}


def register_lazy_reasoning_parsers() -> None:
    for name, (file_name, class_name) in _REASONING_PARSERS_TO_REGISTER.items():
        ReasoningParserManager.register_lazy_module(name, f"tokenloom.reasoning.{file_name}", class_name)


register_lazy_reasoning_parsers()


def resolve_reasoning_parser(name: str, plugin: str = "") -> type[ReasoningParser]:
    """The class `--reasoning-parser NAME` means, after importing `--reasoning-parser-plugin` (vLLM's order;
    a plugin path of 3 characters or fewer is ignored, as vLLM ignores it). vLLM's start-up error when the
    name is unknown: "invalid reasoning parser: NAME (chose from { ... })"."""
    if plugin and len(plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(plugin)
    known = ReasoningParserManager.list_registered()
    if name not in known:
        raise KeyError(f"invalid reasoning parser: {name} (chose from {{ {','.join(known)} }})")
    return ReasoningParserManager.get_reasoning_parser(name)


def check_reasoning_tokenizer(name: str, parser_cls: type[ReasoningParser], tokenizer: object,
                              model_name: str) -> None:
    """vLLM's start-up check (ParserManager.validate_parser_tokenizer): the parser must build on the model's
    tokenizer; a parser whose tokens the vocabulary lacks is refused in its words."""
    try:
        parser_cls(tokenizer)
    except Exception as exc:
        raise ValueError(f"--reasoning-parser {name} cannot be used with the tokenizer of {model_name!r}: {exc}"
                         ) from None


def reasoning_token_ids(parser: ReasoningParser, tokenizer: object) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The parser's start and end strings as token ids (vLLM's ReasoningConfig.initialize_token_ids), what a
    thinking_token_budget counts from and forces; None when the parser has no such strings."""
    start, end = parser.reasoning_start_str, parser.reasoning_end_str
    if not start or not end:
        return None
    encode = tokenizer.encode  # type: ignore[attr-defined]
    start_ids, end_ids = encode(start, add_special_tokens=False), encode(end, add_special_tokens=False)
    if not start_ids or not end_ids:
        return None
    return tuple(start_ids), tuple(end_ids)


__all__ = ["DeltaMessage", "ReasoningParser", "ReasoningParserManager", "check_reasoning_tokenizer",
           "reasoning_token_ids", "resolve_reasoning_parser"]
