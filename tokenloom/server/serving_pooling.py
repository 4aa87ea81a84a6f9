"""Pooling endpoints, with vLLM 0.32's request and response shapes (vllm/entrypoints/pooling/; the bodies are
tokenloom/server/protocol_pooling.py):

    POST /v1/embeddings            OpenAI's embeddings: input text / texts / token ids / batches of ids, or a
                                   chat (`messages`, a batch of chats, chat messages in `input`);
                                   encoding_format float | base64 | bytes | bytes_only, embed_dtype, endianness,
                                   dimensions, use_activation, truncate_prompt_tokens, truncation_side, padding
    POST /pooling                  the model's pooling task's raw output (`task`: only the model's own)
    POST /classify                 class probabilities and the label of a classification model
    POST /score, /v1/score         queries against documents (or items; data_1 / data_2; text_1 / text_2): a
                                   cross-encoder's score, or the cosine of an embedding model's two embeddings
    POST /rerank, /v1/rerank,      query + documents, ranked by relevance_score (Jina / Cohere shape), top_n,
         /v2/rerank                max_tokens_per_query / max_tokens_per_doc

As vLLM serves them: /v1/embeddings answers a model whose pooling task is embed, /classify one whose task is
classify, /score and /rerank embedding models and one-label classifiers (cross-encoders); another pooling model
gets vLLM's 501 or 404. Each input is one pooling request through the scheduler (prefill only); a batch is queued
whole before any of it runs, so the engine packs the inputs into steps by the token budget. Usage counts the
prompt tokens. Embeddings of prompts longer than max_model_len run in chunks when the PoolerConfig enables
chunked processing (vLLM's: each chunk pooled apart, the results averaged by length).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenloom.engine.outputs import PoolingOutput, PoolingRequestOutput
from tokenloom.engine.pooling import NO_IO_PROCESSOR_PLUGIN, PoolingInfo, prepare_pooling_params
from tokenloom.engine.scoring import (
    ScoringData,
    cosine,
    cross_encoder_pair,
    maxsim,
    token_limits,
    truncate_scoring_data,
    validate_score_input,
)
from tokenloom.engine.tokenize_params import TokenizeParams
from tokenloom.exceptions import VLLMValidationError
from tokenloom.pooling_params import PoolingParams
from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError
from tokenloom.server.headers import base_request_id, request_priority
from tokenloom.server.params import check_request_chat_template, render_chat
from tokenloom.server.pooling_utils import bytes_response, encode_output, usage
from tokenloom.server.protocol import ChatMessage
from tokenloom.server.protocol_pooling import (
    ClassificationResponse,
    EmbeddingResponse,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreResponse,
    classification_request_class,
    embedding_request_class,
    pooling_request_class,
    reject_removed_pooling_parameters,
    score_request_class,
    with_chat_input,
)
from tokenloom.server.responses import JSONResponse
from tokenloom.server.state import ServerState, get_state
from tokenloom.server.streaming import collect
from tokenloom.server.unsupported import reject_unsupported_pooling

Prompt = tuple[str | None, list[int]]  # (its text, if it came as one; its token ids)


class _ClientLeft(Exception):
    """The client closed the connection while its inputs ran: answered with 499."""


def _refusals_are_400(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint's own refusals (VLLMValidationError, in vLLM's words: PoolingParams.verify, TokenizeParams,
    the score inputs' checks) as 400s naming their parameter, so that the app's fallback handlers, which log
    what the code did not foresee, see none of them."""

    @functools.wraps(endpoint)
    async def answer(raw: Request) -> Response:
        try:
            return await endpoint(raw)
        except VLLMValidationError as exc:
            raise APIError(400, str(exc), exc.parameter) from None

    return answer


# ------------------------------------------------------------------------------------------------ the model
def _info(state: ServerState) -> PoolingInfo:
    info = state.engine.info.pooling
    if info is None:
        raise APIError(400, f"The model `{state.engine.info.model_name}` is a generation model and does not support "
                            "pooling (embeddings, classification, score, rerank): serve a pooling model "
                            "(--runner pooling)", "model")
    return info


