"""Request bodies → what the engine takes: token-id prompts and SamplingParams (errors are HTTP 400)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from tokenloom.engine.generation_config import server_default
from tokenloom.sampling_params import SamplingParams
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest

if TYPE_CHECKING:
    from tokenloom.model.tokenizer import Tokenizer

# Guards against one request fanning out into an unbounded amount of work.
MAX_N = 128
MAX_STOP_STRINGS = 32
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def _reject_unsupported(req: SamplingRequest) -> None:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be an integer in [1, {MAX_N}], got {req.n}", "n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", "stop")


def _sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                     defaults: dict[str, Any] | None = None) -> SamplingParams:
    """`defaults`: the model's generation_config defaults, for the fields the request leaves unset."""
    d = defaults or {}
    try:
        return SamplingParams(
            n=req.n,
            temperature=server_default(d, "temperature", req.temperature, 1.0),
            top_p=server_default(d, "top_p", req.top_p, 1.0),
            top_k=server_default(d, "top_k", req.top_k, 0),
            min_p=server_default(d, "min_p", req.min_p, 0.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=server_default(d, "repetition_penalty", req.repetition_penalty, 1.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:
        # SamplingParams' messages start with the field's name ("temperature must be ...").
        first = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), first if first in _PARAM_NAMES else None) from None


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                defaults: dict[str, Any] | None = None) -> int | None:
    # None: as many as the context allows (vLLM's default for chat and for max_tokens=null), or the
    # model's max_new_tokens when smaller (vLLM's get_max_tokens).
    if requested is not None:
        return requested
    room = max(max_model_len - prompt_len, 1)
    default = (defaults or {}).get("max_tokens")
    return room if default is None else min(room, default)


# Completions --------------------------------------------------------------------------------------
def check_completion_request(req: CompletionRequest) -> None:
    _reject_unsupported(req)
    if req.echo:
        raise APIError(400, "echo is not supported", "echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (other than equal to n)", "best_of")


def completion_params(req: CompletionRequest, prompt_len: int, max_model_len: int,
                      defaults: dict[str, Any] | None = None) -> SamplingParams:
    return _sampling_params(req, _max_tokens(req.max_tokens, prompt_len, max_model_len, defaults), req.logprobs,
                            defaults)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt of the batch. Runs in the tokenizer thread."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt or isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "the prompt is empty", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, tokenizer.encode(item, add_special_tokens=req.add_special_tokens)))
        else:
            out.append((None, list(item)))
    return out


# Chat ---------------------------------------------------------------------------------------------
def check_chat_request(req: ChatCompletionRequest) -> None:
    _reject_unsupported(req)
    if not req.messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tool calling is not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError(400, "only response_format {\"type\": \"text\"} is supported", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")


def chat_params(req: ChatCompletionRequest, prompt_len: int, max_model_len: int,
                defaults: dict[str, Any] | None = None) -> SamplingParams:
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _sampling_params(req, _max_tokens(requested, prompt_len, max_model_len, defaults), logprobs, defaults)


def _message_dict(i: int, msg: ChatMessage) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages.{i}.content: only text parts are supported, got {part.type!r}",
                               "messages")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None:
        if msg.role != "assistant":
            raise APIError(400, f"messages.{i}.content is required for role {msg.role!r}", "messages")
        content = ""
    out = {"role": msg.role, "content": content}
    if msg.name is not None:
        out["name"] = msg.name
    return out


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The model's own chat template, as token ids. Runs in the tokenizer thread."""
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                       "continue_final_message")
    dicts = [_message_dict(i, m) for i, m in enumerate(messages)]
    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as exc:  # the template rejects these messages (e.g. roles out of order): the client's call
        raise APIError(400, f"cannot apply the chat template to these messages: {exc}", "messages") from None
    assert isinstance(text, str)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
