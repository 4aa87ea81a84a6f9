"""vLLM 0.32's reasoning-parser interface (vllm/reasoning/abs_reasoning_parsers.py) and its registry.

A `ReasoningParser` splits a reasoning model's output into its reasoning (the `<think>...</think>` part)
and its content. It has two users, as in vLLM: the chat / Responses server (`extract_reasoning` on a
whole output, `extract_reasoning_streaming` delta by delta) and the engine's structured-output gate
(`is_reasoning_end` on the prompt, `is_reasoning_end_streaming` on each step's tokens: the grammar
applies only after reasoning ends; tokenloom/core/structured_output.py). The interface is vLLM's, names
and signatures, so a parser written for vLLM (a `--reasoning-parser-plugin` file) runs here once its
imports say tokenloom: `from tokenloom.reasoning import ReasoningParser, ReasoningParserManager` and
`from tokenloom.reasoning.protocol import DeltaMessage`.

`ReasoningParserManager` is vLLM's registry: built-in parsers are registered lazily by name
(tokenloom/reasoning/__init__.py), plugins register themselves with `@ReasoningParserManager.register_module`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from functools import cached_property
from types import ModuleType
from typing import Any

from tokenloom.parser_registry import ParserRegistry
from tokenloom.reasoning.protocol import DeltaMessage

logger = logging.getLogger(__name__)


class ReasoningParser:
    """Base class (vLLM's, not to be used directly). `tokenizer` is the model's (anything with
    `get_vocab()`); keyword arguments are the request's, e.g. `chat_template_kwargs`, which parsers whose
    format depends on the chat template read (Qwen3's `enable_thinking`)."""

    # True for parsers that keep their own streaming state and report the end of reasoning themselves
    # (`has_engine_confirmed_reasoning_end`, `finish_streaming`), as vLLM's parser-engine adapters do.
    engine_based_streaming: bool = False

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer
        self._model_config = kwargs.get("model_config")

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    @property
    def reasoning_start_str(self) -> str | None:
        """The text that opens reasoning (e.g. "<think>"), or None."""
        return None

    @property
    def reasoning_end_str(self) -> str | None:
        """The text that closes reasoning (e.g. "</think>"), or None."""
        return None

    def has_engine_confirmed_reasoning_end(self) -> bool:
        """For `engine_based_streaming` parsers: whether the deltas fed so far ended reasoning."""
        return False

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether reasoning has ended by the end of `input_ids` (a prompt, or prompt + output)."""
        raise NotImplementedError

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        """Whether the step's new tokens `delta_ids` (the last ones of `input_ids`) end reasoning. The engine
        asks this every decode step of a constrained request, so parsers answer from `delta_ids`."""
        return self.is_reasoning_end(input_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The content's token ids: what follows the end of reasoning."""
        raise NotImplementedError

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of the generated `token_ids` are reasoning (usage's reasoning_tokens); 0 unless a parser
        can tell."""
        return 0

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        raise NotImplementedError

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """The delta's reasoning and content; None to send nothing for it (previous + delta = current)."""
        raise NotImplementedError

    def adjust_request(self, request: Any) -> Any:
        """A hook on the request before it runs (vLLM's): e.g. keep special tokens in the text."""
        return request

    def adjust_initial_state_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Called once, at the start of a stream whose prompt leaves reasoning open."""
        return None

    def prepare_structured_tag(self, original_tag: str | None, tool_server: Any) -> str | None:
        return original_tag


def import_plugin(plugin_path: str) -> ModuleType | None:
    """vLLM's import_plugin: a module name (`my_pkg.parsers`) or a Python file's path. A file that fails to
    import is logged and skipped, as vLLM does: the parser it meant to register is then unknown, and
    asking for it names the registered ones."""
    try:
        return importlib.import_module(plugin_path)
    except ModuleNotFoundError:
        module_name = os.path.splitext(os.path.basename(plugin_path))[0]
        try:
            spec = importlib.util.spec_from_file_location(module_name, plugin_path)
            if spec is None or spec.loader is None:
                raise ModuleNotFoundError(f"No module named {module_name!r}") from None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            return module
        except Exception:
            logger.exception("Failed to load module '%s' from %s.", module_name, plugin_path)
            return None


class ReasoningParserManager(ParserRegistry):
    """vLLM's registry of ReasoningParser classes by name: registered now (`register_module`) or by
    module path, imported on first use (`register_lazy_module`, and the decorator form)."""

    base = ReasoningParser
    reasoning_parsers: dict[str, type[ReasoningParser]] = {}
    registered = reasoning_parsers  # vLLM's attribute name, the registry's dict
    lazy_parsers: dict[str, tuple[str, str]] = {}  # name -> (module path, class name)

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The class registered under `name`; vLLM's KeyError naming the registered ones otherwise."""
        parser_cls = cls._lookup(name)
        if parser_cls is None:
            registered = ", ".join(cls.list_registered())
            raise KeyError(f"Reasoning parser '{name}' not found. Available parsers: {registered}")
        return parser_cls

    @classmethod
    def import_reasoning_parser(cls, plugin_path: str) -> None:
        """Import a user's parser module (a module name or a file path), which registers its parsers."""
        import_plugin(plugin_path)

