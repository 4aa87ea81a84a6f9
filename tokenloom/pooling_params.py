"""PoolingParams: what a pooling request asks for (vLLM 0.32's vllm/pooling_params.py, same fields and rules).

A pooling request computes its prompt once and returns a vector (or one per token) instead of
tokens: embeddings, classification probabilities, cross-encoder scores. Tasks (vLLM's PoolingTask,
tokenloom/tasks.py):

    embed           one vector per prompt (the model's pooling: LAST, MEAN, CLS), L2-normalised by default
    classify        the classification head's logits, softmax by default (sigmoid with one label); a
                    cross-encoder's score of a text pair is its classify output
    token_embed     one vector per prompt token (ALL pooling, or STEP), normalised by default
    token_classify  the classification head over every token

`use_activation` is the one switch of both: the embedding's L2 normalisation, the classifier's softmax. vLLM
0.32 removed `normalize` (and the tasks `score` and `encode`); giving them is refused with vLLM's sentence.
`truncate_prompt_tokens` is tokenloom's, kept as on SamplingParams (vLLM 0.32 moved it to the tokenization
arguments: LLM.encode's `tokenization_kwargs`, a request body's field): k keeps the last k prompt tokens.

`verify(model_config)` is vLLM's: it takes the model's defaults from `model_config.pooler_config` and checks
the parameters against the task and the model (`served_model_name`, `embedding_size`, `is_matryoshka`,
`matryoshka_dimensions`); tokenloom's engines pass their PoolingInfo (tokenloom/engine/pooling.py).

Pure Python (no torch): the scheduler and the server validate it.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import InitVar, dataclass, field
from typing import Any

from tokenloom.exceptions import VLLMValidationError
from tokenloom.sampling_params import RequestOutputKind
from tokenloom.tasks import NORMALIZE_REMOVED, check_removed_pooling_task

_UNSET: Any = object()
STEP_POOLING_PARAMETERS = ("step_tag_id", "returned_token_ids")


@dataclass
class PoolingParams:
    # embed / token_embed: L2-normalise; classify / token_classify: softmax (sigmoid for one label).
    # None: the model's default (its pooler config; True for most).
    use_activation: bool | None = None
    # Matryoshka embeddings: keep the first `dimensions` components (then normalise).
    dimensions: int | None = None
    # STEP pooling (process reward models): the token marking a step, and the label ids to keep.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    # Filled by the front end from the call (LLM.embed -> "embed", /classify -> "classify", ...).
    task: str | None = None
    requires_token_ids: bool = False
    # token_embed / token_classify pool every prompt row, which a prefix-cache hit has none of (vLLM's flag;
    # filled by verify).
    skip_reading_prefix_cache: bool | None = None
    extra_kwargs: dict[str, Any] | None = field(default=None, repr=False)
    # vLLM's: a pooling request has one output, its last (checked when the params are made, in vLLM's words).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # tokenloom's: keep only the last k prompt tokens (-1: the last max_model_len); None: no truncation, and a
    # prompt longer than max_model_len is an error.
    truncate_prompt_tokens: int | None = None
    # vLLM 0.32 removed it: refused by name below (use_activation is the same switch).
    normalize: InitVar[Any] = _UNSET

    def __post_init__(self, normalize: Any) -> None:
        if normalize is not _UNSET:
            raise VLLMValidationError(NORMALIZE_REMOVED, parameter="normalize")
        check_removed_pooling_task(self.task)
        if self.output_kind is not RequestOutputKind.FINAL_ONLY:
            raise VLLMValidationError(f"For pooling output_kind has to be FINAL_ONLY, got {self.output_kind!r}",
                                      parameter="output_kind")
    @property
    def all_parameters(self) -> list[str]:
        return ["dimensions", "use_activation"]

    @property
    def valid_parameters(self) -> dict[str, list[str]]:
        return {
            "embed": ["dimensions", "use_activation"],
            "classify": ["use_activation"],
            "token_embed": ["dimensions", "use_activation"],
            "token_classify": ["use_activation"],
        }

    def clone(self) -> PoolingParams:
        """A deep copy (vLLM's): the front ends fill a copy, never the caller's."""
        return deepcopy(self)

    def verify(self, model_config: Any) -> None:
        """vLLM's verify: the model's defaults merged in, then every parameter checked against the task and
        the model. VLLMValidationError (a ValueError) names what is wrong."""
        self._check_types()
        if self.task == "plugin":  # vLLM's IO-processor plugins validate their own inputs
            if self.skip_reading_prefix_cache is None:
                self.skip_reading_prefix_cache = True
            return
        if self.task not in self.valid_parameters:  # vLLM leaves other tasks to their plugins
            return
        self._merge_default_parameters(model_config)
        self._set_default_parameters(model_config)
        self._verify_valid_parameters()
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise VLLMValidationError("truncate_prompt_tokens must be -1, a positive int, or None",
                                      parameter="truncate_prompt_tokens", value=self.truncate_prompt_tokens)

    def _check_types(self) -> None:
        """Each field's type, before any comparison (which would raise a TypeError naming no field)."""
        for name, kind in (("truncate_prompt_tokens", int), ("dimensions", int), ("step_tag_id", int),
                           ("use_activation", bool), ("task", str)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise VLLMValidationError(f"{name} must be {'an' if kind is int else 'a'} {kind.__name__} or None, "
                                          f"got {value!r}"[:200], parameter=name)
        ids = self.returned_token_ids
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise VLLMValidationError(f"returned_token_ids must be a list of ints or None, got {ids!r}"[:200],
                                      parameter="returned_token_ids")

    def _merge_default_parameters(self, model_config: Any) -> None:
        pooler_config = getattr(model_config, "pooler_config", None)
        if pooler_config is None:
            return
        assert self.task is not None
        valid_parameters = self.valid_parameters[self.task]
        for k in valid_parameters:
            if getattr(pooler_config, k, None) is not None and getattr(self, k, None) is None:
                setattr(self, k, getattr(pooler_config, k))
        if self.skip_reading_prefix_cache is None:
            # A prefix-cache hit has no hidden states for the cached rows, which token_* tasks pool.
            self.skip_reading_prefix_cache = self.task in ("token_embed", "token_classify")
        self._verify_step_pooling(pooler_config, valid_parameters)

    def _verify_step_pooling(self, pooler_config: Any, valid_parameters: list[str]) -> None:
        """step_tag_id / returned_token_ids belong to STEP pooling: refused otherwise, else the model's defaults."""
        if getattr(pooler_config, "tok_pooling_type", None) != "STEP":
            invalid = [k for k in STEP_POOLING_PARAMETERS if getattr(self, k, None) is not None]
            if invalid:
                raise VLLMValidationError(f"Task {self.task} only supports {valid_parameters} parameters, does not "
                                          f"support {invalid} parameters")
            return
        for k in STEP_POOLING_PARAMETERS:
            if getattr(pooler_config, k, None) is not None and getattr(self, k, None) is None:
                setattr(self, k, getattr(pooler_config, k))

    def _set_default_parameters(self, model_config: Any) -> None:
        if self.use_activation is None:
            self.use_activation = True
        if self.task in ("embed", "token_embed") and self.dimensions is not None:
            self._verify_dimensions(model_config)

    def _verify_dimensions(self, model_config: Any) -> None:
        """A matryoshka model's embeddings cut to `dimensions` (vLLM's three refusals, in its words)."""
        dimensions = self.dimensions
        model_name = getattr(model_config, "served_model_name", None)
        embedding_size = model_config.embedding_size
        if not getattr(model_config, "is_matryoshka", False):
            raise VLLMValidationError(f"Model {model_name!r} does not support Matryoshka embeddings; dimensions "
                                      f"must be unset (received dimensions={dimensions}).", parameter="dimensions")
        if not 1 <= dimensions <= embedding_size:
            raise VLLMValidationError(f"Model {model_name!r} only supports dimensions in range [1, {embedding_size}], "
                                      f"got {dimensions}.", parameter="dimensions")
        mds = getattr(model_config, "matryoshka_dimensions", None)
        if mds is not None and dimensions not in mds:
            raise VLLMValidationError(f"Model {model_name!r} only supports Matryoshka dimensions {mds}, got "
                                      f"{dimensions}.", parameter="dimensions")

    def _verify_valid_parameters(self) -> None:
        assert self.task is not None
        valid_parameters = self.valid_parameters[self.task]
        invalid = [k for k in self.all_parameters if k not in valid_parameters and getattr(self, k, None) is not None]
        if invalid:
            raise VLLMValidationError(f"Task {self.task!r} only supports {valid_parameters} parameters, does not "
                                      f"support {invalid} parameters")
