"""Pooling models in the engine: which runner a checkpoint gets (vLLM's --runner / --convert, auto-
detected from the architecture), what the front ends need to know about it (PoolingInfo), and the
checks that refuse what pooling does not combine with.

    BertModel (sentence-transformers)         pooling runner, embed (+ token_embed): the encoder runner, no
                                              KV cache, pooling from modules.json / 1_Pooling (else CLS)
    BertForSequenceClassification             pooling runner, classify (+ token_classify); with one label a
                                              cross-encoder, whose classify output is /score's score
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

from tokenloom.config import ConfigError, EngineConfig, PoolerConfig
from tokenloom.exceptions import VLLMValidationError
from tokenloom.pooling_params import PoolingParams
from tokenloom.tasks import SCORE_TYPE_MAP, check_removed_pooling_task, pick_pooling_task


@dataclass
class PoolingInfo:
    """What the API process (and LLM) needs to know about a pooling engine: vLLM's model_config, as far as
    pooling reads it (PoolingParams.verify takes this object as its model_config)."""

    supported_tasks: tuple[str, ...]  # the PoolingParams tasks the engine runs
    # The one task LLM.encode and /pooling serve (vLLM's ModelConfig.get_pooling_task): the PoolerConfig's
    # `task`, else the first supported one in vLLM's order.
    pooling_task: str
    embedding_size: int  # an embedding's length: the hidden size, or the last Dense projection's
    is_encoder: bool
    pooling_type: str  # the model's sequence pooling (LAST, MEAN, CLS)
    # vLLM's PoolerConfig with the model's defaults filled in (use_activation: embed's normalisation, from the
    # sentence-transformers Normalize module; the step pooling's defaults): what PoolingParams.verify merges.
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    # The cross-encoder's pair input: the tokenizer's (text, text_pair) with token type ids.
    is_cross_encoder: bool = False
    architecture: str = ""
    served_model_name: str = ""  # the name vLLM's messages quote; the server sets its first served name

    @property
    def is_embedding_model(self) -> bool:
        return "embed" in self.supported_tasks

    @property
    def score_type(self) -> str | None:
        """How LLM.score and /score read this model (vLLM's SCORE_TYPE_MAP of its pooling task)."""
        return SCORE_TYPE_MAP.get(self.pooling_task)

    @property
    def enables_scoring_api(self) -> bool:
        """vLLM's enable_scoring_api: embedding models, and classifiers with one label (a cross-encoder)."""
        if self.pooling_task in ("embed", "token_embed"):
            return True
        return self.pooling_task == "classify" and self.num_labels == 1


def build_pooling_info(resolved: Any, user: PoolerConfig | None, supported_tasks: tuple[str, ...],
                       hidden_size: int, is_encoder: bool, hf_config: dict[str, Any], *, num_labels: int = 0,
                       id2label: dict[int, str] | None = None, is_cross_encoder: bool = False,
                       served_model_name: str = "") -> PoolingInfo:
    """A pooling engine's PoolingInfo from its ResolvedPooler (tokenloom/model/pooler.py) and the user's
    PoolerConfig: the pooling task it serves (ConfigError for one it cannot run) and vLLM's PoolerConfig with
    every default filled in, as vLLM's ModelConfig fills its own."""
    user = user or PoolerConfig()
    try:
        pooling_task = pick_pooling_task(user.task, supported_tasks)
    except ValueError as exc:
        raise ConfigError(f"pooler_config.task: {exc}") from None
    effective = PoolerConfig(
        task=user.task, seq_pooling_type=resolved.seq_pooling_type.value,
        tok_pooling_type=resolved.tok_pooling_type.value, use_activation=resolved.use_activation,
        dimensions=user.dimensions, enable_chunked_processing=user.enable_chunked_processing,
        max_embed_len=user.max_embed_len, logit_mean=user.logit_mean, logit_sigma=user.logit_sigma,
        step_tag_id=user.step_tag_id, returned_token_ids=user.returned_token_ids)
    mds = hf_config.get("matryoshka_dimensions")
    archs = hf_config.get("architectures") or []
    return PoolingInfo(
        supported_tasks=supported_tasks, pooling_task=pooling_task or supported_tasks[0],
        embedding_size=resolved.embedding_size(hidden_size), is_encoder=is_encoder,
        pooling_type=resolved.seq_pooling_type.value, pooler_config=effective,
        is_matryoshka=bool(mds) or bool(hf_config.get("is_matryoshka")),
        matryoshka_dimensions=list(mds) if mds else None, num_labels=num_labels, id2label=dict(id2label or {}),
        is_cross_encoder=is_cross_encoder, architecture=archs[0] if archs else "",
        served_model_name=served_model_name)


def read_hf_config(path: Path, overrides: Any = None) -> dict[str, Any]:
    """The model's Hugging Face config ({} for a GGUF) with the engine's hf_overrides (model/hf_overrides.py)."""
    from tokenloom.model.hf_overrides import read_hf_config as read

    return read(path, overrides)


def resolve_runner(config: EngineConfig, path: Path, overrides: Any = None) -> tuple[str, str]:
    """(runner, convert) in force: ("generate", "none") or ("pooling", "embed" | "classify"), from the
    architecture the config (with the engine's hf_overrides) names."""
    from tokenloom.model.bert import is_encoder_checkpoint

    cfg = read_hf_config(path, overrides)
    archs = cfg.get("architectures") or []
    encoder = is_encoder_checkpoint(path, overrides)
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
    """A verified copy: the task (given, the params', or the model's own), the model's defaults merged in
    (vLLM's PoolingParams.verify). ValueError for a task the engine cannot run or a parameter the task does not
    take, in vLLM's words."""
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    params = params.clone()
    task = task or params.task or info.pooling_task
    if params.task is not None and params.task != task:
        raise VLLMValidationError(f"You cannot overwrite params.task={params.task!r} with pooling_task={task!r}!",
                                  parameter="task")
    if task not in info.supported_tasks:  # vLLM's input processor
        raise VLLMValidationError(f"Unsupported task: {task!r} Supported tasks: {list(info.supported_tasks)}",
                                  parameter="task")
    params.task = task
    params.verify(info)
    return params


def verify_pooling_task(info: PoolingInfo, pooling_task: str | None) -> str:
    """LLM.encode's check of the task asked for (vLLM's PoolingOfflineMixin._verify_pooling_task): only the
    model's own pooling task runs; another it supports needs the PoolerConfig's `task`."""
    if pooling_task is None:
        raise ValueError(ENCODE_NEEDS_TASK)
    check_removed_pooling_task(pooling_task)
    if pooling_task in ("embed", "token_embed") and pooling_task not in info.supported_tasks:
        raise ValueError("Embedding API is not supported by this model. Try converting the model using "
                         "`--convert embed`.")
    if pooling_task in ("classify", "token_classify") and pooling_task not in info.supported_tasks:
        raise ValueError("Classification API is not supported by this model. Try converting the model using "
                         "`--convert classify`.")
    if pooling_task != "plugin" and pooling_task != info.pooling_task:
        if pooling_task not in info.supported_tasks:
            raise ValueError(f"Unsupported task: {pooling_task!r} Supported tasks: {info.supported_tasks}")
        raise ValueError(f'Try switching the model\'s pooling_task via `PoolerConfig(task="{pooling_task}")`')
    if pooling_task == "plugin":
        raise ValueError(NO_IO_PROCESSOR_PLUGIN)
    return pooling_task


# vLLM's words for LLM.encode without a task, and for the `plugin` task (tokenloom has no IO-processor plugins).
ENCODE_NEEDS_TASK = """
                pooling_task required for `LLM.encode`.
                Please use one of the more specific methods or set the pooling_task when using `LLM.encode`:
                  - For embeddings, use `LLM.embed(...)` or `pooling_task="embed"`.
                  - For classification logits, use `LLM.classify(...)` or `pooling_task="classify"`.
                  - For similarity scores, use `LLM.score(...)`.
                  - For rewards, `pooling_task="classify"` or `pooling_task="token_classify"`.
                  - For token classification, use `pooling_task="token_classify"`.
                  - For multi-vector retrieval, use `pooling_task="token_embed"`.
                """
NO_IO_PROCESSOR_PLUGIN = ("No IOProcessor plugin installed. Please refer to the documentation and to the "
                          "'prithvi_geospatial_mae_io_processor' offline inference example for more details.")
