"""Request bodies: OpenAI's fields plus vLLM's extensions, with vLLM's names and defaults.

Types are strict: a wrong JSON type is a 400 naming the field, never coerced ("yes" is not a
boolean, "3" is not an integer). Two leniencies of vLLM's are kept because clients rely on them: an
integral float (16.0) for an integer field, and the strings "true"/"false" for a boolean. Infinite and
NaN numbers are refused here; the sampling ranges are checked by SamplingParams.

Unknown fields are ignored (as vLLM does), so clients that send newer OpenAI fields still work. Fields
vLLM knows but tokenloom does not implement are not unknown: `unsupported.py` answers them with a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenloom import envs
from tokenloom.engine.generation_config import server_default
from tokenloom.sampling_params import BeamSearchParams, validate_thinking_token_budget
from tokenloom.server.request_checks import (
    check_chat_tool_usage,
    check_custom_tool_format,
    check_responses_tool_usage,
    check_structured_outputs_count,
)

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _integral(value: Any) -> Any:
    # vLLM (pydantic's lax mode) takes 16.0 for 16; keep that, nothing looser.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _bool_string(value: Any) -> Any:
    # vLLM's tests and some clients send booleans as the strings "true"/"false" (JSON's own spelling);
    # keep that, and nothing looser: "yes", "on", 1 stay 400s.
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _at_most_max_stop_strings(stop: Any) -> Any:
    # vLLM 0.32's StopParam (a list of at most VLLM_MAX_STOP_STRINGS), in pydantic's own words for a list too
    # long; read when a request is validated, not when this module loads (vLLM reads it at import).
    limit = envs.VLLM_MAX_STOP_STRINGS
    if isinstance(stop, list) and len(stop) > limit:
        raise PydanticCustomError("too_long", "List should have at most {max_length} items after validation, not "
                                  "{actual_length}", {"field_type": "List", "max_length": limit,
                                                      "actual_length": len(stop)})
    return stop


Int = Annotated[int, BeforeValidator(_integral)]
Bool = Annotated[bool, BeforeValidator(_bool_string)]
Int64 = Annotated[int, BeforeValidator(_integral), Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
StopParam = Annotated[str | list[str] | None, AfterValidator(_at_most_max_stop_strings)]


# vLLM's vllm_xargs: names to strings, numbers, or lists of them (SamplingParams.extra_args, which custom logits
# processors read).
VllmXArgs = dict[str, str | int | float | list[str | int | float]]


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False  # vLLM: usage on every chunk (only with include_usage)


class SamplingRequest(BaseModel):
    """Fields both completion endpoints share."""

    model_config = _CONFIG
    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: StopParam = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    priority: Int64 = 0
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True  # vLLM's (SamplingParams' comment says what False gives here)
    stop_token_ids: list[TokenId] | None = None
    return_token_ids: Bool | None = None
    return_tokens_as_token_ids: Bool | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None  # never generated (tokenized by the engine: SamplingParams.bad_words)
    logprob_token_ids: list[TokenId] | None = None
    prompt_logprobs: Int | None = None
    truncate_prompt_tokens: Annotated[int, BeforeValidator(_integral), Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    session_id: str | None = None  # vLLM: routing metadata only
    # vLLM's disaggregated prefill (docs/kv_offload.md): handed to the engine's KV connector; the response
    # carries the connector's own back.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: arguments for custom logits processors (--logits-processors), the request's extra_args.
    vllm_xargs: VllmXArgs | None = None
    # vLLM's: end the request when its output repeats itself (SamplingParams.repetition_detection's fields).
    repetition_detection: dict[str, Any] | None = None
    # vLLM's: a streamed chunk carries at least this many new tokens (the first and the last excepted); raises the
    # server's --stream-interval, never lowers it.
    stream_interval: Annotated[int, BeforeValidator(_integral), Field(ge=1)] | None = None
    # Beam search (server/beam_search.py): n is the beam width.
    use_beam_search: Bool = False
    length_penalty: float = 1.0
    # vLLM's: at most this many thinking tokens, then the end of thinking is forced (needs --reasoning-parser);
    # -1 (unlimited) is None, as vLLM's ThinkingTokenBudget type makes it
    thinking_token_budget: Annotated[int | None, BeforeValidator(validate_thinking_token_budget)] = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        """vLLM's body checks ahead of the fields (request_checks.py)."""
        check_structured_outputs_count(data, chat=False)
        return data

    def to_beam_search_params(self, max_tokens: int, default_sampling_params: dict[str, Any]) -> BeamSearchParams:
        """vLLM's: the request as beam search runs it, n being the beam width (at most VLLM_MAX_N_SEQUENCES,
        checked here, before any beam exists); temperature defaults as for sampling. Raises ValidationError."""
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=server_default(default_sampling_params, "temperature", self.temperature, 1.0),
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(SamplingRequest):
    # text, token ids, or a batch of either; None (or empty) is refused in vLLM's words when the prompts are read
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool | None = False
    best_of: Int | None = None
    suffix: str | None = None
    add_special_tokens: Bool = True


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class _ToolCall(BaseModel):
    """OpenAI's ChatCompletionMessageToolCallParam, which vLLM validates assistant history against."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"]
    function: _ToolCallFunction


def _valid_tool_calls(value: Any) -> Any:
    # Checked, then handed to the chat template as sent (extra keys and all).
    if isinstance(value, list):
        for call in value:
            _ToolCall.model_validate(call)
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    # Any role, as vLLM (its CustomChatCompletionMessageParam): the chat template decides what it renders.
    role: str
    # Plain strings, text-like parts (text, input_text, output_text, refusal, thinking), as vLLM reads them.
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    # History of a tool conversation: shape-checked (vLLM's), then handed to the chat template as they are.
    tool_calls: Annotated[list[dict[str, Any]] | None, AfterValidator(_valid_tool_calls)] = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as a reasoning parser returned it (vLLM 0.32's field; its older name
    # reasoning_content is read too): the template gets both names, for interleaved thinking.
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _reasoning_content_is_reasoning(cls, data: Any) -> Any:
        """vLLM's _normalize_messages_before: the deprecated `reasoning_content` becomes `reasoning`."""
        if isinstance(data, dict) and data.get("reasoning_content") is not None and data.get("reasoning") is None:
            data = {**data, "reasoning": data["reasoning_content"]}
        return data


