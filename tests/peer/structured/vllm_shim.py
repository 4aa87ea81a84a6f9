"""vLLM's names, as its structured-output tests import them, mapped onto tokenloom (plumbing only).

What the tests check is tokenloom's own code: the request checks and xgrammar's validation
(tokenloom/model/grammar.py `validate_structured_outputs`, `validate_xgrammar_grammar`,
`has_xgrammar_unsupported_json_features`, `choice_as_grammar`), the StructuredOutputsParams and
StructuredOutputRequest (tokenloom/sampling_params.py, tokenloom/core/structured_output.py), the
StructuredOutputManager and its xgrammar backend, `compile_regex_with_timeout` and `strip_speculative_padding`.
What is here stands in for the parts of vLLM around them:

- `SamplingParams._validate_structured_outputs(model_config, structured_outputs_config, tokenizer)`: vLLM checks a
  constraint in a SamplingParams method; tokenloom's SamplingParams sit below the grammar library (tests/
  test_layering.py), so the check is tokenloom.model.grammar.validate_structured_outputs, which this method calls
  (the stub model config and the tokenizer object the tests pass have nothing tokenloom reads).
  `update_from_generation_config({}, eos)` is the engine filling the request's `eos_token_id`;
- vLLM's config objects (VllmConfig, ModelConfig, SchedulerConfig, DeviceConfig, SpeculativeConfig) as holders of
  the fields the tests set; tokenloom's StructuredOutputsConfig is used as it is;
- the tokenizers the tests load from the Hugging Face Hub (gpt2): the default model's tokenizer (SmolLM2-135M-
  Instruct's, a byte-level BPE as gpt2's; every string the tests tokenize is one token in both);
- `XgrammarBackend(vllm_config, tokenizer, vocab_size)` and its `compile_grammar(request_type, spec,
  stop_token_ids)`: tokenloom's backend compiles a (kind, spec) once and builds a matcher per request; the key is
  tokenloom's own (StructuredOutputsParams.key of the field vLLM's request type names); one backend is built per
  configuration and shared by the tests (building one reads the whole vocabulary);
- vLLM's grammar objects batch a step's tokens (`accept_tokens(request_id, tokens)`); tokenloom's matchers take
  one token at a time: `_Grammar` feeds them in turn, up to the grammar's end as vLLM's does;
- `StructuredOutputManager(vllm_config)`: tokenloom's manager, built as its engine builds it (a backend factory
  over the tokenizer, the engine's enable_in_reasoning); vLLM's `reasoner_cls` attribute is the parser class
  tokenloom's manager builds each request's parser from; `grammar_bitmask(requests=, structured_output_request_ids=,
  scheduled_spec_decode_tokens=)` is tokenloom's `grammar_bitmask(requests, spec_tokens)`, its torch bitmask
  handed back as numpy, as vLLM's is;
- `Request(...)`: tokenloom's Request (vLLM's pooling_params is tokenloom's too).
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from tokenloom.config import StructuredOutputsConfig  # noqa: F401  (vLLM's name)
from tokenloom.core.request import Request as _TLRequest
from tokenloom.core.structured_output import StructuredOutputManager as _TLManager
from tokenloom.core.structured_output import StructuredOutputRequest as _TLStructuredOutputRequest
from tokenloom.core.structured_output import compile_regex_with_timeout, strip_speculative_padding  # noqa: F401
from tokenloom.exceptions import VLLMClientError, VLLMValidationError  # noqa: F401
from tokenloom.model.grammar import (  # noqa: F401  (vLLM's names)
    choice_as_grammar,
    grammar_is_likely_lark,
    has_xgrammar_unsupported_json_features,
    make_xgrammar_backend,
    validate_structured_outputs,
    validate_xgrammar_grammar,
)
from tokenloom.reasoning.tag_reasoning_parser import ReasoningEnd  # noqa: F401
from tokenloom.reasoning.tag_reasoning_parser import TagReasoningParser as ParserEngineReasoningAdapter  # noqa: F401
from tokenloom.sampling_params import (  # noqa: F401
    MAX_STRUCTURED_OUTPUT_JSON_NESTING,
    STRUCTURAL_TAG_WRAPPER_NESTING,
    StructuredOutputsParams,
)
from tokenloom.sampling_params import SamplingParams as _TLSamplingParams

StructuredOutputsBackend = str


class SamplingParams(_TLSamplingParams):
    """tokenloom's SamplingParams with vLLM's two methods the tests call (see the module docstring)."""

    def _validate_structured_outputs(self, model_config: Any, structured_outputs_config: StructuredOutputsConfig,
                                     tokenizer: Any) -> None:
        if structured_outputs_config is not None and self.structured_outputs is not None:
            validate_structured_outputs(self.structured_outputs, structured_outputs_config)

    def update_from_generation_config(self, generation_config: dict[str, Any], model_eos_token_id: int | None) -> None:
        assert not generation_config, "the tests pass no generation config"
        self.eos_token_id = model_eos_token_id


# Tokenizers ------------------------------------------------------------------------------------------------------
@functools.cache
def _default_tokenizer() -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(None).hf


class AutoTokenizer:
    """transformers' AutoTokenizer for the tokenizers the tests name (gpt2): the default model's (module docstring)."""

    @staticmethod
    def from_pretrained(name: str, **_: Any) -> Any:
        assert name in ("gpt2", "openai-community/gpt2"), name
        return _default_tokenizer()


# Configs -----------------------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    tokenizer: str = "gpt2"
    skip_tokenizer_init: bool = False


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_model_len: int = 8192
    is_encoder_decoder: bool = False


@dataclass
class DeviceConfig:
    device: str = "cpu"


@dataclass
class SpeculativeConfig:
    model: str = "[ngram]"
    num_speculative_tokens: int = 0


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None


# The backend -------------------------------------------------------------------------------------------------------
class StructuredOutputOptions(enum.Enum):
    """vLLM's request types, each named by the StructuredOutputsParams field it comes from."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"


