"""BERT-style encoders: bidirectional attention, absolute position embeddings, token-type ids, post-LN.

Enough for sentence-transformers checkpoints such as all-MiniLM-L6-v2 (`BertModel`) and for
cross-encoders (`BertForSequenceClassification`: BERT's pooler, dense + tanh over [CLS], then the
classifier). RoBERTa and XLM-RoBERTa (bge-m3, multilingual-e5, the bge rerankers) are the same network
with two differences, both taken from transformers' modeling_roberta: positions start after the padding
id (`padding_idx + 1`, and a pad token inside a sequence keeps position `padding_idx` without advancing
the count), and the classification head is dense + tanh + out_proj over <s> with no BERT pooler.

No KV cache is kept: a prompt is computed whole in one step (vLLM disables chunked prefill for
encoders: attention sees the whole sequence).

The step's sequences arrive flattened ([T] token ids, one segment per sequence, sorted by length by
the runner); every linear layer runs on the flat [T, H] rows (no padding), and attention runs per
run of equal-length sequences on a [n, heads, L, L] view of those rows (torch's SDPA, no mask, no
copy). A first version padded the whole step to its longest sequence with a key mask; grouping by
length with gathers cost more in index copies than it saved (see docs/pooling.md).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.model.hf_overrides import ModelOverrides, read_hf_config

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "RobertaModel",
                         "RobertaForSequenceClassification", "XLMRobertaModel", "XLMRobertaForSequenceClassification")
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
_ROBERTA_MODEL_TYPES = ("roberta", "xlm-roberta")


def is_encoder_checkpoint(path: Path, overrides: ModelOverrides | None = None) -> bool:
    """A Hugging Face directory whose config.json (with the engine's hf_overrides) names a BERT-style encoder."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    cfg = read_hf_config(path, overrides)
    archs = cfg.get("architectures") or []
    return cfg.get("model_type") in ENCODER_MODEL_TYPES or any(a in ENCODER_ARCHITECTURES for a in archs)


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    architecture: str = "BertModel"
    # RoBERTa's positions start at pad_token_id + 1 (its embedding table keeps the first rows unused);
    # BERT's at 0.
    roberta_positions: bool = False
    num_labels: int = 0  # > 0: *ForSequenceClassification
    id2label: dict[int, str] = field(default_factory=dict)
    # Classification activation read from the checkpoint (sentence-transformers' CrossEncoder
    # config, else the problem type): "sigmoid" | "softmax" | "identity" | None (vLLM's rule).
    activation: str | None = None
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def max_positions(self) -> int:
        """The longest sequence the position table serves (RoBERTa: 514 rows, 512 tokens)."""
        if self.roberta_positions:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    def position_ids(self, token_ids: list[int]) -> list[int]:
        """A sequence's position ids, as transformers computes them for this architecture."""
        if not self.roberta_positions:
            return list(range(len(token_ids)))
        # modeling_roberta.create_position_ids_from_input_ids: cumsum over non-pad tokens, offset by the
        # padding id; a pad token sits at padding_idx.
        pad, out, count = self.pad_token_id, [], 0
        for t in token_ids:
            if t == pad:
                out.append(pad)
            else:
                count += 1
                out.append(pad + count)
        return out

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> BertConfig:
        roberta = cfg.get("model_type") in _ROBERTA_MODEL_TYPES
        archs = cfg.get("architectures") or ["RobertaModel" if roberta else "BertModel"]
        arch = next((a for a in archs if a in ENCODER_ARCHITECTURES), archs[0])
        if arch not in ENCODER_ARCHITECTURES:
            raise ValueError(f"unsupported encoder architecture {arch!r}; tokenloom runs "
                             f"{', '.join(ENCODER_ARCHITECTURES)}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r} (absolute only)")
        act = cfg.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"unsupported hidden_act {act!r} for a BERT encoder")
        id2label = {int(k): v for k, v in (cfg.get("id2label") or {}).items()}
        num_labels = 0
        if arch.endswith("ForSequenceClassification"):
            num_labels = int(cfg.get("num_labels") or len(id2label) or 2)
        st_act = (cfg.get("sentence_transformers") or {}).get("activation_fn") or ""
        activation = None
        if "Sigmoid" in st_act:
            activation = "sigmoid"
        elif "Identity" in st_act:
            activation = "identity"
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2), layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=act, pad_token_id=cfg.get("pad_token_id") or 0, architecture=arch,
            roberta_positions=roberta or arch.startswith(("Roberta", "XLMRoberta")), num_labels=num_labels,
            id2label=id2label, activation=activation, name=name,
            extra={k: cfg[k] for k in ("is_matryoshka", "matryoshka_dimensions") if k in cfg},
        )


def load_bert(path: Path, dtype: torch.dtype = torch.float32,
              overrides: ModelOverrides | None = None) -> tuple[BertConfig, dict[str, torch.Tensor]]:
    """Config and weights of a BERT / RoBERTa directory, named without the `bert.` / `roberta.` prefix
    (checkpoints save both spellings); `position_ids` buffers are dropped. `overrides`: the engine's
    hf_overrides, applied to config.json first (vLLM's: e.g. num_labels, matryoshka_dimensions)."""
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    config = BertConfig.from_hf(overrides.hf_config(cfg) if overrides is not None else cfg, name=path.name)
    weights: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(("position_ids", "token_type_ids")):  # buffers, not weights
                    continue
                weights[name.removeprefix("bert.").removeprefix("roberta.")] = f.get_tensor(name).to(dtype)
    _check_bert_weights(config, weights, path)
    return config, weights