# OpenAI's reasoning efforts, as vLLM 0.32 takes them (chat's reasoning_effort, Responses' reasoning.effort).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class Reasoning(BaseModel):
    """Responses' `reasoning` (openai.types.shared.Reasoning, as far as vLLM 0.32 reads it: the effort)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM's default: "auto" when tools are given, else "none" (request_checks.check_chat_tool_usage)
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: Bool | None = True
    # vLLM's extensions
    echo: Bool = False
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: Bool = False
    # OpenAI's; it reaches the chat template (params.template_kwargs), and so the reasoning parser's kwargs
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: false leaves the reasoning out of the answer (the model still reasons; with a reasoning parser)
    include_reasoning: Bool = True

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        """vLLM's body checks ahead of the fields (request_checks.py): tool_choice's default and its 400s."""
        check_structured_outputs_count(data, chat=True)
        return check_chat_tool_usage(data)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): ChatCompletionRequest's fields, `messages` a non-empty list of
    non-empty conversations. The endpoint's own rules (no stream, n 1, no tools, no beam search) are
    server/serving_batch.py's."""

    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]], Field(min_length=1)]  # type: ignore[assignment]

    def to_chat_completion_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """vLLM's: one conversation as a chat request of its own."""
        data = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return ChatCompletionRequest.model_validate({**data, "messages": [m.model_dump() for m in messages]})


class TokenizeCompletionRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: Bool = False
    return_token_strs: Bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[Int]


class ResponsesNamedToolChoice(BaseModel):
    """Responses' named tool_choice, {"type": "function" | "custom", "name": ...} (openai's ToolChoiceFunction and
    ToolChoiceCustom, as vLLM types them: `request.tool_choice.name`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function", "custom"]
    name: str


def _custom_tools_shaped(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """A custom tool as openai's CustomTool types it (vLLM validates tools with that type): a name, and a format
    that is an object (text or grammar; a grammar is refused by request_checks.check_custom_tool_format)."""
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "custom":
            continue
        if not isinstance(tool.get("name"), str):
            raise PydanticCustomError("custom_tool", "tools.{i}: a custom tool needs a name (a string)", {"i": i})
        fmt = tool.get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "grammar")):
            raise PydanticCustomError("custom_tool", "tools.{i}.format must be an object of type 'text' or "
                                                     "'grammar'", {"i": i})
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise PydanticCustomError("custom_tool", "tools.{i}.description must be a string", {"i": i})
    return tools


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API as vLLM 0.32 serves it: tokenloom/server/serving_responses.py).
    Items, tools and text.format are checked there, field by field; fields vLLM knows that tokenloom does
    not implement are refused by unsupported.RESPONSES."""

    model_config = _CONFIG
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]] | None, AfterValidator(_custom_tools_shaped)] = None
    # "none" without tools (request_checks); another JSON object is refused by the endpoint, naming its type
    tool_choice: str | ResponsesNamedToolChoice | dict[str, Any] | None = "auto"
    parallel_tool_calls: Bool | None = True
    store: Bool | None = True
    stream: Bool | None = False
    background: Bool | None = False  # vLLM's: stored queued, answered at once, generated in the server
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    top_logprobs: Int | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = "auto"  # echoed only, as vLLM
    prompt_cache_key: str | None = None  # a routing hint; prefix caching needs no key
    # vLLM's extensions
    request_id: str | None = None
    session_id: str | None = None  # vLLM: routing metadata only
    priority: Int64 = 0
    top_k: Int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: StopParam = None
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: float | None = None
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    reasoning: Reasoning | None = None  # its effort reaches the chat template (and the reasoning parser's kwargs)
    include_reasoning: Bool = True  # vLLM's: false leaves the reasoning item out (with a reasoning parser)
    chat_template_kwargs: dict[str, Any] | None = None
    enable_response_messages: Bool = False  # the raw prompt and output (text and token ids) in the response
    vllm_xargs: VllmXArgs | None = None  # custom logits processors' arguments, as on the chat endpoint

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        """vLLM's body checks ahead of the fields (request_checks.py): custom tools' format, tool_choice resolved,
        and their 400s."""
        check_custom_tool_format(data)
        return check_responses_tool_usage(data)