def _key(request_type: StructuredOutputOptions, grammar_spec: str) -> tuple[str, str]:
    """tokenloom's (kind, spec) for vLLM's (request type, spec)."""
    if request_type is StructuredOutputOptions.JSON_OBJECT:
        return StructuredOutputsParams(json_object=True).key
    value: Any = json.loads(grammar_spec) if request_type is StructuredOutputOptions.CHOICE else grammar_spec
    return StructuredOutputsParams(**{request_type.value: value}).key


class _Grammar:
    """A tokenloom matcher under vLLM's grammar methods (module docstring)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.matcher.is_terminated():
                return True
            if not self.matcher.accept_token(token):
                return False
        return True

    def fill_bitmask(self, bitmask: Any, index: int) -> None:
        self.matcher.fill_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


@functools.cache
def _xgrammar_backend(tokenizer: Any, vocab_size: int, disable_any_whitespace: bool) -> Any:
    """tokenloom's backend, built once per configuration for all the tests (each build reads the whole vocabulary,
    about half a second; the backend keeps no per-request state)."""
    config = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=disable_any_whitespace)
    return make_xgrammar_backend(tokenizer, vocab_size, config)


class XgrammarBackend:
    """vLLM's constructor and methods over tokenloom's xgrammar backend."""

    def __init__(self, vllm_config: VllmConfig, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.backend = _xgrammar_backend(tokenizer, vocab_size,
                                         vllm_config.structured_outputs_config.disable_any_whitespace)

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str,
                        stop_token_ids: set[int] | None = None) -> _Grammar:
        compiled = self.backend.compile(*_key(request_type, grammar_spec))
        return _Grammar(self.backend.matcher(compiled, sorted(stop_token_ids or ())))

    def allocate_token_bitmask(self, num_rows: int) -> Any:
        return self.backend.allocate_bitmask(num_rows)


class _GrammarNamedMatchers:
    """tokenloom's backend whose matchers also answer to vLLM's grammar methods, so that `structured_output_request
    .grammar` is what vLLM's tests drive (the harness feeds a prompt prefix through it)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def matcher(self, compiled: Any, stop_token_ids: Any) -> _Grammar:
        return _Grammar(self._backend.matcher(compiled, stop_token_ids))


# The manager and the request ----------------------------------------------------------------------------------------
class StructuredOutputManager(_TLManager):
    """tokenloom's manager, built from vLLM's config as tokenloom's engine builds it (module docstring)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        model_config = vllm_config.model_config
        self.tokenizer = None if model_config.skip_tokenizer_init else AutoTokenizer.from_pretrained(
            model_config.tokenizer)
        tokenizer, so_config = self.tokenizer, vllm_config.structured_outputs_config

        def backend() -> Any:
            return _GrammarNamedMatchers(_xgrammar_backend(tokenizer, len(tokenizer), so_config.disable_any_whitespace))

        super().__init__(backend if tokenizer is not None else None,
                         enable_in_reasoning=so_config.enable_in_reasoning)
        self._reasoner_cls: Any = None

    # vLLM fills the bitmask rows of a batch over this many requests on a second thread pool, which its test reads;
    # tokenloom has no such pool and fills every batch on the step's thread: no batch size reaches the threshold.
    fill_bitmask_parallel_threshold = float("inf")

    @property
    def reasoner_cls(self) -> Any:
        return self._reasoner_cls

    @reasoner_cls.setter
    def reasoner_cls(self, cls: Any) -> None:
        self._reasoner_cls = cls
        self._reasoner_factory = (lambda kwargs: cls(self.tokenizer, **kwargs)) if cls is not None else None

    def grammar_bitmask(self, requests: dict[str, Any], structured_output_request_ids: list[str],  # type: ignore
                        scheduled_spec_decode_tokens: dict[str, list[int]]) -> Any:
        if not structured_output_request_ids:
            return None
        bitmask = super().grammar_bitmask([requests[i] for i in structured_output_request_ids],
                                          scheduled_spec_decode_tokens)
        return bitmask.numpy()


def Request(request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, pooling_params: Any,
            reasoning_ended: bool | None = None, reasoning_parser_kwargs: dict[str, Any] | None = None) -> _TLRequest:
    return _TLRequest(request_id, prompt_token_ids, sampling_params, pooling_params=pooling_params,
                      reasoning_ended=reasoning_ended, reasoning_parser_kwargs=reasoning_parser_kwargs)


class StructuredOutputRequest(_TLStructuredOutputRequest):
    """vLLM's constructor (the request's params) and its `grammar` setter (the compile's future) over tokenloom's
    StructuredOutputRequest, which keeps the params' key and the future as `compiled`."""

    def __init__(self, params: StructuredOutputsParams) -> None:
        super().__init__(params.key)

    grammar = property(_TLStructuredOutputRequest.grammar.fget,
                       lambda self, future: setattr(self, "compiled", future))