def _check_served(info: PoolingInfo, task: str, api: str) -> None:
    """vLLM registers an endpoint's route only for a model that supports its task (else 404) and serves it only
    for the model's own pooling task (else its NotImplementedError, a 501)."""
    if task not in info.supported_tasks:
        raise APIError(404, "Not Found")
    if info.pooling_task != task:
        raise APIError(501, f"The model does not support {api} API")


def _parse(obj: dict[str, Any], pick: Any) -> Any:
    """A body as vLLM's union of request kinds reads it: the removed fields refused first, then its kind."""
    obj = reject_removed_pooling_parameters(obj)
    reject_unsupported_pooling(obj)
    return parse_model(pick(obj), obj)


# ------------------------------------------------------------------------------------------------ inputs
def _tokenize_params(state: ServerState, req: Any, max_total_tokens: int | None,
                     add_special_tokens: bool) -> TokenizeParams:
    """vLLM's checks of the request's truncation (its serving's sentence first), then its TokenizeParams; padding
    to max_length pads to the longest prompt the model computes in one pass (max_model_len, or a smaller
    max_embed_len)."""
    truncate = req.truncate_prompt_tokens
    if truncate is not None and truncate > state.max_model_len:
        raise APIError(400, "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller "
                            "truncation size.", "truncate_prompt_tokens")
    pad = None
    if getattr(req, "padding", None) == "max_length":
        pad = min(state.max_model_len, max_total_tokens or state.max_model_len)
    return TokenizeParams(max_total_tokens, truncate, req.truncation_side, pad, add_special_tokens)


def _completion_prompts(state: ServerState, inp: Any, tok: TokenizeParams) -> list[Prompt]:
    """(text, token ids) per input: a string, strings, token ids, or lists of token ids."""
    if isinstance(inp, str):
        inp = [inp]
    if not inp:
        raise APIError(400, "input must be a non-empty string, list of strings or token ids", "input")
    if all(isinstance(t, int) for t in inp):
        inp = [inp]
    out = []
    for item in inp:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "input must not contain empty strings", "input")
            out.append((item, tok.encode_text(state.tokenizer, item)))
        else:
            if not item:
                raise APIError(400, "input must not contain empty token lists", "input")
            state.engine.input_processor.check_token_ids(item, "input")
            out.append((None, tok.validate_tokens(state.engine.tokenizer, list(item))))
    return out


