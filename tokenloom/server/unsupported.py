"""Fields vLLM's API knows that tokenloom does not implement (yet): a 400 naming the field, never a
silent 200 with the field ignored.

A field is refused only when it asks for something: a value in its `neutral` set (what a client sends
when it means "off", e.g. `use_beam_search: false`, `response_format: {"type": "text"}`) passes.
To implement one of these, delete its entry here and read the field in protocol.py/params.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.server.errors import APIError


@dataclass(frozen=True)
class Unsupported:
    why: str
    neutral: tuple[Any, ...] = ()  # values that ask for nothing (None always does)



COMMON: dict[str, Unsupported] = {
    # Structured outputs run on xgrammar (server/structured.py); other backends and a custom
    # whitespace pattern are not offered.
    "guided_decoding_backend": Unsupported("only the xgrammar structured-output backend is available",
                                           ("auto", "xgrammar")),
    "guided_whitespace_pattern": Unsupported("guided_whitespace_pattern is not supported (use "
                                             "structured_outputs.disable_any_whitespace)"),
    "watermarking": Unsupported("watermarking is not supported", (False,)),
    # Empty embeddings ask for nothing: with no prompt either, vLLM's "Either prompt or prompt_embeds ..." follows.
    "prompt_embeds": Unsupported("prompt embeddings are not supported", ([], "")),
    "cache_salt": Unsupported("cache_salt is not supported yet"),
    "ec_transfer_params": Unsupported("encoder-cache transfer (ec_transfer_params) is not supported"),
    # vLLM's OpenAI server takes no lora_request field either: the request's `model` names the adapter.
    "lora_request": Unsupported("lora_request is not a request field: name a LoRA adapter in `model` "
                                "(served with --enable-lora --lora-modules)"),
}

CHAT: dict[str, Unsupported] = {
    "functions": Unsupported("functions (deprecated by OpenAI) is not supported; use tools"),
    "mm_processor_kwargs": Unsupported("multimodal inputs are not supported", ({},)),
    "media_io_kwargs": Unsupported("multimodal inputs are not supported", ({},)),
}

COMPLETION: dict[str, Unsupported] = {}

# The pooling endpoints (/v1/embeddings, /pooling, /classify, /score, /rerank): vLLM's fields for what tokenloom's
# text models do not take.
POOLING: dict[str, Unsupported] = {
    "cache_salt": COMMON["cache_salt"],
    "mm_processor_kwargs": Unsupported("multimodal inputs are not supported", ({},)),
    "media_io_kwargs": Unsupported("multimodal inputs are not supported", ({},)),
    "lora_request": COMMON["lora_request"],
}

# POST /v1/responses: what vLLM's ResponsesRequest knows and tokenloom does not serve.
RESPONSES: dict[str, Unsupported] = {
    "prompt": Unsupported("prompt template is not supported"),
    "max_tool_calls": Unsupported("max_tool_calls limits built-in tools, which tokenloom does not run"),
    "conversation": Unsupported("conversations are not supported; use previous_response_id"),
    "previous_input_messages": Unsupported("previous_input_messages (Harmony messages) is not supported; use "
                                           "previous_response_id or input items", ([],)),
    "previous_response": Unsupported("previous_response (stateless multi-turn for Harmony models) is not "
                                     "supported; use previous_response_id"),
    "stream_options": Unsupported("stream_options is not supported on /v1/responses", ({},)),
    "context_management": Unsupported("context_management is not supported", ([],)),
    "prompt_cache_retention": Unsupported("prompt_cache_retention is not supported (the prefix cache keeps "
                                          "what its blocks hold)"),
    "mm_processor_kwargs": Unsupported("multimodal inputs are not supported", ({},)),
    # Disaggregated prefill is served on the completion endpoints (docs/kv_offload.md); a response object has no
    # kv_transfer_params to hand the connector's back in.
    "kv_transfer_params": Unsupported("kv_transfer_params is not supported on /v1/responses (use /v1/completions or "
                                      "/v1/chat/completions)", ({},)),
    # Served on /v1/completions and /v1/chat/completions; the Responses request carries no bad_words.
    "bad_words": Unsupported("bad_words is not supported on /v1/responses (use /v1/completions or "
                             "/v1/chat/completions)", ([],)),
}


def reject_unsupported(body: dict[str, Any], table: dict[str, Unsupported]) -> None:
    for name, rule in table.items():
        if name in body:
            value = body[name]
            if value is None or any(value == v and type(value) is type(v) for v in rule.neutral):
                continue
            raise APIError(400, f"{name}: {rule.why}", name)


def reject_unsupported_chat(body: dict[str, Any]) -> None:
    reject_unsupported(body, COMMON)
    reject_unsupported(body, CHAT)


def reject_unsupported_completion(body: dict[str, Any]) -> None:
    reject_unsupported(body, COMMON)
    reject_unsupported(body, COMPLETION)


def reject_unsupported_pooling(body: dict[str, Any]) -> None:
    reject_unsupported(body, POOLING)


def reject_unsupported_responses(body: dict[str, Any]) -> None:
    # vLLM's own check comes first (its request model's validator): a background response is kept only in the
    # store.
    if body.get("background") and not body.get("store", True):
        raise APIError(400, "background can only be used when `store` is true", "background")
    reject_unsupported(body, COMMON)
    reject_unsupported(body, RESPONSES)
