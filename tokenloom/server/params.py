"""Request bodies → what the engine takes: token-id prompts and SamplingParams (errors are HTTP 400)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from tokenloom import envs
from tokenloom.engine.generation_config import server_default
from tokenloom.engine.input_processor import (
    NO_TOKENIZER,
    TEXT_PROMPT_WITHOUT_TOKENIZER,
    InvalidRequestError,
    truncate_prompt_ids,
)
from tokenloom.engine.llm_args import part_text
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams, verify_num_sequences
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    SamplingRequest,
)

if TYPE_CHECKING:
    from tokenloom.model.tokenizer import Tokenizer

_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def resolve_logprobs(value: int | None, name: str, vocab_size: int, max_logprobs: int) -> int | None:
    """vLLM's rule: -1 means every token of the vocabulary, allowed only when --max-logprobs allows it
    (-1, or at least the vocabulary); otherwise 0..max_logprobs."""
    if value is None:
        return None
    whole = max_logprobs < 0 or max_logprobs >= vocab_size
    if value == -1 and whole:
        return vocab_size
    cap = vocab_size if whole else max_logprobs
    if not 0 <= value <= cap:
        raise APIError(400, f"{name} must be an integer in [0, {cap}]"
                            f"{' or -1 (all tokens)' if whole else ' (-1, all tokens, needs --max-logprobs -1)'},"
                            f" got {value}", name)
    return value


def _check_common(req: SamplingRequest, vocab_size: int) -> None:
    try:  # vLLM's bounds (VLLM_MAX_N_SEQUENCES) and its messages
        verify_num_sequences(req.n, "n")
    except ValueError as exc:
        raise APIError(400, str(exc), "n") from None
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
        # vLLM: stream options (an empty object aside) only make sense on a stream.
        raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    if req.logit_bias:
        bad_keys = [k for k in req.logit_bias if not k.strip().lstrip("-").isdigit()]
        if bad_keys:  # every bad key, not just the first (vLLM)
            raise APIError(400, f"logit_bias keys must be token ids, got {', '.join(repr(k[:40]) for k in bad_keys)}",
                           "logit_bias")
        # A key of more digits than any vocabulary has is out of it (and int() refuses >4,300 digits).
        out = [k.strip() for k in req.logit_bias
               if len(k.strip().lstrip("-")) > 18 or not 0 <= int(k) < vocab_size]  # fmt: skip
        if out:
            raise APIError(400, f"logit_bias has token id {out[0][:40]}, out of vocabulary (size {vocab_size})",
                           "logit_bias")
    for name in ("allowed_token_ids", "logprob_token_ids", "stop_token_ids"):
        ids = getattr(req, name) or []
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{name} has token id {bad}, out of vocabulary (size {vocab_size})", name)
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise APIError(400, "allowed_token_ids must not be empty", "allowed_token_ids")
    if req.prompt_logprobs is not None and req.stream and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1):
        raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if req.truncation_side is not None and req.truncate_prompt_tokens is None:
        raise APIError(400, "truncation_side needs truncate_prompt_tokens", "truncation_side")


def _sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None, max_logprobs: int = 20,
                     defaults: dict[str, Any] | None = None,
                     structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """`defaults`: the model's generation_config defaults, for the fields the request leaves unset."""
    d = defaults or {}
    try:
        return SamplingParams(
            # Beam search builds its own BeamSearchParams (width n); these are only its max_tokens.
            n=1 if getattr(req, "use_beam_search", False) else req.n,
            temperature=server_default(d, "temperature", req.temperature, 1.0),
            top_p=server_default(d, "top_p", req.top_p, 1.0),
            top_k=server_default(d, "top_k", req.top_k, 0),
            min_p=server_default(d, "min_p", req.min_p, 0.0),
            presence_penalty=server_default(d, "presence_penalty", req.presence_penalty, 0.0),
            frequency_penalty=server_default(d, "frequency_penalty", req.frequency_penalty, 0.0),
            repetition_penalty=server_default(d, "repetition_penalty", req.repetition_penalty, 1.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            logprob_token_ids=req.logprob_token_ids,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            max_logprobs=-1,  # already held to --max-logprobs by resolve_logprobs
            structured_outputs=structured_outputs,
            extra_args=_extra_args(req),
            thinking_token_budget=req.thinking_token_budget,
            repetition_detection=req.repetition_detection,
            stream_interval=req.stream_interval,
        )
    except ValueError as exc:
        # The field the ValidationError names, else the one its message starts with ("temperature must be ...").
        first = str(exc).split(" ", 1)[0]
        param = getattr(exc, "parameter", None) or (first if first in _PARAM_NAMES else None)
        raise APIError(400, str(exc), param) from None


def _extra_args(req: SamplingRequest) -> dict[str, Any] | None:
    """SamplingParams.extra_args, as vLLM's to_sampling_params makes them: vllm_xargs (what custom logits
    processors read), then kv_transfer_params for the KV connector."""
    extra = dict(req.vllm_xargs or {})
    if req.kv_transfer_params is not None:
        extra["kv_transfer_params"] = req.kv_transfer_params
    return extra or None


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                defaults: dict[str, Any] | None = None) -> int | None:
    """vLLM 0.32's get_max_tokens: the request's max_tokens capped at the room the context leaves (a max_tokens
    past max_model_len runs until the context is full, finish_reason "length", not a 400); None: that room, or the
    model's max_new_tokens when smaller. A prompt that leaves no room keeps 1 here, and is refused by the prompt
    check in vLLM's words."""
    room = max(max_model_len - prompt_len, 1)
    if requested is not None:
        return min(requested, room) if requested > 0 else requested  # 0 / negative: refused by the params' check
    default = (defaults or {}).get("max_tokens")
    return room if default is None else min(room, default)