def _chat_prompts(state: ServerState, req: Any, tok: TokenizeParams) -> list[Prompt]:
    """Each conversation (one, or vLLM's batch of them) through the chat template, tokenized as `tok` says."""
    conversations = req.messages if req.messages and isinstance(req.messages[0], list) else [req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    out = []
    for conversation in conversations:
        try:
            messages = [ChatMessage.model_validate(m) for m in conversation]
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from None
        ids = render_chat(state.tokenizer, messages, req.add_generation_prompt, req.continue_final_message, kwargs,
                          tok.add_special_tokens, req.chat_template)
        out.append((None, tok.validate_tokens(state.tokenizer, ids)))
    return out


async def _prompts(state: ServerState, req: Any, tok: TokenizeParams) -> list[Prompt]:
    if getattr(req, "messages", None) is not None:
        check_request_chat_template(req, state.config.trust_request_chat_template)
        return await state.in_tokenizer_thread(_chat_prompts, state, req, tok)
    return await state.in_tokenizer_thread(_completion_prompts, state, req.input, tok)


def _params(info: PoolingInfo, task: str, **fields: Any) -> PoolingParams:
    return prepare_pooling_params(PoolingParams(**fields), info, task)


# ------------------------------------------------------------------------------------------------ running
def _request_id(raw: Request, req: Any, prefix: str) -> str:
    """vLLM's: the endpoint's prefix and the X-Request-Id header, else the body's request_id, else a fresh id
    (the response's `id`; each input's engine request adds its index)."""
    return f"{prefix}-{base_request_id(raw, req.request_id)}"


async def _run(raw: Request, state: ServerState, prompts: list[Prompt], params_list: list[PoolingParams],
               request_id: str, priority: int) -> list[PoolingRequestOutput]:
    """Queue every input, wait for all (_ClientLeft if the client went away first)."""
    engine = state.engine
    engine.check_admission(len(prompts))
    # Unique in the engine even when clients reuse a request id.
    ids = [f"{request_id}-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(prompts))]
    stream = engine.open_stream()
    try:
        for rid, (text, tokens), params in zip(ids, prompts, params_list):
            engine.add_pooling_request(rid, tokens, params, stream, prompt=text, priority=priority)
    except BaseException:
        stream.close()
        raise
    finals = await collect(raw, stream)
    if finals is None:
        raise _ClientLeft
    outs = [finals[rid] for rid in ids]
    for out in outs:
        if out.error is not None or out.outputs.data is None:
            raise APIError(500, out.error or "pooling failed")
    return outs


async def _run_chunked(raw: Request, state: ServerState, prompts: list[Prompt], params: PoolingParams,
                       request_id: str, priority: int) -> list[PoolingRequestOutput]:
    """vLLM's chunked processing of long embeddings: every prompt cut into max_model_len chunks, each pooled
    as its own request; a prompt's embedding is the chunks' mean weighted by their lengths, normalised again
    when the chunks were (use_activation)."""
    size = state.max_model_len
    chunks = [(i, (None, tokens[start: start + size])) for i, (_, tokens) in enumerate(prompts)
              for start in range(0, len(tokens), size)]
    outs = await _run(raw, state, [c for _, c in chunks], [params] * len(chunks), request_id, priority)
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, tuple[int, int]] = {}
    for (i, (_, tokens)), out in zip(chunks, outs):
        data = np.asarray(out.outputs.data, dtype=np.float32)
        sums[i] = sums.get(i, 0) + data * len(tokens)
        weight, n = counts.get(i, (0, 0))
        counts[i] = (weight + len(tokens), n + 1)
    merged = []
    for i, (text, tokens) in enumerate(prompts):
        weight, n = counts[i]
        vec = sums[i] / weight
        if params.use_activation and n > 1:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        merged.append(PoolingRequestOutput(f"{request_id}-prompt-{i}", PoolingOutput(vec), tokens, prompt=text))
    return merged


# ------------------------------------------------------------------------------------------------ endpoints
async def _read(raw: Request) -> tuple[ServerState, dict[str, Any]]:
    state = get_state(raw)
    return state, await read_json(raw, state.config.max_request_body_bytes)


def _pooled_json(req: Any, outs: list[PoolingRequestOutput], model: str, request_id: str, item: str,
                 response_cls: type[BaseModel]) -> Response:
    """A JSON (float / base64) or bytes response of pooled vectors, in vLLM's shapes."""
    created = int(time.time())
    if req.encoding_format in ("bytes", "bytes_only"):
        return bytes_response(outs, request_id, created, model, req.encoding_format, req.embed_dtype, req.endianness)
    key = "embedding" if item == "embedding" else "data"
    data = [{"index": i, "object": item, key: encode_output(o.outputs.data, req.encoding_format, req.embed_dtype,
                                                           req.endianness)} for i, o in enumerate(outs)]
    body = response_cls.model_validate({"id": request_id, "created": created, "model": model, "data": data,
                                        "usage": usage(outs)})
    return JSONResponse(body.model_dump())


@_refusals_are_400
async def create_embedding(raw: Request) -> Response:
    state, obj = await _read(raw)
    req = _parse(with_chat_input(obj), embedding_request_class)
    model = state.model_name(req.model)
    info = _info(state)
    _check_served(info, "embed", "Embeddings")
    pooler = info.pooler_config
    chunked = pooler.enable_chunked_processing
    max_total = pooler.max_embed_len if chunked else pooler.max_embed_len or state.max_model_len
    tok = _tokenize_params(state, req, max_total, req.add_special_tokens)
    params = _params(info, "embed", dimensions=req.dimensions, use_activation=req.use_activation)
    prompts = await _prompts(state, req, tok)
    priority, request_id = request_priority(raw, req.priority), _request_id(raw, req, "embd")
    try:
        if chunked:
            outs = await _run_chunked(raw, state, prompts, params, request_id, priority)
        else:
            outs = await _run(raw, state, prompts, [params] * len(prompts), request_id, priority)
    except _ClientLeft:
        return Response(status_code=499)
    return _pooled_json(req, outs, model, request_id, "embedding", EmbeddingResponse)


def _pooling_task(info: PoolingInfo, req: Any) -> str:
    """vLLM's ServingPooling._verify_pooling_task: the model's own task only, in its words."""
    if getattr(req, "dimensions", None) is not None:
        raise VLLMValidationError("dimensions is currently not supported", parameter="dimensions")
    task = req.task or info.pooling_task
    if task != "plugin" and task != info.pooling_task:
        if task not in info.supported_tasks:
            raise VLLMValidationError(f"Unsupported task: {task!r} Supported tasks: {info.supported_tasks}",
                                      parameter="task")
        raise VLLMValidationError(f"Try switching the model's pooling_task via --pooler-config.task {task}.",
                                  parameter="task")
    if task == "plugin":
        raise VLLMValidationError(NO_IO_PROCESSOR_PLUGIN, parameter="task")
    return task


@_refusals_are_400
async def create_pooling(raw: Request) -> Response:
    state, obj = await _read(raw)
    req = _parse(obj, pooling_request_class)
    model = state.model_name(req.model)
    info = _info(state)
    task = _pooling_task(info, req)
    tok = _tokenize_params(state, req, state.max_model_len, req.add_special_tokens)
    params = _params(info, task, use_activation=req.use_activation)
    prompts = await _prompts(state, req, tok)
    request_id = _request_id(raw, req, "pooling")
    try:
        outs = await _run(raw, state, prompts, [params] * len(prompts), request_id,
                          request_priority(raw, req.priority))
    except _ClientLeft:
        return Response(status_code=499)
    return _pooled_json(req, outs, model, request_id, "pooling", PoolingResponse)


@_refusals_are_400
async def create_classify(raw: Request) -> Response:
    state, obj = await _read(raw)
    req = _parse(obj, classification_request_class)
    model = state.model_name(req.model)
    info = _info(state)
    _check_served(info, "classify", "Classification")
    tok = _tokenize_params(state, req, state.max_model_len, req.add_special_tokens)
    params = _params(info, "classify", use_activation=req.use_activation)
    prompts = await _prompts(state, req, tok)
    request_id = _request_id(raw, req, "classify")
    try:
        outs = await _run(raw, state, prompts, [params] * len(prompts), request_id,
                          request_priority(raw, req.priority))
    except _ClientLeft:
        return Response(status_code=499)
    data = []
    for i, o in enumerate(outs):
        probs = np.asarray(o.outputs.data, dtype=np.float32).reshape(-1)
        data.append({"index": i, "label": info.id2label.get(int(np.argmax(probs))), "probs": probs.tolist(),
                     "num_classes": int(probs.shape[0])})
    body = ClassificationResponse(id=request_id, model=model, data=data, usage=usage(outs))
    return JSONResponse(body.model_dump())


# ------------------------------------------------------------------------------------------------ scores
async def _scores(raw: Request, state: ServerState, info: PoolingInfo, req: Any, data_1: Any, data_2: Any,
                  request_id: str) -> tuple[list[float], int]:
    """Each (query, document) pair's score, and the prompt tokens computed for them (vLLM's usage: every
    engine input once)."""
    data = validate_score_input(data_1, data_2, architecture=info.architecture)
    limits = token_limits(req.max_tokens_per_query, req.max_tokens_per_doc, state.max_model_len)
    tok = _tokenize_params(state, req, state.max_model_len, True)
    params = _params(info, info.pooling_task, use_activation=req.use_activation)
    priority = request_priority(raw, req.priority)
    if info.score_type == "cross-encoder":
        queries = data.data_1 * len(data.data_2) if len(data.data_1) == 1 else data.data_1
        prompts, params_list = [], []
        for query, doc in zip(queries, data.data_2):
            ids, split = await state.in_tokenizer_thread(cross_encoder_pair, state.tokenizer, query, doc, tok, *limits)
            pair = params.clone()
            pair.extra_kwargs = {"compressed_token_type_ids": split}
            prompts.append((None, ids))
            params_list.append(pair)
        outs = await _run(raw, state, prompts, params_list, request_id, priority)
        return [float(np.asarray(o.outputs.data).reshape(-1)[0]) for o in outs], _tokens(outs)
    data = await state.in_tokenizer_thread(truncate_scoring_data, data, state.tokenizer, *limits)
    prompts = await _score_texts(state, data, tok)
    outs = await _run(raw, state, prompts, [params] * len(prompts), request_id, priority)
    firsts, seconds = outs[: len(data.data_1)], outs[len(data.data_1):]
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    score = maxsim if info.score_type == "late-interaction" else cosine
    return [score(a.outputs.data, b.outputs.data) for a, b in zip(firsts, seconds)], _tokens(outs)


async def _score_texts(state: ServerState, data: ScoringData, tok: TokenizeParams) -> list[Prompt]:
    """A bi-encoder's inputs: every query, then every document, each embedded on its own."""
    texts = data.data_1 + data.data_2
    return await state.in_tokenizer_thread(lambda: [(t, tok.encode_text(state.tokenizer, t)) for t in texts])


def _tokens(outs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outs)


def _scoring_info(state: ServerState) -> PoolingInfo:
    """vLLM registers /score and /rerank only for embedding models and one-label classifiers."""
    info = _info(state)
    if not info.enables_scoring_api:
        raise APIError(404, "Not Found")
    return info


@_refusals_are_400
async def create_score(raw: Request) -> Response:
    state, obj = await _read(raw)
    info = _scoring_info(state)
    req = _parse(obj, score_request_class)
    model = state.model_name(req.model)
    request_id = _request_id(raw, req, "score")
    try:
        scores, n = await _scores(raw, state, info, req, req.data_1, req.data_2, request_id)
    except _ClientLeft:
        return Response(status_code=499)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    body = ScoreResponse(id=request_id, model=model, data=data, usage={"prompt_tokens": n, "total_tokens": n})
    return JSONResponse(body.model_dump())


@_refusals_are_400
async def create_rerank(raw: Request) -> Response:
    state, obj = await _read(raw)
    info = _scoring_info(state)
    req = _parse(obj, lambda _: RerankRequest)
    model = state.model_name(req.model)
    request_id = _request_id(raw, req, "score")  # vLLM's ServingScores answers /rerank too
    try:
        scores, n = await _scores(raw, state, info, req, req.query, req.documents, request_id)
    except _ClientLeft:
        return Response(status_code=499)
    documents = req.documents if isinstance(req.documents, list) else [req.documents]
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if req.top_n and req.top_n < len(documents):
        order = order[: req.top_n]
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
    body = RerankResponse(id=request_id, model=model, results=results,
                          usage={"prompt_tokens": n, "total_tokens": n})
    return JSONResponse(body.model_dump())


# ------------------------------------------------------------------------------------------------ routing
# vLLM's /invocations for a pooling model: the first of these the model serves whose body validates.
_INVOCATIONS = (
    ("embed", lambda obj: embedding_request_class(with_chat_input(obj)), create_embedding),
    ("classify", classification_request_class, create_classify),
    ("rerank", lambda _: RerankRequest, create_rerank),
    ("score", score_request_class, create_score),
    ("pooling", pooling_request_class, create_pooling),
)


def _invocation_served(info: PoolingInfo, kind: str) -> bool:
    if kind in ("rerank", "score"):
        return info.enables_scoring_api
    return kind == "pooling" or info.pooling_task == kind


async def pooling_invocation(raw: Request, obj: dict[str, Any]) -> Response:
    """A pooling model's /invocations (SageMaker's entry point): the body's shape picks the endpoint."""
    info = _info(get_state(raw))
    tried = []
    for kind, pick, endpoint in _INVOCATIONS:
        if not _invocation_served(info, kind):
            continue
        try:
            cls = pick(obj)
            cls.model_validate(with_chat_input(obj) if kind == "embed" else obj)
        except ValueError:
            tried.append(kind)
            continue
        return await endpoint(raw)
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {tried}")


def add_pooling_routes(app: Any) -> None:
    app.add_api_route("/v1/embeddings", create_embedding, methods=["POST"])
    app.add_api_route("/pooling", create_pooling, methods=["POST"])
    app.add_api_route("/classify", create_classify, methods=["POST"])
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, create_score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, create_rerank, methods=["POST"])
