"""Scores of text pairs (LLM.score, /score, /rerank), as vLLM 0.32's scoring io processors compute them
(vllm/entrypoints/pooling/scoring/: utils.py, io_processor.py), with its checks in its words.

    validate_score_input   one query against N documents, or N against N: vLLM's ScoringData, its refusals
    bi-encoder             an embedding model: each text embedded once, the cosine of the two embeddings
    cross-encoder          a classifier with one label: the pair encoded together (the tokenizer's text_pair,
                           token type 1 from the second text), its classify output is the score
    max_tokens_per_query   a query / document cut to that many tokens before the pair is built (vLLM's request
    max_tokens_per_doc     fields; offline, PoolingParams.extra_kwargs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.engine.tokenize_params import TokenizeParams
from tokenloom.exceptions import VLLMValidationError


@dataclass
class ScoringData:
    data_1: list[str]
    data_2: list[str]


def _score_texts(data: Any, name: str, architecture: str) -> list[str]:
    items = data if isinstance(data, list) else [data]
    for item in items:
        if isinstance(item, dict):  # vLLM's ScoreMultiModalParam ({"content": [...]}): text models only here
            raise VLLMValidationError(f"MultiModalParam is not supported for {architecture}")
        if not isinstance(item, str):
            raise TypeError(f"score: {name} must be a text or a list of texts, got {type(item).__name__}")
    return list(items)


def validate_score_input(data_1: Any, data_2: Any, is_multimodal_model: bool = False,
                         architecture: str = "") -> ScoringData:
    """vLLM's validate_score_input: 1:1, 1:N or N:N texts (tokenloom's models read text only)."""
    del is_multimodal_model  # tokenloom runs no multimodal model: a content list is refused as vLLM refuses it
    text_1 = _score_texts(data_1, "data_1", architecture)
    text_2 = _score_texts(data_2, "data_2", architecture)
    if len(text_1) > 1 and len(text_1) != len(text_2):
        raise VLLMValidationError("Input lengths must be either 1:1, 1:N or N:N")
    if not text_1:
        raise VLLMValidationError("At least one text element must be given")
    if not text_2:
        raise VLLMValidationError("At least one text_pair element must be given")
    return ScoringData(text_1, text_2)


def truncate_text_to_tokens(text: str, tokenizer: Any, max_tokens: int) -> str:
    """vLLM's: `text` cut to at most `max_tokens` content tokens at a character boundary the tokenizer's
    offsets give (no decode round trip, which could change the count)."""
    if max_tokens <= 0:
        return ""
    hf = getattr(tokenizer, "hf", tokenizer)
    while text:
        encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        if len(encoding["input_ids"]) <= max_tokens:
            break
        char_end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        if char_end >= len(text):
            char_end = len(text) - 1
        text = text[:char_end]
    return text


def get_num_special_tokens_for_pair(tokenizer: Any) -> int:
    """The special tokens a pair encoding adds ([CLS] a [SEP] b [SEP]: 3)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    method = getattr(hf, "num_special_tokens_to_add", None)
    if method is not None:
        try:
            return method(pair=True)
        except TypeError:
            pass
    return len(hf("", text_pair="", add_special_tokens=True)["input_ids"])


def compress_token_type_ids(token_type_ids: list[int]) -> int:
    """Where token type 1 starts (the list's length without one): vLLM's compressed_token_type_ids."""
    first_one = len(token_type_ids)
    err_msg = "Token type ids are expected to be a sequence of zeros followed by a sequence of ones"
    for i, type_id in enumerate(token_type_ids):
        if type_id == 0 and first_one < i:
            raise ValueError(err_msg)
        if type_id == 1 and first_one > i:
            first_one = i
        elif type_id > 1:
            raise ValueError(err_msg)
    return first_one


def token_limits(max_tokens_per_query: int, max_tokens_per_doc: int, max_model_len: int) -> tuple[int, int]:
    """vLLM's _get_token_limits: each limit non-negative and below max_model_len (0: no limit)."""
    for value, name in ((max_tokens_per_query, "max_tokens_per_query"), (max_tokens_per_doc, "max_tokens_per_doc")):
        if value == 0:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise VLLMValidationError(f"{name} must be a non-negative integer", parameter=name)
        if value >= max_model_len:
            raise VLLMValidationError(f"{name} ({value}) must be less than max_model_len ({max_model_len}).",
                                      parameter=name)
    return max_tokens_per_query, max_tokens_per_doc


def truncate_scoring_data(data: ScoringData, tokenizer: Any, max_tokens_per_query: int,
                          max_tokens_per_doc: int) -> ScoringData:
    """A bi-encoder's queries and documents cut to their limits before each is embedded."""
    data_1, data_2 = data.data_1, data.data_2
    if max_tokens_per_query > 0:
        data_1 = [truncate_text_to_tokens(d, tokenizer, max_tokens_per_query) for d in data_1]
    if max_tokens_per_doc > 0:
        data_2 = [truncate_text_to_tokens(d, tokenizer, max_tokens_per_doc) for d in data_2]
    return ScoringData(data_1, data_2)


def cross_encoder_pair(tokenizer: Any, query: str, doc: str, tok_params: TokenizeParams,
                       max_tokens_per_query: int = 0, max_tokens_per_doc: int = 0) -> tuple[list[int], int | None]:
    """A cross-encoder's input for one pair (vLLM's get_score_prompt with a separating token): the tokenizer's
    (text, text_pair) encoding, with the query and the document cut to their limits (the document's by
    `only_second` truncation), then the prompt's truncation and bound; and where token type 1 starts
    (compressed_token_type_ids; None when the tokenizer gives no types)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if max_tokens_per_query > 0:
        query = truncate_text_to_tokens(query, tokenizer, max_tokens_per_query)
    if max_tokens_per_doc > 0:
        doc = truncate_text_to_tokens(doc, tokenizer, max_tokens_per_doc)
    kwargs = tok_params.encode_kwargs()
    if max_tokens_per_doc > 0:
        query_tokens = hf.encode(query, add_special_tokens=False)
        limit = len(query_tokens) + max_tokens_per_doc + get_num_special_tokens_for_pair(tokenizer)
        existing = kwargs.get("max_length")
        kwargs.update(truncation="only_second", max_length=limit if existing is None else min(limit, existing))
    enc = hf(query, text_pair=doc, return_token_type_ids=True, **kwargs)
    ids = tok_params.validate_tokens(tokenizer, list(enc["input_ids"]))
    types = enc.get("token_type_ids")
    if not types:
        return ids, None
    types = tok_params.truncate(tokenizer, list(types))[: len(ids)]
    return ids, (compress_token_type_ids(types) if 1 in types else None)


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two vectors (numpy or torch), as vLLM's bi-encoder score (float32)."""
    import numpy as np

    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / max(na * nb, 1e-8))


def maxsim(query_tokens: Any, doc_tokens: Any) -> float:
    """ColBERT's MaxSim (vLLM's late-interaction score): for each query token its best document token's dot
    product, summed (float32)."""
    import numpy as np

    q = np.asarray(query_tokens, dtype=np.float32)
    d = np.asarray(doc_tokens, dtype=np.float32)
    return float((q @ d.T).max(axis=-1).sum())
