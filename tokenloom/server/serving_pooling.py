"""Pooling endpoints, with vLLM's request and response shapes (vllm/entrypoints/pooling/):

    POST /v1/embeddings            OpenAI's embeddings: input text / texts / token ids / batches of ids
                                   (or chat `messages`), encoding_format float | base64, dimensions,
                                   truncate_prompt_tokens, normalize
    POST /pooling                  the raw pooled output (embed, token_embed, classify, ...: `task`)
    POST /classify                 class probabilities and the label of a classification model
    POST /score, /v1/score         text_1 against text_2 (one against many, or pairwise): a cross-encoder's
                                   score, or the cosine of an embedding model's two embeddings
    POST /rerank, /v1/rerank,      query + documents, ranked by relevance_score (Jina / Cohere shape),
         /v2/rerank                `top_n`

Each input is one pooling request through the scheduler (prefill only); a batch is queued whole
before any of it runs, so the engine packs the inputs into steps by the token budget. Usage counts
the prompt tokens. A pooling request to a generation model, and a generation request to a pooling
model, are 400s.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tokenloom.engine.outputs import PoolingRequestOutput
from tokenloom.engine.pooling import (
    PoolingInfo,
    cosine,
    cross_encoder_pair,
    encode_text,
    prepare_pooling_params,
    score_pairs,
    truncate_prompt,
)
from tokenloom.pooling_params import PoolingParams
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError
from tokenloom.server.headers import base_request_id, request_priority
from tokenloom.server.state import ServerState, get_state
from tokenloom.server.streaming import collect

InputType = str | list[str] | list[int] | list[list[int]]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None
    user: str | None = None


class EmbeddingRequest(_Base):
    input: InputType | None = None
    messages: list[dict[str, Any]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    # vLLM 0.32's name for normalize (PoolingParams takes both; they must agree).
    use_activation: bool | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = False


class PoolingRequest(EmbeddingRequest):
    task: str | None = None


class ClassificationRequest(_Base):
    input: InputType
    use_activation: bool | None = None
    add_special_tokens: bool = True


class ScoreRequest(_Base):
    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None


class RerankRequest(_Base):
    query: str
    documents: list[str]
    top_n: int = 0
    use_activation: bool | None = None


def _info(state: ServerState) -> PoolingInfo:
    info = state.engine.info.pooling
    if info is None:
        raise APIError(400, f"The model `{state.engine.info.model_name}` is a generation model and does not support "
                            "pooling (embeddings, classification, score, rerank): serve a pooling model "
                            "(--runner pooling)", "model")
    return info


def _token_lists(state: ServerState, inp: Any, add_special_tokens: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per input: a string, strings, token ids, or lists of token ids (texts are
    truncated by the tokenizer, as vLLM's renderer does; token ids later, keeping the last k)."""
    if inp is None:
        raise APIError(400, "input is required", "input")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp:
        raise APIError(400, "input must be a non-empty string, list of strings or token ids", "input")
    if all(isinstance(t, int) for t in inp):
        inp = [inp]
    out = []
    for item in inp:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "input must not contain empty strings", "input")
            try:
                ids = encode_text(state.tokenizer, item, truncate_prompt_tokens, state.max_model_len,
                                  add_special_tokens)
            except ValueError as exc:
                raise APIError(400, str(exc), "truncate_prompt_tokens") from None
            out.append((item, ids))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if not item:
                raise APIError(400, "input must not contain empty token lists", "input")
            out.append((None, list(item)))
        else:
            raise APIError(400, "input items must all be strings or all be lists of token ids", "input")
    return out


def _messages_tokens(state: ServerState, req: EmbeddingRequest) -> list[tuple[str | None, list[int]]]:
    """vLLM's EmbeddingChatRequest: the conversation through the model's chat template, one input."""
    if state.tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template: send `input` instead of `messages`", "messages")
    ids = state.tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                              tokenize=True)
    return [(None, list(ids))]


async def _run(raw: Request, state: ServerState, prompts: list[tuple[str | None, list[int]]],
               params_list: list[PoolingParams], prefix: str, priority: int = 0) -> list[PoolingRequestOutput] | None:
    """Queue every input (truncated as asked), wait for all; None if the client left."""
    engine = state.engine
    engine.check_admission(len(prompts))
    base = base_request_id(raw, None)
    ids = [f"{prefix}-{base}-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(prompts))]
    prepared = []
    for (text, tokens), params in zip(prompts, params_list):
        try:  # every input checked before any is queued
            tokens = truncate_prompt(tokens, params.truncate_prompt_tokens, state.max_model_len)
        except ValueError as exc:
            raise APIError(400, str(exc), "input") from None
        prepared.append((text, tokens))
    stream = engine.open_stream()
    try:
        for rid, (text, tokens), params in zip(ids, prepared, params_list):
            engine.add_pooling_request(rid, tokens, params, stream, prompt=text, priority=priority)
    except BaseException:
        stream.close()
        raise
    finals = await collect(raw, stream)
    if finals is None:
        return None
    outs = [finals[rid] for rid in ids]
    for out in outs:
        if out.error is not None or out.outputs.data is None:
            raise APIError(500, out.error or "pooling failed")
    return outs


def _params(info: PoolingInfo, task: str, req: Any, **fields: Any) -> PoolingParams:
    params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, **fields)
    try:
        return prepare_pooling_params(params, info, task)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _usage(outs: list[PoolingRequestOutput]) -> dict[str, Any]:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def _encode(vec: np.ndarray, encoding_format: str) -> Any:
    if encoding_format == "base64":  # OpenAI's: the float32 little-endian bytes, base64
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec.tolist()


