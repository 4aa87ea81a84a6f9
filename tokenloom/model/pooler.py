"""Poolers: a sequence's hidden states -> what a pooling request returns (vLLM's
model_executor/layers/pooler.py: the pooling types, the heads' normalisation and activation).

    LAST   the last token's hidden state (decoders: the causal summary; vLLM's default for embed)
    MEAN   the mean over the prompt's tokens (sentence-transformers' usual mode)
    CLS    the first token's (BERT's [CLS])
    ALL    every token's (token_embed / token_classify)
    STEP   ALL, kept at the tokens equal to step_tag_id (process reward models), restricted to
           returned_token_ids' columns

Heads: embed -> the checkpoint's sentence-transformers Dense projections (linear + activation,
in modules.json order, as vLLM's ST projector), the first `dimensions` components (matryoshka), then
L2 normalisation when `use_activation`; classify -> the classification head, then (with the PoolerConfig's
logit_mean / logit_sigma, vLLM's affine calibration) softmax (sigmoid with one label) when `use_activation`.
The model's pooling (ResolvedPooler) is the user's PoolerConfig (--pooler-config) over the checkpoint's
sentence-transformers files (modules.json, 1_Pooling/config.json, the Normalize module) as vLLM reads them,
over the architecture's defaults (encoder embed: CLS; decoder: LAST; token tasks: ALL).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
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


# sentence-transformers saves a Dense module's activation as its torch class path
# ("torch.nn.modules.activation.Tanh"); the class name picks the function.
_DENSE_ACTIVATIONS = {
    "identity": lambda x: x, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": F.relu, "gelu": F.gelu,
    "silu": F.silu,
}


@dataclass
class DenseLayer:
    """One sentence-transformers Dense module: activation(x @ weight.T + bias), on the pooled vector."""

    weight: torch.Tensor  # [out_features, in_features], float32
    bias: torch.Tensor | None
    activation: str = "identity"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _DENSE_ACTIVATIONS[self.activation](F.linear(x, self.weight, self.bias))


@dataclass
class ResolvedPooler:
    """The pooling a model runs: vLLM's PoolerConfig fields once every default is filled in (the user's
    --pooler-config over the sentence-transformers files over the architecture), plus what only the runner
    needs (the Dense projections)."""

    seq_pooling_type: PoolingType  # embed / classify: LAST, MEAN or CLS
    use_activation: bool = True  # embed's L2 normalisation by default (vLLM's pooler_config.use_activation)
    tok_pooling_type: PoolingType = PoolingType.ALL  # token_embed / token_classify: ALL or STEP
    # Where the sequence pooling came from (for the log and the docs): "sentence-transformers" | "architecture" |
    # "override".
    source: str = "architecture"
    # The checkpoint's sentence-transformers Dense projections, applied to embed's pooled vector.
    dense: list[DenseLayer] = field(default_factory=list)
    # classify: activation((logit - logit_mean) / logit_sigma) (vLLM's affine calibration); None: as is.
    logit_mean: float | None = None
    logit_sigma: float | None = None

    def embedding_size(self, hidden_size: int) -> int:
        """The size of an embedding: the last projection's out_features, else the hidden size."""
        return int(self.dense[-1].weight.shape[0]) if self.dense else hidden_size

    def pooling_type_for(self, task: str) -> PoolingType:
        """token_* tasks pool every token (ALL, or STEP's tagged ones); the others the sequence pooling."""
        return self.tok_pooling_type if task in ("token_embed", "token_classify") else self.seq_pooling_type

    def calibrate(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's logit_mean / logit_sigma, before the activation."""
        if self.logit_mean is not None:
            logits = logits - self.logit_mean
        if self.logit_sigma is not None:
            logits = logits / self.logit_sigma
        return logits


def _load_dense(path: Path, folder: str) -> DenseLayer:
    """A Dense module's config.json and weights (model.safetensors, else pytorch_model.bin), with the key
    spellings vLLM accepts (`linear.weight`, `weight`, `dense.weight`)."""
    where = path / folder
    cfg_file = where / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: Dense module {folder!r} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    act_path = cfg.get("activation_function") or "torch.nn.modules.linear.Identity"
    activation = act_path.rsplit(".", 1)[-1].lower()
    if activation not in _DENSE_ACTIVATIONS:
        raise ValueError(f"{path}: Dense module {folder!r}: activation {act_path!r} is not supported "
                         f"({', '.join(sorted(_DENSE_ACTIVATIONS))})")
    if (where / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(where / "model.safetensors"))
    elif (where / "pytorch_model.bin").is_file():
        state = torch.load(str(where / "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path}: Dense module {folder!r} has no model.safetensors or pytorch_model.bin")
    key = next((k for k in ("linear.weight", "weight", "dense.weight") if k in state), None)
    if key is None:
        raise ValueError(f"{path}: Dense module {folder!r}: no linear.weight among {sorted(state)}")
    weight = state[key].float()
    bias = state.get(key.replace("weight", "bias"))
    shape = (cfg.get("out_features"), cfg.get("in_features"))
    if None not in shape and tuple(weight.shape) != shape:
        raise ValueError(f"{path}: Dense module {folder!r}: weight {tuple(weight.shape)}, config says {shape}")
    return DenseLayer(weight, None if bias is None else bias.float(), activation)


_ST_MODES = {  # 1_Pooling/config.json flag -> pooling type (vLLM's get_pooling_config)
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}


def sentence_transformers_pooling(path: Path) -> ResolvedPooler | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json), or None without one.
    Raises for what tokenloom does not run (max, mean_sqrt_len and weighted mean pooling)."""
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type = None
    normalize = False
    dense: list[DenseLayer] = []
    if isinstance(modules, dict):  # some checkpoints wrap the list (vLLM reads both)
        modules = modules.get("modules", [])
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
            dense.append(_load_dense(path, module.get("path", "")))
    for first, second in zip(dense, dense[1:]):
        if second.weight.shape[1] != first.weight.shape[0]:
            raise ValueError(f"{path}: Dense modules do not chain ({tuple(first.weight.shape)} then "
                             f"{tuple(second.weight.shape)})")
    if pooling_type is None:
        return None
    return ResolvedPooler(pooling_type, normalize, source="sentence-transformers", dense=dense)


def resolve_pooler(path: Path, is_encoder: bool, user: Any = None) -> ResolvedPooler:
    """The model's pooling: `user` (vLLM's PoolerConfig, --pooler-config) first, then the sentence-transformers
    files, then the architecture's default (CLS for an encoder, LAST for a decoder; ALL for token tasks)."""
    resolved = sentence_transformers_pooling(path) or ResolvedPooler(
        PoolingType.CLS if is_encoder else PoolingType.LAST, True)
    if user is None:
        return resolved
    if user.seq_pooling_type is not None:
        resolved.seq_pooling_type = PoolingType(user.seq_pooling_type)
        resolved.source = "override"
    if user.tok_pooling_type is not None:
        resolved.tok_pooling_type = PoolingType(user.tok_pooling_type)
    if user.use_activation is not None:
        resolved.use_activation = user.use_activation
    resolved.logit_mean, resolved.logit_sigma = user.logit_mean, user.logit_sigma
    return resolved


def pool_rows(hidden: torch.Tensor, pooling_type: PoolingType) -> torch.Tensor:
    """One sequence's hidden states [L, H] -> [H] (LAST, MEAN, CLS) or [L, H] (ALL, STEP)."""
    if pooling_type is PoolingType.LAST:
        return hidden[-1]
    if pooling_type is PoolingType.CLS:
        return hidden[0]
    if pooling_type is PoolingType.MEAN:
        return hidden.float().mean(dim=0)
    return hidden


def embed_head(x: torch.Tensor, params: PoolingParams, dense: list[DenseLayer] | None = None) -> torch.Tensor:
    x = x.float()
    for layer in dense or ():
        x = layer(x)
    if params.dimensions is not None:
        x = x[..., : params.dimensions]
    if params.use_activation:
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