def truncate_prompt(ids: list[int], req: SamplingRequest, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep N tokens (-1: as many as leave room for one output token),
    the last N by default (truncation_side "left"), the first N with "right"."""
    try:
        return truncate_prompt_ids(ids, req.truncate_prompt_tokens, max_model_len, req.truncation_side or "left")
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), exc.param) from None


# Completions --------------------------------------------------------------------------------------
def max_completion_prompts() -> int:
    """VLLM_MAX_COMPLETION_PROMPTS (vLLM's variable, default 1024): the most prompts one request may batch."""
    return envs.VLLM_MAX_COMPLETION_PROMPTS


def check_completion_request(req: CompletionRequest, vocab_size: int) -> None:
    prompt = req.prompt
    if not prompt:  # None, "" or []: vLLM's CompletionRequest validator's words (prompt_embeds are refused apart)
        raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt) \
            and len(prompt) > max_completion_prompts():
        raise APIError(400, f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                            f"{max_completion_prompts()}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
                            "environment variable.", "prompt")
    _check_common(req, vocab_size)
    if req.suffix is not None:  # vLLM: any suffix, "" too, needs a model with FIM rendering (none here)
        raise APIError(400, "suffix is only supported for models with FIM completion rendering", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (other than equal to n)", "best_of")
    if req.logprob_token_ids and req.echo and req.max_tokens == 0:
        raise APIError(400, "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                            "output tokens are generated.", "logprob_token_ids")
    if req.logprob_token_ids and req.logprobs is None:
        raise APIError(400, "when using logprob_token_ids, logprobs must be set", "logprob_token_ids")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")


def completion_params(req: CompletionRequest, prompt_len: int, max_model_len: int, vocab_size: int,
                      max_logprobs: int, defaults: dict[str, Any] | None = None,
                structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    logprobs = resolve_logprobs(req.logprobs, "logprobs", vocab_size, max_logprobs)
    prompt_logprobs = resolve_logprobs(req.prompt_logprobs, "prompt_logprobs", vocab_size, max_logprobs)
    # echo with logprobs also scores the prompt (vLLM: prompt_logprobs defaults to logprobs under echo).
    if prompt_logprobs is None and req.echo and logprobs is not None:
        prompt_logprobs = logprobs
    max_tokens = 1 if req.echo and req.max_tokens == 0 else req.max_tokens  # echo only: one token, dropped
    if max_tokens is None:  # vLLM turns an explicit null into the default, 16, not "as many as fit"
        max_tokens = CompletionRequest.model_fields["max_tokens"].default
    return _sampling_params(req, _max_tokens(max_tokens, prompt_len, max_model_len, defaults), logprobs,
                            prompt_logprobs, defaults=defaults,
                            structured_outputs=structured_outputs)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer | None,
                       max_model_len: int) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt of the batch. Runs in the tokenizer thread. `tokenizer` None
    (--skip-tokenizer-init): token-id prompts only, and nothing that needs their text (echo, token strings).
    The prompt is not empty: check_completion_request refused that first."""
    prompt = req.prompt
    assert prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if tokenizer is None:
        _check_without_tokenizer(req, items)
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
        else:
            ids = list(item)
        truncated = truncate_prompt(ids, req, max_model_len)
        # The text of a truncated prompt is what is left of it (echo returns that).
        text = item if isinstance(item, str) and truncated is ids else None
        if text is None and tokenizer is not None and (req.echo or isinstance(item, str)):
            text = tokenizer.decode(truncated, skip_special_tokens=False)
        out.append((text, truncated))
    return out


def _check_without_tokenizer(req: CompletionRequest, items: list[Any]) -> None:
    """--skip-tokenizer-init: a text prompt, echo (the prompt's text) and logprobs' token strings need the
    tokenizer: 400s in vLLM's words (return_tokens_as_token_ids gives logprobs that need none; with
    return_token_ids, echo adds no prompt text, the ids being in prompt_token_ids, as vLLM's)."""
    if any(isinstance(item, str) for item in items):
        raise APIError(400, TEXT_PROMPT_WITHOUT_TOKENIZER, "prompt")
    if req.echo and not req.return_token_ids:
        raise APIError(400, NO_TOKENIZER, "echo")
    if req.logprobs is not None and not req.return_tokens_as_token_ids:
        raise APIError(400, "Unable to get tokenizer because `skip_tokenizer_init=True`", "skip_tokenizer_init")


# Chat ---------------------------------------------------------------------------------------------
def forwarded_prompt_token_ids(req: ChatCompletionRequest, vocab_size: int) -> list[int] | None:
    """vLLM 0.32's decode-side token reuse (renderers/online_renderer.py `_reused_prompt_token_ids`): in
    disaggregated serving the prefill stage's prompt ids come in `kv_transfer_params["prompt_token_ids"]`, and
    the decode stage runs them instead of rendering `messages` again. Popped, so the ids do not travel on to
    the KV connector; None when absent, or when `echo` needs the messages rendered. Malformed ids are a 400 in
    vLLM's words."""
    kv = req.kv_transfer_params
    if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
        return None
    ids = kv.pop("prompt_token_ids")
    if req.echo:
        return None
    param = "kv_transfer_params.prompt_token_ids"
    # bool is an int subclass, hence the exact type check (vLLM's).
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise APIError(400, "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative "
                            "integers.", param)
    if max(ids) >= vocab_size:
        raise APIError(400, f"Token id {max(ids)} is out of vocabulary", param)
    return ids


def check_request_chat_template(req: ChatCompletionRequest | Any, trusted: bool) -> None:
    """vLLM: a chat template sent with the request (a Jinja program the server would run) is refused
    unless the server was started with --trust-request-chat-template."""
    kwargs = getattr(req, "chat_template_kwargs", None) or {}
    if not trusted and (getattr(req, "chat_template", None) is not None or kwargs.get("chat_template") is not None):
        raise APIError(400, "Chat template is passed with request, but --trust-request-chat-template is not set. "
                            "Refused request with untrusted chat template.")


def template_kwargs(kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any] | None:
    """The chat template's extra variables: the request's chat_template_kwargs, and vLLM's build_chat_params
    additions for a reasoning effort (`reasoning_effort`, and `enable_thinking` = effort != "none" unless the
    request set it): what a reasoning effort does in vLLM without a reasoning parser (a template that
    declares neither variable renders as without them)."""
    if reasoning_effort is None:
        return kwargs
    out = {**(kwargs or {}), "reasoning_effort": reasoning_effort}
    if "enable_thinking" not in (kwargs or {}):
        out["enable_thinking"] = reasoning_effort != "none"
    return out


def check_chat_request(req: ChatCompletionRequest, vocab_size: int) -> None:
    _check_common(req, vocab_size)
    if not req.messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    if req.top_logprobs is not None and (req.top_logprobs > 0 or req.top_logprobs == -1) and not req.logprobs:
        raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if req.tools is not None and not req.tools:
        raise APIError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the "
                            "field entirely.", "tools")
    if req.logprob_token_ids and not req.logprobs:
        raise APIError(400, "when using logprob_token_ids, logprobs must be set to true", "logprob_token_ids")
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       "continue_final_message")


def chat_params(req: ChatCompletionRequest, prompt_len: int, max_model_len: int, vocab_size: int,
                max_logprobs: int, defaults: dict[str, Any] | None = None,
                structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = resolve_logprobs(req.top_logprobs, "top_logprobs", vocab_size, max_logprobs)
    logprobs = (top or 0) if req.logprobs else None
    prompt_logprobs = resolve_logprobs(req.prompt_logprobs, "prompt_logprobs", vocab_size, max_logprobs)
    return _sampling_params(req, _max_tokens(requested, prompt_len, max_model_len, defaults), logprobs,
                            prompt_logprobs, defaults=defaults,
                            structured_outputs=structured_outputs)


def _part_text(i: int, part: ContentPart | str) -> str | None:
    """A content part's text by the offline chat's rule (engine/llm_args.py part_text); other parts are a 400."""
    as_dict = part if isinstance(part, str) else {**(part.model_extra or {}), "type": part.type, "text": part.text}
    try:
        return part_text(as_dict)
    except ValueError as exc:
        raise APIError(400, f"messages.{i}.content: {exc}", "messages") from None


def _message_dict(i: int, msg: ChatMessage) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):  # joined with newlines, as vLLM's "string" content format
        content = "\n".join(t for t in (_part_text(i, part) for part in content) if t is not None)
    if content is None:  # vLLM: no content renders as empty text, for any role
        content = ""
    out: dict[str, Any] = {"role": msg.role, "content": content}
    for key in ("name", "tool_calls", "tool_call_id"):
        if (value := getattr(msg, key)) is not None:
            out[key] = value
    if msg.role == "assistant" and msg.reasoning is not None:  # vLLM: both names, for interleaved thinking
        out["reasoning"] = out["reasoning_content"] = msg.reasoning
    return out


def message_text(msg: ChatMessage) -> str:
    return _message_dict(0, msg)["content"]


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    tools_prompt: str | None = None,
) -> list[int]:
    """The model's own chat template (or the request's), as token ids. Runs in the tokenizer thread."""
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       "continue_final_message")
    dicts = [_message_dict(i, m) for i, m in enumerate(messages)]
    if tools_prompt:  # a template that does not render tools: they go into the system message
        if dicts and dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{tools_prompt}"}
        else:
            dicts.insert(0, {"role": "system", "content": tools_prompt})
    kwargs = dict(chat_template_kwargs or {})
    for key, value in (("continue_final_message", continue_final_message), ("chat_template", chat_template),
                       ("tools", tools), ("documents", documents)):
        if value:
            kwargs[key] = value
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)
    except Exception as exc:  # the template rejects these messages (e.g. roles out of order): the client's call
        raise APIError(400, f"cannot apply the chat template to these messages: {exc}", "messages") from None
    assert isinstance(text, str)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
