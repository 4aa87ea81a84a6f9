"""The pooling endpoints' request and response bodies, with vLLM 0.32's names, fields and defaults
(vllm/entrypoints/pooling/{base,embed,pooling,classify,scoring}/protocol.py).

    EmbeddingRequest        /v1/embeddings: `input` (text, texts, token ids, lists of ids) or a chat (`messages`;
                            a batch of chats; chat messages in `input`)
    PoolingRequest          /pooling: the same, plus `task`
    ClassificationRequest   /classify: `input` or `messages`
    ScoreRequest            /score: queries + documents (or items; data_1 + data_2; text_1 + text_2)
    RerankRequest           /rerank: query + documents, top_n

vLLM 0.32 removed `normalize` (use_activation) and the tasks `score` and `encode`: a body naming them is refused
with vLLM's sentence. Types follow the server's other bodies (tokenloom/server/protocol.py): strict, with vLLM's
two leniencies (16.0 for 16, "true" for true). Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from tokenloom.exceptions import VLLMValidationError
from tokenloom.server.protocol import Bool, Int, Int64
from tokenloom.tasks import NORMALIZE_REMOVED, PoolingTask, check_removed_pooling_task

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]


def reject_removed_pooling_parameters(data: Any) -> Any:
    """vLLM's: `normalize` and the removed tasks, refused with its sentences, before any other check."""
    if not isinstance(data, dict):
        return data
    if "normalize" in data:
        raise VLLMValidationError(NORMALIZE_REMOVED, parameter="normalize")
    check_removed_pooling_task(data.get("task"))
    return data


CONTINUE_AND_GENERATION_PROMPT = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


# ---------------------------------------------------------------------------------------------- mixins (vLLM's)
class PoolingBasicRequestMixin(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    # transformers' names: 'max_length' pads the prompt to max_model_len (models trained without a mask).
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: Int64 = 0


class CompletionRequestMixin(BaseModel):
    input: list[Int] | list[list[Int]] | str | list[str]
    add_special_tokens: Bool = True


class ChatRequestOptionsMixin(BaseModel):
    add_generation_prompt: Bool = False
    continue_final_message: Bool = False
    add_special_tokens: Bool = False  # the chat template writes the special tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise VLLMValidationError(CONTINUE_AND_GENERATION_PROMPT)
        return data


class ChatRequestMixin(ChatRequestOptionsMixin):
    messages: list[dict[str, Any]]


class EncodingRequestMixin(BaseModel):
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"


class EmbedRequestMixin(EncodingRequestMixin):
    dimensions: Int | None = None
    use_activation: Bool | None = None


class ClassifyRequestMixin(BaseModel):
    use_activation: Bool | None = None


# ---------------------------------------------------------------------------------------------- /v1/embeddings
def _is_chat_message(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str)


def _is_chat_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_chat_message(item) for item in value)


def _is_batched_chat_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_chat_messages(item) for item in value)


class EmbeddingCompletionRequest(PoolingBasicRequestMixin, CompletionRequestMixin, EmbedRequestMixin):
    pass


class EmbeddingChatRequest(PoolingBasicRequestMixin, ChatRequestMixin, EmbedRequestMixin):
    """One conversation in `messages`."""


class EmbeddingBatchChatRequest(PoolingBasicRequestMixin, ChatRequestOptionsMixin, EmbedRequestMixin):
    """Several conversations in `messages` (vLLM's batched chat embeddings)."""

    messages: Annotated[list[Annotated[list[dict[str, Any]], Field(min_length=1)]], Field(min_length=1)]


