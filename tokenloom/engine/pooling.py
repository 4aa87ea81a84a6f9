"""Pooling models in the engine: which runner a checkpoint gets (vLLM's --runner / --convert, auto-
detected from the architecture), what the front ends need to know about it (PoolingInfo), and the
checks that refuse what pooling does not combine with.

    BertModel (sentence-transformers)         pooling runner, embed: the encoder runner, no KV cache,
                                              pooling from modules.json / 1_Pooling (else CLS)
    BertForSequenceClassification             pooling runner, classify + score (a cross-encoder)
    Roberta* / XLMRoberta* (bge-m3, e5, the   the same two, with RoBERTa's positions and head
    bge rerankers)
    *ForCausalLM with --runner pooling        the decoder's runner over its paged KV cache, LAST pooling
    (or --convert embed)                      (chunked prefill and prefix caching stay: both are sound
                                              for a causal model's last token)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.prompt_fit import EMPTY_PROMPT
from tokenloom.exceptions import ValidationError
from tokenloom.pooling_params import PoolingParams


@dataclass
class PoolingInfo:
    """What the API process (and LLM) needs to know about a pooling engine."""

    tasks: list[str]  # the PoolingParams tasks it serves
    hidden_size: int
    is_encoder: bool
    pooling_type: str  # the model's default pooling (LAST, MEAN, CLS, ...)
    normalize: bool  # embed's default
    is_matryoshka: bool = False
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    # The cross-encoder's pair input: the tokenizer's (text, text_pair) with token type ids.
    is_cross_encoder: bool = False

    @property
    def is_embedding_model(self) -> bool:
        return "embed" in self.tasks


def read_hf_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    return json.loads(cfg_file.read_text()) if path.is_dir() and cfg_file.is_file() else {}


def resolve_runner(config: EngineConfig, path: Path) -> tuple[str, str]:
    """(runner, convert) in force: ("generate", "none") or ("pooling", "embed" | "classify")."""
    from tokenloom.model.bert import is_encoder_checkpoint

    cfg = read_hf_config(path)
    archs = cfg.get("architectures") or []
    encoder = is_encoder_checkpoint(path)
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    runner = config.runner
    if runner == "auto":
        runner = "pooling" if encoder or classifier or config.convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if encoder or classifier:
            raise ConfigError(f"{path.name} is a pooling model ({', '.join(archs) or 'an encoder'}): it cannot "
                              "generate text; serve it with --runner pooling (the default for it)")
        if config.convert not in ("auto", "none"):
            raise ConfigError(f"--convert {config.convert} needs --runner pooling")
        return "generate", "none"
    convert = config.convert
    if convert in ("auto", "none"):
        convert = "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise ConfigError(f"--convert classify needs a checkpoint with a classification head "
                          f"(*ForSequenceClassification); {path.name} is {', '.join(archs) or 'not one'}")
    if classifier and not encoder:
        raise ConfigError(f"{', '.join(archs)}: decoder classification heads are not supported; "
                          "BERT / RoBERTa / XLM-RoBERTa *ForSequenceClassification cross-encoders are")
    if convert == "embed" and classifier:
        convert = "classify"  # the head is what the checkpoint is for
    return "pooling", convert


def check_pooling_engine(config: EngineConfig) -> None:
    """Features a pooling engine refuses (before minutes of loading): each works on generation only."""
    sched = config.scheduler
    if sched is not None and sched.async_scheduling:
        raise ConfigError("--async-scheduling is not supported with --runner pooling: pooling requests finish "
                          "in the step that computes their prompt's end, there is no decode to overlap")
    if config.speculative_config is not None:
        raise ConfigError("speculative decoding needs a generation model; this engine runs a pooling model")
    if config.quantization == "int8":
        raise ConfigError("--quantization int8 is not supported with --runner pooling")
    if config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector is not None:
        raise ConfigError(f"{config.kv_transfer_config.kv_connector} (--kv-transfer-config / --kv-offloading-size) is "
                          "not supported with --runner pooling: a pooling request computes every prompt row and "
                          "keeps no KV to offload or hand off")
    if sched is not None and sched.batching != "continuous":
        raise ConfigError("--batching static/request compare generation schedules; a pooling engine runs "
                          "continuous batching only")


def sentence_bert_max_seq_length(path: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length (vLLM caps max_model_len with it)."""
    f = path / "sentence_bert_config.json"
    if path.is_dir() and f.is_file():
        value = json.loads(f.read_text()).get("max_seq_length")
        return int(value) if value else None
    return None


