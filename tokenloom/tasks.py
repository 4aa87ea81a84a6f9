"""What a model can be asked to do (vLLM 0.32's vllm/tasks.py, same names).

    PoolingTask   embed, classify, token_embed, token_classify (plugin: vLLM's IO-processor plugins, which
                  tokenloom has none of; kept so that a request naming it gets vLLM's answer)
    ScoreType     how /score and LLM.score read a model's pooling task: embed -> bi-encoder (the cosine of two
                  embeddings), classify -> cross-encoder (the pair in one pass), token_embed -> late-interaction

vLLM 0.32 removed the tasks `score` (a cross-encoder's score is its `classify` task) and `encode` (one of
the token_* tasks): naming either is refused with vLLM's sentence, wherever a task is given.

Pure Python, imports only the error type: the configs, PoolingParams and the server read it.
"""

from __future__ import annotations

from typing import Literal, get_args

from tokenloom.exceptions import VLLMValidationError

PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)

ScoreType = Literal["bi-encoder", "cross-encoder", "late-interaction"]
SCORE_TYPE_MAP: dict[str, str] = {"embed": "bi-encoder", "classify": "cross-encoder", "token_embed": "late-interaction"}

_REMOVED_POOLING_TASK_MESSAGES = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}

# The pooling task a model runs when its PoolerConfig names none: the first of these it supports (vLLM's
# ModelConfig.get_pooling_task).
_POOLING_TASK_PRIORITY = ("embed", "classify", "token_embed", "token_classify", "plugin")

NORMALIZE_REMOVED = "Parameter `normalize` was removed; use `use_activation` instead."


def check_removed_pooling_task(task: object) -> None:
    """vLLM's refusal of the tasks 0.32 removed (a VLLMValidationError naming `task`)."""
    if isinstance(task, str) and (message := _REMOVED_POOLING_TASK_MESSAGES.get(task)):
        raise VLLMValidationError(message, parameter="task")


def pick_pooling_task(configured: str | None, supported: tuple[str, ...]) -> str | None:
    """The one pooling task a model serves through LLM.encode and the endpoints: the PoolerConfig's `task`,
    else the first supported task in vLLM's order. A configured task the model cannot run is refused."""
    if configured is not None:
        if configured not in supported:
            raise ValueError(f"Unsupported task: {configured!r} Supported tasks: {supported}")
        return configured
    return next((task for task in _POOLING_TASK_PRIORITY if task in supported), None)
