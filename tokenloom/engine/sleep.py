"""LLM.sleep() / wake_up(): vLLM 0.32's behaviour where there is no sleep mode (its CPU platform, and every
platform tokenloom runs on; `enable_sleep_mode=True` is refused in vLLM's words).

vLLM's EngineCore.sleep(level, mode) pauses the scheduler first, then (level >= 1) asks the executor to free the
weights and KV cache; its CPU worker logs "sleep mode is not supported on CPU, ignore it." and frees nothing, but
the executor still counts the "weights" and "kv_cache" tags as sleeping until wake_up. So on CPU:

    level 0      pause scheduling only (wake_up(tags=["scheduling"]) or wake_up() resumes)
    level >= 1   the same, and the prefix cache is dropped (running requests recompute), and the executor's
                 tags sleep: the engine is fully awake again once wake_up() (or wake_up with both tags) runs
    mode         abort: every unfinished request ends now ("abort"); wait: the running requests finish first
                 (their outputs come from the following step() calls); keep: they stay, paused, and go on
                 after wake_up. Requests added while paused wait, unscheduled, until then.

This module keeps the state (vLLM's PauseState and its executor's sleeping tags); LLMEngine applies it.
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
# vLLM's executor tags for what a level >= 1 sleep frees (vllm/v1/executor/abstract.py SLEEP_TAGS).
SLEEP_TAGS = ("weights", "kv_cache")


class SleepState:
    """Whether the engine is paused (no steps; adds held) and which executor tags sleep."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.paused = False
        self.sleeping_tags: set[str] = set()

    @staticmethod
    def check(level: int, mode: str) -> None:
        """vLLM's checks of sleep()'s arguments (its pause_scheduler's message for the mode)."""
        if mode not in get_args(PauseMode):
            raise ValueError(f"Invalid pause mode: {mode}")
        if isinstance(level, bool) or not isinstance(level, int) or level < 0:
            raise ValueError(f"sleep level must be an integer >= 0 (0: pause, 1 / 2: free memory), got {level!r}")

    def fall_asleep(self, level: int) -> None:
        """The pause, and for level >= 1 the executor's sleep (nothing freed: no sleep mode here)."""
        self.paused = True
        if level < 1:
            return
        if "weights" in self.sleeping_tags:
            logger.warning("Executor is already sleeping.")
            return
        logger.warning("sleep mode is not supported on %s, ignore it.", "CPU" if self.device == "cpu" else self.device)
        self.sleeping_tags |= set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None) -> bool:
        """vLLM's EngineCore.wake_up + its executor's: "scheduling" resumes the scheduler, the executor's tags wake
        (all with None); scheduling resumes once no tag sleeps. Returns whether the engine is fully awake."""
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self._wake_executor(tags)
        fully_awake = not self.sleeping_tags
        if fully_awake:
            self.paused = False
        return fully_awake

    def _wake_executor(self, tags: list[str] | None) -> None:
        if not self.sleeping_tags:
            logger.warning("Executor is not sleeping.")
            return
        if tags:
            for tag in tags:
                if tag not in self.sleeping_tags:
                    logger.warning("Tag %s is not in sleeping tags %s", tag, self.sleeping_tags)
                    return
            if self.device == "cpu":
                logger.warning("sleep mode is not supported on CPU, ignore it.")
            self.sleeping_tags -= set(tags)
        else:
            if self.device == "cpu":
                logger.warning("sleep mode is not supported on CPU, ignore it.")
            self.sleeping_tags.clear()

    @property
    def is_sleeping(self) -> bool:
        """vLLM's EngineCore.is_sleeping(): paused at any level, or executor tags asleep."""
        return self.paused or bool(self.sleeping_tags)
