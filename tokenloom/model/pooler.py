"""Poolers: a sequence's hidden states -> what a pooling request returns (vLLM's
model_executor/layers/pooler.py: the pooling types, the heads' normalisation and activation).

    LAST   the last token's hidden state (decoders: the causal summary; vLLM's default for embed)
    MEAN   the mean over the prompt's tokens (sentence-transformers' usual mode)
    CLS    the first token's (BERT's [CLS])
    ALL    every token's (token_embed / token_classify)
    STEP   ALL, kept at the tokens equal to step_tag_id (process reward models), restricted to
           returned_token_ids' columns

Heads: embed -> first `dimensions` components (matryoshka), then L2 normalisation when
`normalize`; classify -> the classification head, then softmax (sigmoid with one label) when
`use_activation`. The model's default pooling comes from its sentence-transformers files
(modules.json, 1_Pooling/config.json, the Normalize module) as vLLM reads them, else from the
architecture (encoder embed: CLS; decoder: LAST).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.pooling_params import PoolingParams


class PoolingType(enum.Enum):
    LAST = "LAST"
    ALL = "ALL"
    CLS = "CLS"
    MEAN = "MEAN"
    STEP = "STEP"


@dataclass
class PoolerConfig:
    """vLLM's PoolerConfig (the fields tokenloom reads): the pooling type and the embed default."""

    pooling_type: PoolingType
    normalize: bool = True
    # Where the default came from (for the log and the docs): "sentence-transformers" | "architecture".
    source: str = "architecture"


_ST_MODES = {  # 1_Pooling/config.json flag -> pooling type (vLLM's get_pooling_config)
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}


def sentence_transformers_pooling(path: Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json), or None without one.
    Raises for what tokenloom does not run (max pooling, Dense projection layers)."""
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type = None
    normalize = False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("models.Pooling"):
            cfg_file = path / module.get("path", "") / "config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            for key, ptype in _ST_MODES.items():
                if cfg.get(key):
                    pooling_type = ptype
                    break
            else:
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
                if modes:
                    raise ValueError(f"{path}: sentence-transformers pooling {modes} is not supported "
                                     "(tokenloom runs mean, cls and lasttoken pooling, as vLLM)")
        elif kind.endswith("models.Normalize"):
            normalize = True
        elif kind.endswith("models.Dense"):
            raise ValueError(f"{path}: sentence-transformers Dense projection modules are not supported")
    if pooling_type is None:
        return None
    return PoolerConfig(pooling_type, normalize, source="sentence-transformers")


def resolve_pooler_config(path: Path, is_encoder: bool, override: dict[str, Any] | None = None) -> PoolerConfig:
    """The model's default pooler: `override` (vLLM's --pooler-config: {"pooling_type", "normalize"})
    first, then the sentence-transformers files, then the architecture's default."""
    config = sentence_transformers_pooling(path) or PoolerConfig(
        PoolingType.CLS if is_encoder else PoolingType.LAST, True)
    if override:
        if override.get("pooling_type"):
            config.pooling_type = PoolingType(str(override["pooling_type"]).upper())
            config.source = "override"
        if override.get("normalize") is not None:
            config.normalize = bool(override["normalize"])
    return config


def pooling_type_for(task: str, default: PoolingType) -> PoolingType:
    """token_* tasks pool every token; the others the model's default (STEP stays STEP)."""
    if task in ("token_embed", "token_classify"):
        return PoolingType.STEP if default is PoolingType.STEP else PoolingType.ALL
    return default


def pool_rows(hidden: torch.Tensor, pooling_type: PoolingType) -> torch.Tensor:
    """One sequence's hidden states [L, H] -> [H] (LAST, MEAN, CLS) or [L, H] (ALL, STEP)."""
    if pooling_type is PoolingType.LAST:
        return hidden[-1]
    if pooling_type is PoolingType.CLS:
        return hidden[0]
    if pooling_type is PoolingType.MEAN:
        return hidden.float().mean(dim=0)
    return hidden


def embed_head(x: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    x = x.float()
    if params.dimensions is not None:
        x = x[..., : params.dimensions]
    if params.normalize:
        x = F.normalize(x, p=2, dim=-1)
    return x


def classify_activation(logits: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """vLLM's PoolerClassify: sigmoid with one label, else softmax (or the checkpoint's own)."""
    logits = logits.float()
    if activation == "identity":
        return logits
    if activation == "sigmoid" or logits.shape[-1] < 2:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def step_select(rows: torch.Tensor, token_ids: list[int], params: PoolingParams) -> torch.Tensor:
    """STEP pooling: the rows at the step tag (all rows without one), returned_token_ids' columns."""
    if params.returned_token_ids:
        rows = rows[:, params.returned_token_ids]
    if params.step_tag_id is not None:
        mask = torch.tensor([t == params.step_tag_id for t in token_ids], device=rows.device)
        rows = rows[mask]
    return rows


def to_output(x: torch.Tensor) -> Any:
    """What crosses to the front end: a float32 numpy array (pickles small, needs no torch to read)."""
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