def _check_bert_weights(config: BertConfig, weights: dict[str, torch.Tensor], path: Path) -> None:
    h, i = config.hidden_size, config.intermediate_size
    expected = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
    }
    for n in range(config.num_hidden_layers):
        p = f"encoder.layer.{n}."
        for part in ("query", "key", "value"):
            expected[p + f"attention.self.{part}.weight"] = (h, h)
        expected[p + "attention.output.dense.weight"] = (h, h)
        expected[p + "intermediate.dense.weight"] = (i, h)
        expected[p + "output.dense.weight"] = (h, i)
    if config.is_classifier and config.roberta_positions:  # RobertaClassificationHead
        expected["classifier.dense.weight"] = (h, h)
        expected["classifier.out_proj.weight"] = (config.num_labels, h)
    elif config.is_classifier:
        expected["classifier.weight"] = (config.num_labels, h)
    for name, shape in expected.items():
        t = weights.get(name)
        if t is None:
            raise ValueError(f"{path}: missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, the config implies {shape}")


def _act(name: str):
    if name == "relu":
        return F.relu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu


class BertEncoder:
    """The network as plain tensors (no nn.Module: nothing trains here)."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.word = w["embeddings.word_embeddings.weight"]
        self.pos = w["embeddings.position_embeddings.weight"]
        self.type = w["embeddings.token_type_embeddings.weight"]
        self.emb_ln = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = []
        for n in range(config.num_hidden_layers):
            p = f"encoder.layer.{n}."
            qkv_w = torch.cat([w[p + f"attention.self.{x}.weight"] for x in ("query", "key", "value")])
            qkv_b = torch.cat([w[p + f"attention.self.{x}.bias"] for x in ("query", "key", "value")])
            self.layers.append((
                qkv_w, qkv_b,
                w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"],
                w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"],
                w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"],
                w[p + "output.dense.weight"], w[p + "output.dense.bias"],
                w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"],
            ))
        self.act = _act(config.hidden_act)
        self.pooler = None
        self.classifier = None
        if config.is_classifier and config.roberta_positions:
            # RobertaClassificationHead: dense + tanh over <s>, then out_proj (it plays BERT's pooler role).
            self.pooler = (w["classifier.dense.weight"], w["classifier.dense.bias"])
            self.classifier = (w["classifier.out_proj.weight"], w["classifier.out_proj.bias"])
        elif config.is_classifier:
            if "pooler.dense.weight" in w:
                self.pooler = (w["pooler.dense.weight"], w["pooler.dense.bias"])
            self.classifier = (w["classifier.weight"], w["classifier.bias"])

    def weight_bytes(self) -> int:
        tensors = [self.word, self.pos, self.type, *self.emb_ln] + [t for layer in self.layers for t in layer]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """input_ids, positions, token_type_ids: [T] (the sequences one after another, seq_lens
        long); returns the last layer's hidden states [T, H]."""
        cfg = self.config
        eps = cfg.layer_norm_eps
        h = (F.embedding(input_ids, self.word) + F.embedding(positions, self.pos)
             + F.embedding(token_type_ids, self.type))
        h = F.layer_norm(h, (cfg.hidden_size,), *self.emb_ln, eps)
        nh, hd, hs = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        # Runs of equal-length sequences attend as one [n, heads, L, L] batch: a view of the flat rows,
        # no padding, no mask, no copies. The runner sorts a step's sequences by length, so a step has
        # one run per distinct length.
        runs: list[tuple[int, int, int]] = []  # (first row, sequences, length)
        row = 0
        for length, group in itertools.groupby(seq_lens):
            n = sum(1 for _ in group)
            runs.append((row, n, length))
            row += n * length
        for qkv_w, qkv_b, o_w, o_b, ln1_w, ln1_b, i_w, i_b, d_w, d_b, ln2_w, ln2_b in self.layers:
            qkv = F.linear(h, qkv_w, qkv_b)  # [T, 3H]
            parts = []
            for first, n, length in runs:
                q, k, v = qkv[first : first + n * length].view(n, length, 3, nh, hd).permute(2, 0, 3, 1, 4)
                parts.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n * length, hs))
            ctx = parts[0] if len(parts) == 1 else torch.cat(parts)
            h = F.layer_norm(F.linear(ctx, o_w, o_b) + h, (hs,), ln1_w, ln1_b, eps)
            inter = self.act(F.linear(h, i_w, i_b))
            h = F.layer_norm(F.linear(inter, d_w, d_b) + h, (hs,), ln2_w, ln2_b, eps)
        return h

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """The classification head over the [CLS] / <s> rows: dense + tanh (BERT's pooler or RoBERTa's
        classifier.dense), then the classifier (RoBERTa's out_proj)."""
        assert self.classifier is not None
        x = cls_hidden
        if self.pooler is not None:
            x = torch.tanh(F.linear(x, *self.pooler))
        return F.linear(x, *self.classifier)