def with_chat_input(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's EmbeddingChatInputRequest: chat messages (or a batch of chats) sent in `input` are the `messages`."""
    inp = data.get("input")
    if "messages" not in data and (_is_chat_messages(inp) or _is_batched_chat_messages(inp)):
        return {**data, "messages": inp}
    return data


def embedding_request_class(data: dict[str, Any]) -> type[BaseModel]:
    """Which of vLLM's embedding bodies a dict is (vLLM lets pydantic's union pick; the rule is the same): a
    conversation in `messages`, a batch of them, else a completion-style `input`."""
    if "messages" in data:
        return EmbeddingBatchChatRequest if _is_batched_chat_messages(data["messages"]) else EmbeddingChatRequest
    return EmbeddingCompletionRequest


def _embedding_request_kind(data: Any) -> Any:
    data = reject_removed_pooling_parameters(data)
    if not isinstance(data, dict):
        return data
    data = with_chat_input(data)
    return embedding_request_class(data).model_validate(data)


EmbeddingRequest: TypeAlias = Annotated[
    EmbeddingCompletionRequest | EmbeddingChatRequest | EmbeddingBatchChatRequest,
    BeforeValidator(_embedding_request_kind),
]


# ---------------------------------------------------------------------------------------------- /pooling
class PoolingCompletionRequest(PoolingBasicRequestMixin, CompletionRequestMixin, EmbedRequestMixin,
                               ClassifyRequestMixin):
    task: PoolingTask | None = None


class PoolingChatRequest(PoolingBasicRequestMixin, ChatRequestMixin, EmbedRequestMixin, ClassifyRequestMixin):
    task: PoolingTask | None = None


def pooling_request_class(data: dict[str, Any]) -> type[BaseModel]:
    return PoolingChatRequest if "messages" in data else PoolingCompletionRequest


def _pooling_request_kind(data: Any) -> Any:
    data = reject_removed_pooling_parameters(data)
    return pooling_request_class(data).model_validate(data) if isinstance(data, dict) else data


PoolingRequest: TypeAlias = Annotated[PoolingCompletionRequest | PoolingChatRequest,
                                      BeforeValidator(_pooling_request_kind)]


# ---------------------------------------------------------------------------------------------- /classify
class ClassificationCompletionRequest(PoolingBasicRequestMixin, CompletionRequestMixin, ClassifyRequestMixin):
    pass


class ClassificationChatRequest(PoolingBasicRequestMixin, ChatRequestMixin, ClassifyRequestMixin):
    pass


def classification_request_class(data: dict[str, Any]) -> type[BaseModel]:
    return ClassificationChatRequest if "messages" in data else ClassificationCompletionRequest


def _classification_request_kind(data: Any) -> Any:
    data = reject_removed_pooling_parameters(data)
    return classification_request_class(data).model_validate(data) if isinstance(data, dict) else data


ClassificationRequest: TypeAlias = Annotated[ClassificationCompletionRequest | ClassificationChatRequest,
                                             BeforeValidator(_classification_request_kind)]


# ---------------------------------------------------------------------------------------------- /score, /rerank
ScoreInput = str | dict[str, Any]  # a text, or vLLM's multimodal {"content": [...]} (refused: text models only)


class ScoringRequestMixin(PoolingBasicRequestMixin, ClassifyRequestMixin):
    max_tokens_per_query: Int = 0  # a query cut to this many tokens (0: not cut)
    max_tokens_per_doc: Int = 0  # a document cut to this many tokens (0: not cut)
    # Read by vLLM's score chat templates (Qwen3-style rerankers), which the models tokenloom runs do not have.
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ScoreQueriesDocumentsRequest(ScoringRequestMixin):
    queries: ScoreInput | list[ScoreInput]
    documents: ScoreInput | list[ScoreInput]

    @property
    def data_1(self) -> Any:
        return self.queries

    @property
    def data_2(self) -> Any:
        return self.documents


class ScoreQueriesItemsRequest(ScoringRequestMixin):
    queries: ScoreInput | list[ScoreInput]
    items: ScoreInput | list[ScoreInput]

    @property
    def data_1(self) -> Any:
        return self.queries

    @property
    def data_2(self) -> Any:
        return self.items


class ScoreDataRequest(ScoringRequestMixin):
    data_1: ScoreInput | list[ScoreInput]
    data_2: ScoreInput | list[ScoreInput]


class ScoreTextRequest(ScoringRequestMixin):
    text_1: ScoreInput | list[ScoreInput]
    text_2: ScoreInput | list[ScoreInput]

    @property
    def data_1(self) -> Any:
        return self.text_1

    @property
    def data_2(self) -> Any:
        return self.text_2


_SCORE_KINDS: tuple[tuple[tuple[str, str], type[ScoringRequestMixin]], ...] = (
    (("queries", "documents"), ScoreQueriesDocumentsRequest),
    (("queries", "items"), ScoreQueriesItemsRequest),
    (("data_1", "data_2"), ScoreDataRequest),
    (("text_1", "text_2"), ScoreTextRequest),
)


def score_request_class(data: dict[str, Any]) -> type[ScoringRequestMixin]:
    """vLLM's ScoreRequest union: the first pair of fields the body holds picks its kind."""
    for names, kind in _SCORE_KINDS:
        if all(name in data for name in names):
            return kind
    raise VLLMValidationError("a score request needs `queries` and `documents` (or `queries` and `items`, "
                              "`data_1` and `data_2`, `text_1` and `text_2`)", parameter="queries")


def _score_request_kind(data: Any) -> Any:
    return score_request_class(data).model_validate(data) if isinstance(data, dict) else data


ScoreRequest: TypeAlias = Annotated[
    ScoreQueriesDocumentsRequest | ScoreQueriesItemsRequest | ScoreDataRequest | ScoreTextRequest,
    BeforeValidator(_score_request_kind),
]


class RerankRequest(ScoringRequestMixin):
    query: ScoreInput
    documents: ScoreInput | list[ScoreInput]
    top_n: Annotated[Int, Field(ge=0)] = 0


# ---------------------------------------------------------------------------------------------- responses
def _created() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, Any] | None = None


class EmbeddingResponseData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    object: str = "list"
    created: int = Field(default_factory=_created)
    model: str | None = None
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(BaseModel):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"pool-{uuid.uuid4().hex}")
    object: str = "list"
    created: int = Field(default_factory=_created)
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"classify-{uuid.uuid4().hex}")
    object: str = "list"
    created: int = Field(default_factory=_created)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreResponseData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"score-{uuid.uuid4().hex}")
    object: str = "list"
    created: int = Field(default_factory=_created)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str | None = None
    multi_modal: list[dict[str, Any]] | None = None


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
