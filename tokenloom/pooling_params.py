"""PoolingParams: what a pooling request asks for (vLLM's vllm/pooling_params.py, same field names).

A pooling request computes its prompt once and returns a vector (or one per token) instead of
tokens: embeddings, classification probabilities, cross-encoder scores. Tasks (vLLM's PoolingTask):

    embed           one vector per prompt (the model's pooling: LAST, MEAN, CLS), L2-normalised by default
    classify        the classification head's logits, softmax by default (sigmoid with one label)
    score           a cross-encoder's score of a text pair (classify with use_activation, one number)
    token_embed     one vector per prompt token (ALL pooling), normalised by default
    token_classify  the classification head over every token (ALL pooling)

Pure Python (no torch): the scheduler and the server validate it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.exceptions import ValidationError
from tokenloom.sampling_params import RequestOutputKind

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
# The parameters each task reads (vLLM's valid_parameters); others set by the user are a 400. For the embedding
# tasks use_activation is vLLM 0.32's name for the L2 normalisation, normalize its earlier one (still taken).
_VALID = {
    "embed": ("dimensions", "normalize", "use_activation"),
    "token_embed": ("dimensions", "normalize", "use_activation"),
    "classify": ("use_activation",),
    "score": ("use_activation",),
    "token_classify": ("use_activation",),
}


@dataclass
class PoolingParams:
    # Keep only the last k prompt tokens (-1: the last max_model_len); None: no truncation, and a
    # prompt longer than max_model_len is an error.
    truncate_prompt_tokens: int | None = None
    # Matryoshka embeddings: keep the first `dimensions` components (then normalise).
    dimensions: int | None = None
    # embed / token_embed: L2-normalise the pooled vector (None: the model's default, True). vLLM before 0.32.
    normalize: bool | None = None
    # classify / score: softmax (sigmoid for one label) over the logits (None: the default, True); embed /
    # token_embed: vLLM 0.32's name for normalize (the two agree once verified).
    use_activation: bool | None = None
    # STEP pooling (process reward models): the token marking a step, and the label ids to keep.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    # Filled by the engine from the request (LLM.embed -> "embed", /classify -> "classify", ...).
    task: str | None = None
    extra_kwargs: dict[str, Any] | None = field(default=None, repr=False)
    # vLLM's: a pooling request has one output, its last (checked when the params are made, in vLLM's words).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.output_kind is not RequestOutputKind.FINAL_ONLY:
            raise ValidationError(f"For pooling output_kind has to be FINAL_ONLY, got {self.output_kind!r}",
                                  parameter="output_kind")

    def clone(self) -> PoolingParams:
        return PoolingParams(**{k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()})

    def _check_types(self) -> None:
        """Each field's type, before any comparison (which would raise a TypeError naming no field)."""
        for name, kind in (("truncate_prompt_tokens", int), ("dimensions", int), ("normalize", bool),
                           ("use_activation", bool), ("task", str)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise ValidationError(f"{name} must be {'an' if kind is int else 'a'} {kind.__name__} or None, "
                                      f"got {value!r}"[:200])

    def _resolve_normalize(self, default: bool) -> None:
        """An embedding's L2 normalisation: use_activation (vLLM 0.32's name) or normalize (its earlier one), the
        model's default when neither is given; afterwards both say the same."""
        if self.use_activation is not None and self.normalize is not None and self.use_activation != self.normalize:
            raise ValidationError(f"use_activation={self.use_activation} and normalize={self.normalize} disagree: "
                                  "for embeddings they are the same switch (use_activation is vLLM 0.32's name)")
        chosen = next((v for v in (self.use_activation, self.normalize) if v is not None), default)
        self.normalize = self.use_activation = chosen

    def verify(self, task: str, model_dim: int | None = None, is_matryoshka: bool = False,
               default_normalize: bool = True) -> None:
        """Fill the task and the defaults (`default_normalize`: the model's pooler config, e.g. a
        sentence-transformers checkpoint without a Normalize module says False); raise ValueError for
        a parameter the task does not read."""
        if task not in POOLING_TASKS:
            raise ValidationError(f"unknown pooling task {task!r}; one of {', '.join(POOLING_TASKS)}")
        self._check_types()
        if self.task is not None and self.task != task:
            raise ValidationError(f"the PoolingParams' task is {self.task!r}, the request's {task!r}")
        self.task = task
        for name in ("dimensions", "normalize", "use_activation"):
            if getattr(self, name) is not None and name not in _VALID[task]:
                raise ValidationError(f"Task {task} only supports {list(_VALID[task])} parameters, does not support "
                                      f"{name!r} parameter")
        if self.dimensions is not None:
            if not is_matryoshka:
                raise ValidationError("Model does not support matryoshka representation, "
                                      "changing output dimensions will lead to poor results.")
            if self.dimensions < 1:
                raise ValidationError("Dimensions must be greater than 0")
            if model_dim is not None and self.dimensions > model_dim:
                raise ValidationError(f"dimensions={self.dimensions} is larger than the model's {model_dim}")
        if task in ("embed", "token_embed"):
            self._resolve_normalize(default_normalize)
        if task in ("classify", "score", "token_classify") and self.use_activation is None:
            self.use_activation = True
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValidationError("truncate_prompt_tokens must be -1, a positive int, or None")