async def _prompts(state: Any, req: Any) -> list[list[int]]:
    """The token ids of an embeddings or pooling request: its chat `messages`, else its `input`."""
    if req.messages is not None:
        return await state.in_tokenizer_thread(_messages_tokens, state, req)
    return await state.in_tokenizer_thread(_token_lists, state, req.input, req.add_special_tokens,
                                           req.truncate_prompt_tokens)


async def create_embedding(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    req = parse_model(EmbeddingRequest, obj)
    model = state.model_name(req.model)
    info = _info(state)
    params = _params(info, "embed", req, dimensions=req.dimensions, normalize=req.normalize,
                     use_activation=req.use_activation)
    prompts = await _prompts(state, req)
    outs = await _run(raw, state, prompts, [params] * len(prompts), "embd", request_priority(raw, req.priority))
    if outs is None:
        return Response(status_code=499)
    data = [{"index": i, "object": "embedding", "embedding": _encode(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)]
    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(outs)})


async def create_pooling(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    req = parse_model(PoolingRequest, obj)
    model = state.model_name(req.model)
    info = _info(state)
    task = req.task or info.tasks[0]
    fields: dict[str, Any] = {}
    if task in ("embed", "token_embed"):
        fields = {"dimensions": req.dimensions, "normalize": req.normalize, "use_activation": req.use_activation}
    elif req.use_activation is not None:
        fields = {"use_activation": req.use_activation}
    params = _params(info, task, req, **fields)
    prompts = await _prompts(state, req)
    outs = await _run(raw, state, prompts, [params] * len(prompts), "pool", request_priority(raw, req.priority))
    if outs is None:
        return Response(status_code=499)
    data = [{"index": i, "object": "pooling", "data": _encode(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)]
    return JSONResponse({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(outs)})


async def create_classify(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    req = parse_model(ClassificationRequest, obj)
    model = state.model_name(req.model)
    info = _info(state)
    params = _params(info, "classify", req, use_activation=req.use_activation)
    prompts = await state.in_tokenizer_thread(_token_lists, state, req.input, req.add_special_tokens,
                                                  req.truncate_prompt_tokens)
    outs = await _run(raw, state, prompts, [params] * len(prompts), "classify", request_priority(raw, req.priority))
    if outs is None:
        return Response(status_code=499)
    data = []
    for i, o in enumerate(outs):
        probs = o.outputs.data.reshape(-1)
        label = int(np.argmax(probs))
        data.append({"index": i, "label": info.id2label.get(label, f"LABEL_{label}"), "probs": probs.tolist(),
                     "num_classes": int(probs.shape[0])})
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(outs)})


async def _scores(raw: Request, state: ServerState, req: Any, text_1: Any, text_2: Any
                  ) -> tuple[list[float], list[PoolingRequestOutput]] | None:
    """Scores of each (text_1, text_2) pair, and the outputs computed for them (their usage)."""
    info = _info(state)
    try:
        pairs = score_pairs(text_1, text_2)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    if any(not a or not b for a, b in pairs):
        raise APIError(400, "texts to score must not be empty")
    priority = request_priority(raw, req.priority)
    if info.is_cross_encoder:
        params_list, prompts = [], []
        for a, b in pairs:
            ids, split = await state.in_tokenizer_thread(cross_encoder_pair, state.tokenizer, a, b)
            params = _params(info, "score", req, use_activation=req.use_activation)
            params.extra_kwargs = {"compressed_token_type_ids": split}
            params_list.append(params)
            prompts.append((None, ids))
        outs = await _run(raw, state, prompts, params_list, "score", priority)
        if outs is None:
            return None
        return [float(o.outputs.data.reshape(-1)[0]) for o in outs], outs
    if not info.is_embedding_model:
        raise APIError(400, "score needs an embedding model or a cross-encoder (a classification model with one "
                            "label)")
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    params = _params(info, "embed", req)
    prompts = await state.in_tokenizer_thread(_token_lists, state, texts, True, req.truncate_prompt_tokens)
    outs = await _run(raw, state, prompts, [params] * len(prompts), "score", priority)
    if outs is None:
        return None
    by_text = {t: o.outputs.data for t, o in zip(texts, outs)}
    return [cosine(by_text[a], by_text[b]) for a, b in pairs], outs


async def create_score(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    req = parse_model(ScoreRequest, obj)
    model = state.model_name(req.model)
    result = await _scores(raw, state, req, req.text_1, req.text_2)
    if result is None:
        return Response(status_code=499)
    scores, outs = result
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(outs)})


async def create_rerank(raw: Request) -> Response:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    req = parse_model(RerankRequest, obj)
    model = state.model_name(req.model)
    if not req.documents:
        raise APIError(400, "documents must not be empty", "documents")
    if req.top_n < 0:
        raise APIError(400, "top_n must be >= 0", "top_n")
    result = await _scores(raw, state, req, req.query, req.documents)
    if result is None:
        return Response(status_code=499)
    scores, outs = result
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if req.top_n:
        order = order[: req.top_n]
    results = [{"index": i, "document": {"text": req.documents[i]}, "relevance_score": scores[i]} for i in order]
    n = sum(len(o.prompt_token_ids) for o in outs)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": n},
                         "results": results})


def add_pooling_routes(app: Any) -> None:
    app.add_api_route("/v1/embeddings", create_embedding, methods=["POST"])
    app.add_api_route("/pooling", create_pooling, methods=["POST"])
    app.add_api_route("/classify", create_classify, methods=["POST"])
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, create_score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, create_rerank, methods=["POST"])