def prepare_pooling_params(params: PoolingParams, info: PoolingInfo, task: str | None = None) -> PoolingParams:
    """A verified copy: the task (given, the params', or the model's first), the model's defaults.
    ValueError for a task the model does not serve or a parameter the task does not take."""
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    params = params.clone()
    task = task or params.task or info.tasks[0]
    if task not in info.tasks:
        what = "an embedding model" if info.is_embedding_model else "a classification model"
        raise ValueError(f"task {task!r} is not supported by this model ({what}; tasks: {', '.join(info.tasks)})")
    params.verify(task, model_dim=info.hidden_size, is_matryoshka=info.is_matryoshka,
                  default_normalize=info.normalize)
    return params


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: k = max_model_len); None keeps all
    (then a prompt longer than max_model_len is an error, raised here with vLLM's wording)."""
    k = truncate_prompt_tokens
    if k is not None:
        if k == -1:
            k = max_model_len
        if k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                             "Please request a smaller truncation size.")
        token_ids = token_ids[-k:] if k else []
    if not token_ids:
        raise ValidationError(EMPTY_PROMPT, parameter="prompt")
    if len(token_ids) > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{len(token_ids)} tokens in the input for embedding generation. Please reduce the length "
                         "of the input.")
    return token_ids


def cross_encoder_pair(tokenizer: Any, text_1: str, text_2: str) -> tuple[list[int], int | None]:
    """A cross-encoder's input for one pair: the tokenizer's (text, text_pair) encoding, and where
    token type 1 starts (vLLM's compressed_token_type_ids; None when the tokenizer gives no types)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    enc = hf(text_1, text_pair=text_2, return_token_type_ids=True)
    ids = list(enc["input_ids"])
    types = enc.get("token_type_ids")
    split = types.index(1) if types and 1 in types else None
    return ids, split


def score_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing for score/rerank: one query against N documents, or N against N pairwise."""
    d1 = [data_1] if isinstance(data_1, str) else data_1
    d2 = [data_2] if isinstance(data_2, str) else data_2
    for name, texts in (("data_1", d1), ("data_2", d2)):  # what the tokenizer and the cosine's dedup take
        if not isinstance(texts, list | tuple) or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"score: {name} must be a text or a list of texts, got {type(texts).__name__}"
                            f"{'' if not isinstance(texts, list | tuple) else ' holding other things'}")
    d1, d2 = list(d1), list(d2)
    if not d1 or not d2:
        raise ValueError("score needs at least one text on each side")
    if len(d1) == 1:
        d1 = d1 * len(d2)
    elif len(d1) != len(d2):
        raise ValueError(f"score: {len(d1)} texts against {len(d2)}: give one query, or as many as the documents")
    return list(zip(d1, d2))


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two vectors (numpy or torch), as vLLM's embedding-model score (float32)."""
    import numpy as np

    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / max(na * nb, 1e-8))


def encode_text(tokenizer: Any, text: str, truncate_prompt_tokens: int | None, max_model_len: int,
                add_special_tokens: bool = True) -> list[int]:
    """A text input's token ids. With truncate_prompt_tokens, as vLLM's renderer does for text: the
    tokenizer truncates (its truncation side, right for BERT: [CLS] ... [SEP] kept, as
    sentence-transformers' max_seq_length does); token-id inputs keep their last k (truncate_prompt)."""
    k = truncate_prompt_tokens
    if k is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                         "Please request a smaller truncation size.")
    hf = getattr(tokenizer, "hf", tokenizer)
    return list(hf(text, add_special_tokens=add_special_tokens, truncation=True, max_length=k)["input_ids"])
