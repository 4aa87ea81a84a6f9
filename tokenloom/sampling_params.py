"""SamplingParams: how one request samples and when it stops (vLLM's offline API shape).

Pure Python: the scheduler core reads the stop conditions, the model's sampler reads the rest.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from tokenloom import envs
from tokenloom.exceptions import ValidationError

# vLLM's words for a constrained request on an engine without a tokenizer (skip_tokenizer_init).
NO_TOKENIZER_ERROR = "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"

# A token limit large enough to mean "until max_model_len" (vLLM leaves max_tokens=None for that).
_UNLIMITED = 1 << 30


class RequestOutputKind(enum.Enum):
    """When the engine hands out a RequestOutput for a request (vLLM's names)."""

    CUMULATIVE = 0  # after every step that advanced it: the text and tokens so far (+ this step's delta_*)
    DELTA = 1  # after every step that advanced it: only what is new (text, token_ids, logprobs, prompt_logprobs)
    FINAL_ONLY = 2  # once, when it finishes (LLM.generate: nothing reads the partial ones)


# StructuredOutputsParams' constraints, of which a request sets exactly one.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one constraint on what a request may generate.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex; choice: one of
    these strings; grammar: EBNF (GBNF) or Lark text; structural_tag: xgrammar's structural tag (JSON
    text). Making one checks that exactly one is set and each has its type; what a constraint holds is
    checked when the request is (`check_request`, then the grammar library: tokenloom/model/grammar.py
    validate_structured_outputs), as vLLM checks it in SamplingParams._validate_structured_outputs.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON without optional whitespace (vLLM's option; the default allows any, as JSON does).
    disable_any_whitespace: bool = False
    # vLLM's options for its guidance / outlines backends, taken so that vLLM's calls construct: xgrammar's
    # JSON is always what disable_additional_properties asks for (no property the schema does not name), so
    # either value runs the same; whitespace_pattern is refused when the request is added (xgrammar has none).
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # vLLM's: the backend the request was checked for, set by that check (the engine's; "xgrammar" for "auto",
    # with _backend_was_auto); a request that names another backend than the engine's is refused.
    _backend: str | None = field(default=None, init=False)
    _backend_was_auto: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        kinds = [k for k in _CONSTRAINTS if getattr(self, k) is not None]
        if len(kinds) > 1:  # vLLM's words
            raise ValidationError(f"You can only use one kind of structured outputs constraint but multiple are "
                                  f"specified: {kinds}", parameter="structured_outputs")
        if not kinds:
            raise ValidationError(f"You must use one kind of structured outputs constraint but none are specified: "
                                  f"{list(_CONSTRAINTS)}", parameter="structured_outputs")
        self._check_types()

    def _check_types(self) -> None:
        """Each constraint of its type, so a wrong one is refused by name instead of failing in a grammar compiler."""
        def bad(message: str) -> None:
            raise ValidationError(message, parameter="structured_outputs")

        if self.choice is not None and (not isinstance(self.choice, list)
                                        or not all(isinstance(c, str) for c in self.choice)):
            bad("structured_outputs.choice must be a list of strings")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                bad(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            bad("structured_outputs.json must be a JSON schema (an object or its JSON text)")

    def check_request(self, backend: str) -> None:
        """vLLM's request checks (SamplingParams._validate_structured_outputs, before its backend's own), in its
        order and words, for an engine whose structured-output backend is `backend`: no other backend asked for,
        nothing that asks for no constraint or that a grammar compiler must not see. Records the backend."""
        if self._backend:
            if backend != self._backend and not (backend == "auto" and self._backend_was_auto):
                raise ValidationError(
                    "Request-level structured output backend selection is not supported. The request specified "
                    f"'{self._backend}', but vLLM was initialised with '{backend}'. This error can be resolved by "
                    "removing '_backend' from the request.", parameter="structured_outputs")
        else:
            self._backend = backend
        self._check_content()

    def _check_content(self) -> None:
        def bad(message: str) -> None:
            raise ValidationError(message, parameter="structured_outputs")

        if self.choice == []:
            bad("Choice '[]' cannot be an empty list")
        for name in ("grammar", "json"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                bad(f"structured_outputs.{name} cannot be an empty string")
        check_json_nesting(self.json)  # vLLM's bound, before a grammar compiler sees a hostile depth
        check_json_nesting(self.structural_tag, structural_tag=True)
        if self.json_object is False:
            bad("structured_outputs.json_object must be True if set; omit structured_outputs to disable structured "
                "outputs")
        if self.regex and "\x00" in self.regex:  # before xgrammar's regex converter sees it
            bad("structured_outputs.regex must not contain a NUL character ('\\x00')")
        # An empty regex is a constraint (the empty text: only the end may follow), as in vLLM; these are not.
        if isinstance(self.structural_tag, str) and not self.structural_tag.strip():
            bad("structured_outputs.structural_tag cannot be an empty string")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): what a compiled grammar is cached under."""
        ws = "compact|" if self.disable_any_whitespace else "any|"
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", ws + spec
        if self.json_object:
            return "json_object", ws
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.structural_tag is None:  # json_object=False, which check_request refuses
            raise ValidationError("structured_outputs.json_object must be True if set; omit structured_outputs to "
                                  "disable structured outputs", parameter="structured_outputs")
        return "structural_tag", self.structural_tag


@dataclass
class RepetitionDetectionParams:
    """vLLM's `RepetitionDetectionParams`: end a request whose output ends in an N-gram repeated `min_count`
    times in a row, for some N in [min_pattern_size, max_pattern_size] (its finish_reason is "repetition",
    its stop_reason "repetition_detected"; checked by the scheduler after each output token, once min_tokens
    are out: tokenloom/core/repetition.py). max_pattern_size 0 turns it off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0  # at least 2 when max_pattern_size is set

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValidationError(f"repetition_detection.{name} must be an integer, got {value!r}",
                                      parameter="repetition_detection")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValidationError("max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                                  "max_pattern_size. Set both to 0 to disable repetitive pattern detection.",
                                  parameter="repetition_detection")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValidationError("min_count must be >= 2 to detect repetitive patterns in engine output. If you do "
                                  "not wish to detect repetitive patterns, set max_pattern_size to 0.",
                                  parameter="repetition_detection")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs of each sampled token (0: only the sampled one)
    # Log-probabilities of these tokens at every sampled position, in place of the top-n (vLLM's
    # logprob_token_ids; needs logprobs set, as in vLLM's API).
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # top-n logprobs of each prompt token (the first has none)
    # Added to the logits before sampling (token id -> bias, clamped to [-100, 100] as in vLLM).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Words never to generate (vLLM's bad_words): the engine turns each into token-id sequences with the
    # model's tokenizer (update_from_tokenizer); the sampler bans a sequence's last token once the outputs
    # end with the rest of it.
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: a DELTA stream's outputs carry at least this many new tokens (the first and the last excepted);
    # raises the engine's --stream-interval, a value below it counts as it (None: the engine's).
    stream_interval: int | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar): vLLM's field of the same name.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine from the model (None: no EOS, e.g. in replay traces).
    eos_token_id: int | None = field(default=None, repr=False)
    # A cap on logprobs / prompt_logprobs checked when the params are made (-1, the default: none here). The
    # engine holds every request to its own max_logprobs when it is added (LLM(max_logprobs=N), default 20;
    # the server's --max-logprobs), as vLLM's does; this is for callers that want the check up front.
    max_logprobs: int = field(default=-1, repr=False)
    # bad_words as token-id sequences, filled in by the engine's input processor (vLLM's private
    # _bad_words_token_ids): an init field, so dataclasses.replace (n > 1 fan-out, extra EOS ids) keeps it.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # vLLM's extra_args: what the engine passes through to its parts; "kv_transfer_params" reaches the KV
    # connector (disaggregated prefill: tokenloom/kv_transfer, docs/kv_offload.md).
    extra_args: dict[str, Any] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as max_model_len allows), applied where the
    # engine takes the prompt in (LLMEngine.add_request; the server has its own request field).
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True  # False: token ids only, the outputs' text stays "" (no stop strings then)
    # vLLM's: False asks that consecutive special (added) tokens be detokenized with no space between them (vLLM's
    # fast detokenizer emits each one's raw string after another); tokenloom's tokenizers are fast ones, whose decode
    # never puts a space there, so both values give that text.
    spaces_between_special_tokens: bool = True
    # vLLM V1's field too, and refused there as here: per-request Python callables do not run in the
    # batched sampler. The engine-level ones do (vLLM's --logits-processors, tokenloom/sample/logits_processor);
    # AdapterLogitsProcessor runs per-request callables through one.
    logits_processors: Any = field(default=None, repr=False)
    # vLLM's field; as in vLLM V1, a best_of other than n is refused when the request is added (the engine's
    # input processor, with the server's words), not when the params are made.
    best_of: int | None = field(default=None, repr=False)
    # vLLM's: hand logprobs and prompt_logprobs back as a tokenloom.logprobs.FlatLogprobs (a few flat lists
    # read as the list of dicts is) instead of one dict per position, for less garbage-collector work.
    flat_logprobs: bool = False
    # vLLM's: at most this many tokens of thinking (after the reasoning parser's start string), then its end string
    # is forced (tokenloom/model/thinking_budget.py); None (or -1, unlimited) off. Needs --reasoning-parser.
    thinking_token_budget: int | None = None
    # The reasoning parser's start and end strings as token ids, filled in by the engine's input processor for a
    # request with a thinking_token_budget (vLLM keeps them in its ReasoningConfig; here they travel with the
    # request to every rank that samples). An init field, so dataclasses.replace keeps it.
    _thinking_token_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, repr=False,
                                                                                 compare=False)
    # vLLM's: end the request early when its output starts repeating itself (RepetitionDetectionParams; a dict
    # of its fields is taken too).
    repetition_detection: RepetitionDetectionParams | None = None

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's: the fields given as None take their defaults (what an API layer with optional fields needs)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy, safe to change without touching this one."""
        return copy.deepcopy(self)

    def __post_init__(self) -> None:
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValidationError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if self.extra_args:
            _check_extra_args_integers(self.extra_args)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):  # list() of a number or a dict would fail, or succeed, obscurely
            value = getattr(self, name)
            if value is not None and not isinstance(value, list | tuple):
                raise ValidationError(f"{name} must be a list, got {type(value).__name__}")
        self.stop = list(self.stop or [])
        # vLLM's: a stop token id given twice stops once (order kept).
        self.stop_token_ids = _unique(self.stop_token_ids or [])
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = _repetition_detection(self.repetition_detection)
        # vLLM's: `logprobs=True` asks for one (a bool is an int to Python, not to torch's topk).
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if self.bad_words is not None:
            self.bad_words = _bad_words_list(self.bad_words)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValidationError(f"logit_bias must be a dict of token id to bias, got "
                                  f"{type(self.logit_bias).__name__}")
        for name in _NUMBER_FIELDS:  # before any comparison, which would raise a TypeError naming no field
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValidationError(f"{name} must be a number, got {value!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM: -1 means no seed
            self.seed = None
        if self.logit_bias:
            self.logit_bias = _logit_bias_ids(self.logit_bias)
        self.thinking_token_budget = validate_thinking_token_budget(self.thinking_token_budget)
        self._verify()

    def _verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValidationError(msg)

        verify_num_sequences(self.n, "n")
        if not math.isfinite(self.temperature):
            bad(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            bad(f"temperature must be in [0, 2], got {self.temperature}.")
        if self.greedy and self.n > 1:  # vLLM: n greedy samples would all be the same text
            bad(f"n must be 1 when using greedy sampling, got {self.n}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:  # True: a failed topk
            bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not math.isfinite(self.repetition_penalty):
            bad(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int):
            bad(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if self.min_tokens < 0:  # vLLM's words, which its tests (test_min_tokens.py) match
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        # vLLM's: a count, or -1 for the whole vocabulary (the engine resolves it and holds it to its cap).
        cap = self.max_logprobs if self.max_logprobs >= 0 else 1 << 62
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not -1 <= self.logprobs <= cap):
            bad(f"logprobs must be non-negative or -1 (the whole vocabulary), at most {cap}, got {self.logprobs!r}"
                if cap < 1 << 62 else f"logprobs must be non-negative or -1, got {self.logprobs!r}.")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            bad(f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not -1 <= self.prompt_logprobs <= cap
        ):
            bad(f"prompt_logprobs must be non-negative or -1 (the whole vocabulary), at most {cap}, got "
                f"{self.prompt_logprobs!r}" if cap < 1 << 62
                else f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs!r}.")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if ids is not None and (not isinstance(ids, list | tuple) or not ids
                                    or any(not isinstance(t, int) or t < 0 for t in ids)):
                bad(f"{name} must be a non-empty list of non-negative token ids")
        if self.logprob_token_ids is not None and self.logprobs is None:
            bad("logprob_token_ids needs logprobs set")
        if self.logit_bias and any(t < 0 for t in self.logit_bias):
            bad("logit_bias keys must be non-negative token ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop strings must be non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.stream_interval is not None and (isinstance(self.stream_interval, bool)
                                                 or not isinstance(self.stream_interval, int)
                                                 or self.stream_interval < 1):  # vLLM's words
            raise ValidationError(f"stream_interval must be at least 1, got {self.stream_interval}.",
                                  parameter="stream_interval", value=self.stream_interval)
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1):
            bad(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k!r}")
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            bad(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.logits_processors:
            bad("per-request logits_processors are not supported (neither are they in vLLM V1); use logit_bias, "
                "allowed_token_ids, bad_words, structured_outputs, or the engine's logits_processors (vLLM's "
                "batch-level LogitsProcessor classes; AdapterLogitsProcessor wraps per-request callables)")
        if self.repetition_detection is not None and not isinstance(self.repetition_detection,
                                                                    RepetitionDetectionParams):
            bad(f"repetition_detection must be a RepetitionDetectionParams, got "
                f"{type(self.repetition_detection).__name__}")
        if not isinstance(self.spaces_between_special_tokens, bool):
            bad(f"spaces_between_special_tokens must be true or false, got {self.spaces_between_special_tokens!r}")
        if not self.detokenize and self.stop:  # vLLM's rule: stop strings are matched on the text
            bad("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given as parameters must exist in the model's vocabulary (ValueError naming the field)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logprob_token_ids", self.logprob_token_ids or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValidationError(f"{name} has token id {bad}, out of vocabulary (size {vocab_size})",
                                      parameter=name)
        invalid = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if invalid:  # vLLM's words (_validate_stop_token_ids)
            raise ValidationError(f"token_id(s) {invalid[:20]} in stop_token_ids contain out-of-vocab token ids. "
                                  f"Vocabulary size: {vocab_size}", parameter="stop_token_ids", value=invalid)

    def verify(self, model_config: Any, speculative_config: Any = None, structured_outputs_config: Any = None,
               tokenizer: Any = None) -> None:
        """vLLM's SamplingParams.verify: what depends on the model, for a caller holding a model config (its
        get_vocab_size() and max_logprobs, -1 for the whole vocabulary): logprobs and prompt_logprobs within
        max_logprobs, token ids within the vocabulary, and a tokenizer for structured outputs. Custom logits
        processors' validate_params is not run here (vLLM leaves it to admission too: the engine's
        InputProcessor). Speculative decoding refuses nothing here: tokenloom's drafts are verified under
        min_p and logit_bias, which vLLM refuses with them."""
        vocab_size = model_config.get_vocab_size()
        max_logprobs = getattr(model_config, "max_logprobs", -1)
        cap = vocab_size if max_logprobs == -1 else max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            n = getattr(self, name)
            n = vocab_size if n == -1 else n
            if n and n > cap:
                raise ValidationError(f"Requested {what} logprobs of {n}, which is greater than max allowed: {cap}",
                                      parameter=name, value=n)
        self.check_vocab(vocab_size)
        if self.structured_outputs is not None and structured_outputs_config is not None and tokenizer is None:
            raise ValidationError(NO_TOKENIZER_ERROR, parameter="structured_outputs")

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        """vLLM's update_from_tokenizer: bad_words as token-id sequences (bad_words_token_ids).

        Each word is tokenized as written (left-stripped) and with a leading space, so that it is banned
        at the start of the text and after a space alike; the spaced form is kept only where it starts
        with another token and has as many tokens (else it is the same ban, or a different split that
        vLLM does not ban). `vocab_size`: the bound ids must stay under (the model's logits row;
        default the tokenizer's max_token_id + 1). ValidationError for a word that tokenizes to nothing,
        to ids out of the vocabulary, or past vLLM's bounds: VLLM_MAX_NUM_BAD_WORDS sequences (checked as
        they are made, so a request of many words stops tokenizing there) and VLLM_MAX_BAD_WORDS_TOTAL_TOKENS
        tokens in all (the sampler holds them per request)."""
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        limits = _BadWordsLimits(envs.VLLM_MAX_NUM_BAD_WORDS, envs.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain: list[int] = []
            for add_prefix_space in (False, True):
                prompt = (" " if add_prefix_space else "") + word.lstrip()
                ids = list(tokenizer.encode(prompt, add_special_tokens=False))
                if not add_prefix_space:
                    if not ids:  # vLLM indexes the first id; a word of spaces (or one the tokenizer drops) has none
                        raise ValidationError(f"bad_words entries must tokenize to at least one token. Got {word!r}.",
                                              parameter="bad_words", value=self.bad_words)
                    plain = ids
                elif not ids or ids[0] == plain[0] or len(ids) != len(plain):
                    continue
                sequences.append(ids)
                limits.check(sequences, self.bad_words)
        bound = vocab_size if vocab_size is not None else _tokenizer_vocab_size(tokenizer)
        invalid = [t for ids in sequences for t in ids if not 0 <= t < bound]
        if invalid:
            raise ValidationError(f"The model vocabulary size is {bound}, but the following tokens were specified as "
                                  f"bad: {invalid}. All token id values should be integers satisfying: 0 <= token_id "
                                  f"<= {bound - 1}.", parameter="bad_words", value=self.bad_words)
        self._bad_words_token_ids = sequences

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """bad_words as token-id sequences, once the engine tokenized them (None before, or without words)."""
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_max_tokens(self) -> int:
        return _UNLIMITED if self.max_tokens is None else self.max_tokens

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the request (EOS unless ignored, plus stop_token_ids)."""
        ids = set(self.stop_token_ids or ())
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return ids


# vLLM's bound on nested objects and arrays in a structured-output JSON schema (grammar compilation
# grows steeply with nesting; OpenAI allows 10 levels), and the extra levels a structural tag's wrapper
# adds around its schemas.
MAX_STRUCTURED_OUTPUT_JSON_NESTING = 64
STRUCTURAL_TAG_WRAPPER_NESTING = 16


def max_n_sequences() -> int:
    """VLLM_MAX_N_SEQUENCES (vLLM's variable, default 16384): the most samples one request may ask for."""
    return envs.VLLM_MAX_N_SEQUENCES


def verify_num_sequences(value: Any, name: str) -> None:
    """vLLM's _verify_num_sequences, its messages."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an int, but is of type {type(value)}", parameter=name)
    if value < 1:
        raise ValidationError(f"{name} must be at least 1, got {value}.", parameter=name)
    cap = max_n_sequences()
    if value > cap:
        raise ValidationError(f"{name} must be at most {cap}, got {value}. To increase this limit, set the "
                              "VLLM_MAX_N_SEQUENCES environment variable.", parameter=name)


def _repetition_detection(fields: dict[str, Any]) -> RepetitionDetectionParams:
    """RepetitionDetectionParams from a dict of its fields (an API request's JSON object)."""
    unknown = sorted(set(fields) - {"max_pattern_size", "min_pattern_size", "min_count"}, key=str)
    if unknown:
        raise ValidationError(f"repetition_detection has unknown field(s) {unknown[:5]}; its fields are "
                              "max_pattern_size, min_pattern_size and min_count", parameter="repetition_detection")
    return RepetitionDetectionParams(**fields)


@dataclass
class _BadWordsLimits:
    """vLLM's bounds on a request's bad_words once tokenized (VLLM_MAX_NUM_BAD_WORDS sequences,
    VLLM_MAX_BAD_WORDS_TOTAL_TOKENS tokens), in vLLM's words."""

    max_sequences: int
    max_total_tokens: int
    total_tokens: int = 0

    def check(self, sequences: list[list[int]], words: list[str]) -> None:
        """After each sequence is added, so that a request of many words stops tokenizing at the bound."""
        if len(sequences) > self.max_sequences:
            raise ValidationError(f"Too many bad words after tokenization: {len(sequences)}. The max number is "
                                  f"{self.max_sequences}.", parameter="bad_words", value=words)
        self.total_tokens += len(sequences[-1])
        if self.total_tokens > self.max_total_tokens:
            raise ValidationError(f"Too many total bad word tokens: {self.total_tokens}. The max is "
                                  f"{self.max_total_tokens}.", parameter="bad_words", value=words)


def _tokenizer_vocab_size(tokenizer: Any) -> int:
    """The ids a tokenizer can give: vLLM's max_token_id + 1, else its vocab_size."""
    max_token_id = getattr(tokenizer, "max_token_id", None)
    return max_token_id + 1 if isinstance(max_token_id, int) else tokenizer.vocab_size


def _unique(values: Any) -> list[Any]:
    """The values in order, each once (vLLM's dict.fromkeys); unhashable ones are left for the type check."""
    try:
        return list(dict.fromkeys(values))
    except TypeError:
        return list(values)


# extra_args cross to the engine process; vLLM's MessagePack transport carries 64-bit integers only.
_EXTRA_ARGS_INT_RANGE = (-(2**63), 2**64)


def _check_extra_args_integers(extra_args: dict[str, Any]) -> None:
    """vLLM's _verify_extra_args: every integer in extra_args, however nested (dicts' keys too), within
    [-2**63, 2**64); walked without recursion, each container once (they may be shared, or hold themselves)."""
    low, high = _EXTRA_ARGS_INT_RANGE
    pending: list[Any] = [extra_args]
    visited: set[int] = set()
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not low <= value < high:
            raise ValidationError("extra_args integers must be between -2**63 and 2**64 - 1.", parameter="extra_args")
        if isinstance(value, dict | list | tuple) and id(value) not in visited:
            visited.add(id(value))
            if isinstance(value, dict):
                pending.extend(value.keys())
                pending.extend(value.values())
            else:
                pending.extend(value)


# The float fields __post_init__ compares and computes with; an int is a number too (temperature=1).
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def validate_thinking_token_budget(value: Any) -> int | None:
    """vLLM's: a non-negative integer, or -1 (or None) for unlimited, which is None."""
    if value is None:
        return None
    if isinstance(value, bool | float) or not isinstance(value, int) or value < -1:
        raise ValidationError("`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
                              parameter="thinking_token_budget", value=value)
    return None if value == -1 else value


def _logit_bias_ids(logit_bias: dict) -> dict[int, float]:
    """Token-id keys (JSON gives strings), biases clamped to [-100, 100]; every key that is not an
    integer named in one error (vLLM's message)."""
    out: dict[int, float] = {}
    invalid = []
    for token, bias in logit_bias.items():
        try:
            token_id = int(token)
        except (ValueError, TypeError):  # also a key of thousands of digits (int()'s digit limit)
            invalid.append(token)
            continue
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise ValidationError(f"logit_bias values must be finite numbers, got {bias!r} for token {token_id}")
        out[token_id] = min(max(float(bias), -100.0), 100.0)
    if invalid:
        shown = [t[:40] + "..." if isinstance(t, str) and len(t) > 40 else t for t in invalid[:10]]
        raise ValidationError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {shown!r}")
    return out


def _bad_words_list(words: Any) -> list[str]:
    """bad_words as a list of strings; a bare string is refused (iterated, it would ban letter by letter)."""
    if not isinstance(words, list | tuple):
        raise ValidationError(f"bad_words must be a list of strings, got {type(words).__name__}")
    for word in words:
        if not isinstance(word, str):
            raise ValidationError(f"bad_words must be a list of strings, got an entry of type {type(word).__name__}")
    if any(not word for word in words):  # vLLM's words
        raise ValidationError(f"bad_words cannot contain an empty string. Got bad_words={list(words)[:20]}",
                              parameter="bad_words")
    return list(dict.fromkeys(words))  # vLLM's: a word given twice is banned once (order kept)


def _exceeds_json_nesting(spec: Any, limit: int) -> bool:
    """Whether a JSON document (or its text) nests objects and arrays deeper than `limit`, walked level
    by level (no recursion, so a hostile depth cannot overflow the stack)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except RecursionError:
            return True
        except ValueError:  # malformed JSON is the grammar backend's to report
            return False
    level: list[Any] = [spec]
    for _ in range(limit):
        children = (child for node in level if isinstance(node, (dict, list))
                    for child in (node.values() if isinstance(node, dict) else node))  # fmt: skip
        level = [child for child in children if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def check_json_nesting(spec: Any, *, structural_tag: bool = False) -> None:
    """vLLM's check_json_nesting: refuse a schema nested more than MAX_STRUCTURED_OUTPUT_JSON_NESTING
    levels (a structural tag gets its wrapper's levels on top)."""
    limit = MAX_STRUCTURED_OUTPUT_JSON_NESTING + (STRUCTURAL_TAG_WRAPPER_NESTING if structural_tag else 0)
    if spec and _exceeds_json_nesting(spec, limit):
        raise ValidationError("The JSON schema is nested too deeply: objects and arrays may nest at most "
                              f"{MAX_STRUCTURED_OUTPUT_JSON_NESTING} levels")


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`: beam search over the engine (tokenloom/engine/beam_search.py).

    Each step every live beam is a one-token request asking for 2 * beam_width logprobs; candidates
    are ranked by cumulative logprob, and the finished ones by cumulative logprob / length **
    length_penalty (length counts the prompt, as vLLM's does). `structured_outputs` constrains every
    beam (LLM.beam_search only, as in vLLM; the server refuses it with use_beam_search).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        verify_num_sequences(self.beam_width, "beam_width")  # vLLM's: VLLM_MAX_N_SEQUENCES bounds beams too
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValidationError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or self.temperature < 0.0:
            raise ValidationError(f"temperature must be non-negative, got {self.temperature!r}")
        if not isinstance(self.length_penalty, int | float) or self.length_penalty != self.length_penalty:
            raise ValidationError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValidationError("structured_outputs must be a StructuredOutputsParams, got "
                                  f"{type(self.structured_outputs).__name__}")
        # Refused rather than ignored: tokenloom's beam search does not watermark beams.
        if self.watermarking:
            raise ValidationError("watermarking is not supported")
