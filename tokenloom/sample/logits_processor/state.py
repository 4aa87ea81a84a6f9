"""The batch's changes gathered over one step, and the processors an engine runs (vLLM's
vllm/v1/sample/logits_processor/state.py, same names and rules)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING

from tokenloom.sample.logits_processor.interface import AddedRequest, BatchUpdate, MovedRequest, RemovedRequest

if TYPE_CHECKING:
    from tokenloom.sample.logits_processor.interface import LogitsProcessor


class BatchUpdateBuilder:
    """Collects one step's removals, additions and moves, then hands them over as a BatchUpdate.

    Removals are all registered first (`removed_append`), before the rows they free are read: from the first
    read on, `removed` is sorted in descending order, so `pop_removed` / `peek_removed` give the lowest free
    row, which the next added request takes (and condensing fills from the end)."""

    def __init__(self, removed: list[RemovedRequest] | None = None, added: list[AddedRequest] | None = None,
                 moved: list[MovedRequest] | None = None) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        self._is_removed_sorted = False
        # Whether anything changed, additions without details included (vLLM's pooling models add none).
        self.batch_changed = False

    def _ensure_removed_sorted(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """The removed rows, highest first."""
        self._ensure_removed_sorted()
        return self._removed

    def removed_append(self, index: int) -> None:
        """Register a removed row; only before the removals are first read in a step."""
        if self._is_removed_sorted:
            raise RuntimeError("Cannot register new removed request after self.removed has been read.")
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest removed row, or None."""
        if self._removed:
            self._ensure_removed_sorted()
            return self._removed[-1]
        return None

    def pop_removed(self) -> int | None:
        """Take the lowest removed row (a request added this step fills it), or None."""
        if self._removed:
            self._ensure_removed_sorted()
            return self._removed.pop()
        return None

    def reset(self) -> bool:
        """Forget the step's changes; whether there were any."""
        self._is_removed_sorted = False
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        changed, self.batch_changed = self.batch_changed, False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The step's changes as a BatchUpdate (None when nothing changed), and a fresh start for the next."""
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.moved or self.added):
            return None
        update = BatchUpdate(batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved)
        self._removed, self.added, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The processors an engine built, split by whether they can change a greedy request's token."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            (self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant).append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        """Every processor, the argmax-invariant ones first."""
        return chain(self.argmax_invariant, self.non_argmax_invariant)
