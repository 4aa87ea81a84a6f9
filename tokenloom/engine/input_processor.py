"""InputProcessor: a prompt made into checked token ids, in one place for every front end (vLLM's
InputProcessor, v1/engine/input_processor.py).

    prompt (text, token ids, or a dict of either) → tokenize → token ids in the vocabulary →
    fits the engine (not empty, room to generate within max_model_len, the KV pool can hold it) →
    Request(s) for the engine core

LLMEngine, the data-parallel LLM and AsyncLLM (the server) all take prompts through it, so a bad
prompt is refused with the same message whichever front end it came through. It also finishes the
request's SamplingParams where they need the tokenizer (bad_words into token ids, `process_params`):
the engine processes get the ids, never the tokenizer. What it checks against
is the engine core's EngineReady (the engine process sends it; an in-process engine makes its own).
The scheduler still refuses what it can never run (RequestRejected): the simulator and the replay
harness drive it with no front end.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from tokenloom.core.kv_cache_groups import KVCacheGroupSpec
from tokenloom.core.prompt_fit import prompt_fit, prompt_refusal
from tokenloom.core.scheduler import RequestRejected
from tokenloom.engine.core_messages import EngineReady
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:  # the tokenizer module imports torch
    from tokenloom.model.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]

# vLLM's words where an engine built with skip_tokenizer_init meets what needs the tokenizer it did not load.
TEXT_PROMPT_WITHOUT_TOKENIZER = "You cannot pass text prompts when `skip_tokenizer_init=True`"
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


class InvalidRequestError(RequestRejected):
    """The request can never be served as sent (a client error); `param` names the culprit field. A
    RequestRejected (a ValueError): what the scheduler would refuse, refused before it gets there."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, parameter=param)
        self.param = param


