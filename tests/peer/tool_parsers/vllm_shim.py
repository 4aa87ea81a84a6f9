"""vLLM's names, as its tool-parser tests import them, mapped onto tokenloom (plumbing only).

The parsers, their registry and the objects they return are tokenloom's own, under vLLM's names
(tokenloom/server/tool_parsers/: vLLM's ToolParser interface). What is here stands in for the parts of vLLM
the tests use around them:

- the tokenizers they load from the Hugging Face Hub (gpt2, Qwen3, Qwen3-Coder, Llama 3.2), which this
  machine cannot reach: the default model's tokenizer (SmolLM2-135M-Instruct's, shipped with tokenloom),
  with the special tokens each parser needs added (`local_tokenizer`);
- vLLM's request-side tool types (ChatCompletionToolsParam, FunctionDefinition), which tokenloom takes as the
  JSON they serialise to: `ChatCompletionRequest` is tokenloom's request, given those objects' JSON;
- vLLM's VLLMValidationError: tokenloom's APIError, the 400 its request models raise in vLLM's words;
- `detokenize_incrementally`, vLLM's stateless incremental detokenizer that one test drives by hand (the same
  contract over the tokenizer's own decode; tokenloom's engine uses its IncrementalDetokenizer).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, model_validator

from tokenloom.server.errors import APIError as VLLMValidationError  # noqa: F401  (a 400 in vLLM's words)
from tokenloom.server.protocol import ChatCompletionRequest as _TokenloomChatRequest
from tokenloom.server.protocol import ResponsesRequest  # noqa: F401
from tokenloom.server.tool_parsers import (  # noqa: F401  (re-exported under vLLM's names)
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParser,
    ToolParserManager,
)
from tokenloom.server.tool_parsers.hermes import HermesToolParser as Hermes2ProToolParser  # noqa: F401
from tokenloom.server.tool_parsers.llama import Llama3JsonToolParser  # noqa: F401
from tokenloom.server.tool_parsers.mistral import MistralToolParser  # noqa: F401
from tokenloom.server.tool_parsers.python_calls import (  # noqa: F401
    UnexpectedAstError,
    get_parameter_value,
    handle_single_tool,
    make_valid_python,
)
from tokenloom.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser as Qwen3EngineToolParser  # noqa: F401
from tokenloom.server.tool_parsers.schema_types import (  # noqa: F401
    coerce_to_schema_type,
    extract_types_from_schema,
)

TokenizerLike = Any


class Granite4ToolParser:
    """vLLM's Granite 4 parser: not vendored (tokenloom runs no Granite family). The Hermes test body checks
    `isinstance(parser, Granite4ToolParser)`; no parser here is one."""


# Tokenizers ------------------------------------------------------------------------------------------
@functools.cache
def _default_tokenizer_dir() -> str:
    """The default model's tokenizer saved once, so each test tokenizer is a fresh, private copy."""
    from tokenloom.model.tokenizer import load_tokenizer

    directory = tempfile.mkdtemp(prefix="tokenloom-peer-tokenizer-")
    load_tokenizer(None).hf.save_pretrained(directory)
    return directory


def local_tokenizer(added: Sequence[str] = (), special: Sequence[str] = ()) -> Any:
    """A transformers tokenizer: SmolLM2's vocabulary plus `added` tokens (normal, as Qwen marks <tool_call>)
    and `special` ones (as Llama marks <|python_tag|>), each then one token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_default_tokenizer_dir(), local_files_only=True)
    if added:
        tok.add_tokens(list(added), special_tokens=False)
    if special:
        tok.add_tokens(list(special), special_tokens=True)
    return tok


# Qwen/Qwen3-32B and Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8: <tool_call> and </tool_call> are single tokens.
QWEN_TOOL_TOKENS = ("<tool_call>", "</tool_call>")
# meta-llama/Llama-3.2-1B-Instruct: <|python_tag|> is a special token.
LLAMA_SPECIAL_TOKENS = ("<|python_tag|>",)
# mistralai/Mistral-7B-Instruct-v0.3 (a pre-v11 vocabulary: no [ARGS]): [TOOL_CALLS] is a special token.
MISTRAL_PRE_V11_SPECIAL_TOKENS = ("[TOOL_CALLS]",)


def get_tokenizer(tokenizer_name: str, **_: Any) -> Any:
    """vLLM's get_tokenizer for the models these tests name, as local equivalents (see the module doc); one
    object per name (building one takes ~0.3 s, and the Hermes tests ask for one per case; none changes it)."""
    return _named_tokenizer(tokenizer_name)


@functools.cache
def _named_tokenizer(tokenizer_name: str) -> Any:
    if tokenizer_name.startswith("Qwen/"):
        return local_tokenizer(added=QWEN_TOOL_TOKENS)
    if tokenizer_name.startswith("meta-llama/"):
        return local_tokenizer(special=LLAMA_SPECIAL_TOKENS)
    if tokenizer_name == "mistralai/Mistral-7B-Instruct-v0.3":
        return local_tokenizer(special=MISTRAL_PRE_V11_SPECIAL_TOKENS)
    return local_tokenizer()


class AutoTokenizer:
    """transformers' AutoTokenizer as the tests call it, for the Hub models they name (get_tokenizer)."""

    from_pretrained = staticmethod(get_tokenizer)


def detokenize_incrementally(tokenizer: Any, all_input_ids: list[int], prev_tokens: list[str] | None,
                             prefix_offset: int, read_offset: int, skip_special_tokens: bool = False,
                             spaces_between_special_tokens: bool = True
                             ) -> tuple[list[str], str, int, int]:
    """vLLM's contract: (new tokens, new text, prefix offset, read offset). The text between the offsets is
    decoded again with the new token; a character still incomplete (U+FFFD at the end) waits."""
    new_tokens = tokenizer.convert_ids_to_tokens(all_input_ids if prev_tokens is None else all_input_ids[-1:])
    if prev_tokens is None:  # the first call reads everything before the last token as already read
        read_offset = max(len(all_input_ids) - 1, 0)
        prefix_offset = max(read_offset - 5, 0)
    prefix = tokenizer.decode(all_input_ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
    text = tokenizer.decode(all_input_ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(text) > len(prefix) and not text.endswith("\ufffd"):
        return new_tokens, text[len(prefix):], read_offset, len(all_input_ids)
    return new_tokens, "", prefix_offset, read_offset


# Requests -------------------------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_TokenloomChatRequest):
    """tokenloom's chat request; tools given as objects are taken as the JSON a client would send."""

    @model_validator(mode="before")
    @classmethod
    def _tools_as_json(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tools"):
            data = {**data, "tools": [t.model_dump(exclude_none=True) if isinstance(t, BaseModel) else t
                                      for t in data["tools"]]}
        return data