# The keys of vLLM's prompt dicts for inputs other than text and token ids (tokenloom/inputs.py).
_OTHER_INPUTS = ("prompt_embeds", "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "cache_salt")


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, info: EngineReady) -> None:
        """`tokenizer` None: the engine was built with skip_tokenizer_init (token-id prompts only)."""
        self.tokenizer = tokenizer
        self.info = info
        # The engine's custom logits processor classes (loaded here by name, as vLLM's input processor loads
        # them), whose validate_params every request passes.
        self._logits_processor_classes: list[Any] | None = None

    def encode(self, text: str) -> list[int]:
        """A text prompt's token ids; refused by vLLM's sentence when the engine loaded no tokenizer."""
        if self.tokenizer is None:
            raise InvalidRequestError(TEXT_PROMPT_WITHOUT_TOKENIZER, "prompt")
        return self.tokenizer.encode(text)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids): text is tokenized, token ids are checked."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            other = next((k for k in _OTHER_INPUTS if k in prompt), None)
            if other is not None:  # vLLM's other input kinds: refused, not silently run as the text alone
                raise InvalidRequestError(f"a prompt's {other!r} is not supported: tokenloom's models read text "
                                          "(give 'prompt' or 'prompt_token_ids')", "prompt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise InvalidRequestError(f"a prompt dict's 'prompt' must be a string, got "
                                              f"{type(prompt['prompt']).__name__}", "prompt")
                return prompt["prompt"], self.encode(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, list):
            return None, self.check_token_ids(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", "prompt")

    def check_token_ids(self, ids: Any, param: str = "prompt") -> list[int]:
        """Integers, each in the model's vocabulary (`param`: the request field they came in)."""
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", param)
        vocab = self.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of vocabulary (size {vocab})", param)
        return list(ids)

    def process_params(self, params: SamplingParams, prompt_len: int | None = None) -> SamplingParams:
        """The params the engine core gets, on a copy where they change (the caller's object may be shared by
        other requests): max_tokens unset filled from the context (`prompt_len`, vLLM's rule), bad_words as
        token-id sequences (vLLM's update_from_tokenizer). InvalidRequestError for a min_tokens past that
        max_tokens, a word that tokenizes to nothing, out of the model's vocabulary or past vLLM's bad-words
        bounds, and for a best_of other than n."""
        if params.best_of is not None and params.best_of != params.n:  # the server's rule (server/params.py)
            raise InvalidRequestError("best_of is not supported (other than equal to n)", "best_of")
        self.validate_logits_processors_params(params)
        if self.tokenizer is None:
            self._check_without_tokenizer(params)
        params = self._resolve_whole_vocabulary_logprobs(params)
        params = self._resolve_thinking_budget(params)
        if prompt_len is not None and params.max_tokens is None:
            params = self._fill_max_tokens(params, prompt_len)
        if not params.bad_words and params.bad_words_token_ids is None:
            return params
        params = copy.copy(params)
        try:
            params.update_from_tokenizer(self.tokenizer, self.info.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "bad_words") from None
        return params

    def _resolve_thinking_budget(self, params: SamplingParams) -> SamplingParams:
        """A thinking_token_budget needs a reasoning parser (vLLM's words); its start / end tokens go with the request
        to the runner (on a copy). tokenloom does not combine it with speculative decoding (vLLM forces the end
        inside the drafts' rows; here the budget reads one token a step)."""
        if params.thinking_token_budget is None:
            return params
        ids = getattr(self.info, "reasoning_token_ids", None)
        if ids is None:
            raise InvalidRequestError("thinking_token_budget is set but reasoning_config is not configured. Please "
                                      "set --reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
                                      "thinking_token_budget")
        if getattr(self.info, "num_speculative_tokens", 0):
            raise InvalidRequestError("thinking_token_budget is not supported with speculative decoding in tokenloom: "
                                      "start the engine without --speculative-config to use it",
                                      "thinking_token_budget")
        params = copy.copy(params)
        params._thinking_token_ids = ids
        return params

    def _fill_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """vLLM's process_inputs: max_tokens unset means up to max_model_len, made explicit here, and only now can
        min_tokens be held to it (SamplingParams checks it against a max_tokens that was given). check_prompt
        has made sure the prompt leaves room for one token."""
        max_tokens = max(self.info.max_model_len - prompt_len, 1)
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                                      f"{params.min_tokens}.", "min_tokens")
        params = copy.copy(params)
        params.max_tokens = max_tokens
        return params

    def _resolve_whole_vocabulary_logprobs(self, params: SamplingParams) -> SamplingParams:
        """vLLM's -1 for logprobs / prompt_logprobs, the whole vocabulary, as the count the runner takes (on a
        copy: the caller's params may be shared); a count past the vocabulary is refused (vLLM's cap there)."""
        vocab = self.info.vocab_size
        resolved = {}
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            n = getattr(params, name)
            if n == -1:
                resolved[name] = vocab
            elif n is not None and n > vocab:
                raise InvalidRequestError(f"Requested {what} logprobs of {n}, which is greater than max allowed: "
                                          f"{vocab}", name)
        if not resolved:
            return params
        params = copy.copy(params)
        for name, n in resolved.items():
            setattr(params, name, n)
        return params

    def validate_logits_processors_params(self, params: SamplingParams) -> None:
        """Each custom logits processor's validate_params (vLLM's, where a request is added): its refusal is a
        VLLMValidationError for this request alone."""
        names = getattr(self.info, "logits_processors", None)
        if not names:
            return
        from tokenloom.sample.logits_processor import _load_logitsprocs_by_fqcns, validate_with

        if self._logits_processor_classes is None:
            self._logits_processor_classes = _load_logitsprocs_by_fqcns(names)
        for cls in self._logits_processor_classes:
            try:
                validate_with(cls, params)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from exc

    @staticmethod
    def _check_without_tokenizer(params: SamplingParams) -> None:
        """skip_tokenizer_init: what needs text is refused, not run without it. vLLM refuses a grammar here and
        ignores stop strings (no detokenizer sees the text); tokenloom refuses those too rather than let a
        request run past the stop its caller asked for."""
        if params.structured_outputs is not None:
            from tokenloom.core.structured_output import NO_TOKENIZER_ERROR

            raise InvalidRequestError(NO_TOKENIZER_ERROR, "structured_outputs")
        if params.stop:
            raise InvalidRequestError("stop strings are matched on the detokenized text, and skip_tokenizer_init=True "
                                      "loads no tokenizer: give stop_token_ids instead", "stop")
        if params.bad_words:
            raise InvalidRequestError("bad_words needs the model's tokenizer, and this engine has none", "bad_words")

    def check_logprobs(self, params: SamplingParams, max_logprobs: int) -> None:
        """vLLM's engine-side cap (SamplingParams._validate_logprobs, its words): logprobs and prompt_logprobs at
        most `max_logprobs` (-1, as either: the whole vocabulary)."""
        vocab = self.info.vocab_size
        cap = vocab if max_logprobs == -1 else max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            n = getattr(params, name)
            n = vocab if n == -1 else n
            if n and n > cap:
                raise InvalidRequestError(f"Requested {what} logprobs of {n}, which is greater than max allowed: "
                                          f"{cap}", name)

    def check_generation_model(self) -> None:
        """A generation request needs a generation model."""
        pooling = self.info.pooling
        if pooling is not None:
            raise InvalidRequestError(
                f"The model `{self.info.model_name}` is a pooling model (tasks: "
                f"{', '.join(pooling.supported_tasks)}) and does not support generation: use LLM.embed / classify / "
                "score / encode, or the server's /v1/embeddings, /pooling, /classify, /score or /rerank")

    def check_pooling_model(self) -> None:
        """A pooling request (embed, classify, score) needs a pooling model."""
        if self.info.pooling is None:
            raise InvalidRequestError(
                f"The model `{self.info.model_name}` is a generation model and does not support pooling "
                "(embeddings, classification, scores): use a pooling model (--runner pooling)")

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams, *, max_tokens_in_context: bool
                     ) -> None:  # fmt: skip
        """What the scheduler would refuse, said up front with vLLM's wording. `max_tokens_in_context`:
        also refuse a max_tokens past the context (the OpenAI server does, as vLLM's serving layer; the
        offline LLM lets such a request stop at max_model_len, as vLLM's LLM)."""
        info = self.info
        n_prompt, max_len = len(prompt_token_ids), info.max_model_len
        groups = [KVCacheGroupSpec((0,), w) for w in info.kv_cache_group_windows]
        fit = prompt_fit(n_prompt, params.effective_max_tokens, max_len, info.block_size, info.num_blocks, groups,
                         info.max_in_flight_tokens)
        if not fit.empty:  # (an empty prompt is said to be empty first)
            self.check_token_ids(prompt_token_ids)
            try:  # vLLM's processor refuses these too; an id past the vocabulary would index past the logits row
                params.check_vocab(info.vocab_size)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), str(exc).split(" ", 1)[0]) from None
        refusal = prompt_refusal(fit, max_tokens=params.max_tokens, max_tokens_in_context=max_tokens_in_context)
        if refusal is not None:
            raise InvalidRequestError(refusal.message, refusal.param)


def truncate_prompt_ids(ids: list[int], keep: int | None, max_model_len: int, side: str = "left") -> list[int]:
    """vLLM's truncate_prompt_tokens: keep `keep` tokens (-1: as many as leave room for one output token),
    the last ones by default (truncation side "left"), the first ones with "right"; None keeps them all."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len="
                                  f"{max_model_len}. Please request a smaller truncation size.",
                                  "truncate_prompt_tokens")
    if keep < 0:
        keep = max_model_len - 1
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]


def check_lora_request(lora_request: Any, lora_config: Any) -> None:
    """A request's lora_request, before it reaches the engine core: a LoRARequest, and LoRA enabled."""
    from tokenloom.lora.request import LoRARequest

    if not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError("lora_request must be a LoRARequest (tokenloom.lora.request), got "
                                  f"{type(lora_request).__name__}", "lora_request")
    if lora_config is None:
        raise InvalidRequestError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled "
                                  "(LLM(enable_lora=True), --enable-lora)", "lora_request")
