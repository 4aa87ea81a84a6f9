"""The runner's persistent batch as custom logits processors see it (vLLM's InputBatch, the part that keeps
each request's row and reports how the rows changed: v1/worker/gpu_input_batch.py).

Every scheduled request holds a row from the step it is first scheduled (its prompt's first chunk) until a step
leaves it out: it finished, was preempted, or was not scheduled (vLLM's "unscheduled" requests). Per step, as
vLLM's runner does (`_update_states`):

    removed  finished requests, then every request in the batch that this step does not run
    added    the step's new requests, then its running ones that are not in the batch, each in the lowest
             free row (else at the end), with its params, prompt token ids and its live output-token list
    moved    `condense`: the last rows slide down into the holes left (UNIDIRECTIONAL moves)

then each processor's `update_state` gets the BatchUpdate (None when nothing changed). tokenloom's attention
backends reorder the flattened batch on their own, so no swap is ever reported; the sampler maps its rows to
these rows (`sampling_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tokenloom.model.sampler import BatchProcessors
from tokenloom.sample.logits_processor import BatchUpdateBuilder, LogitsProcessors, MoveDirectionality
from tokenloom.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, logitsprocs: LogitsProcessors | None = None) -> None:
        self.logitsprocs = logitsprocs or LogitsProcessors()
        self.batch_update_builder = BatchUpdateBuilder()
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        # Each row's output-token list: a request whose runner state was replaced (preempted and resumed within
        # the batch's view) has a new list, and is removed and added again.
        self._outputs: list[list[int] | None] = []

    @property
    def enabled(self) -> bool:
        """Whether any processor runs (without one the runner keeps no rows)."""
        return bool(self.logitsprocs.argmax_invariant or self.logitsprocs.non_argmax_invariant)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str | None]:
        return list(self._req_ids)

    def output_list(self, req_id: str) -> list[int] | None:
        index = self.req_id_to_index.get(req_id)
        return None if index is None else self._outputs[index]

    # ------------------------------------------------------------------ vLLM's operations

    def remove_request(self, req_id: str) -> int | None:
        """Empty the request's row (filled by `add_request` or `condense` in the same step)."""
        index = self.req_id_to_index.pop(req_id, None)
        if index is None:
            return None
        self.batch_update_builder.removed_append(index)
        self._req_ids[index] = None
        self._outputs[index] = None
        return index

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int] | None,
                    output_token_ids: list[int]) -> int:  # fmt: skip
        """Put the request in the lowest free row, else at the end; returns its row."""
        index = self.batch_update_builder.pop_removed()
        if index is None:
            index = self.num_reqs
        self.batch_update_builder.batch_changed = True
        self.batch_update_builder.added.append((index, params, prompt_token_ids, output_token_ids))
        if index == len(self._req_ids):
            self._req_ids.append(req_id)
            self._outputs.append(output_token_ids)
        else:
            self._req_ids[index] = req_id
            self._outputs[index] = output_token_ids
        self.req_id_to_index[req_id] = index
        return index

    def condense(self) -> None:
        """Move the last requests down into the rows removals left empty, lowest hole first."""
        num_reqs = self.num_reqs
        empty = self.batch_update_builder.removed  # sorted, highest first
        if not empty:
            return
        if num_reqs == 0:
            self._req_ids.clear()
            self._outputs.clear()
            return
        last = num_reqs + len(empty) - 1
        while empty:
            while last in empty:
                last -= 1
            hole = self.batch_update_builder.peek_removed()
            assert hole is not None
            if hole >= last:
                break
            self.batch_update_builder.pop_removed()
            req_id = self._req_ids[last]
            assert req_id is not None
            self._req_ids[hole], self._req_ids[last] = req_id, None
            self._outputs[hole], self._outputs[last] = self._outputs[last], None
            self.req_id_to_index[req_id] = hole
            self.batch_update_builder.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        del self._req_ids[num_reqs:]
        del self._outputs[num_reqs:]

    def refresh_metadata(self) -> None:
        """Hand the step's changes to every processor (None when there were none), as vLLM does each step."""
        batch_update = self.batch_update_builder.get_and_reset(self.num_reqs)
        for proc in self.logitsprocs.all:
            proc.update_state(batch_update)

    def remove_all(self) -> None:
        """Every request leaves (a fresh scheduler takes over): the processors hear it with the next step."""
        for req_id in list(self.req_id_to_index):
            self.remove_request(req_id)
        self.condense()

    # ------------------------------------------------------------------ one step

    def update(self, finished: Iterable[str], running: Iterable[Any], order: Iterable[str]) -> None:
        """One step's changes. `finished`: the scheduler's finished ids; `running`: the runner's state of every
        request the step runs (its req_id, params, token_ids, num_prompt_tokens and output_token_ids); `order`:
        their ids as vLLM adds them (the step's new requests first, then its running ones)."""
        for req_id in finished:
            self.remove_request(req_id)
        states = {state.req_id: state for state in running}
        for req_id in [r for r, i in self.req_id_to_index.items()
                       if r not in states or self._outputs[i] is not states[r].output_token_ids]:  # fmt: skip
            self.remove_request(req_id)
        for req_id in dict.fromkeys(order):
            state = states.get(req_id)
            if state is not None and req_id not in self.req_id_to_index:
                self.add_request(req_id, state.params, state.token_ids[: state.num_prompt_tokens],
                                 state.output_token_ids)
        self.condense()
        self.refresh_metadata()

    def sampling_rows(self, req_ids: list[str], device: torch.device) -> BatchProcessors:
        """The step's processors and, for each row the sampler samples (in its order), the batch row it is."""
        index = [self.req_id_to_index[r] for r in req_ids]
        identity = index == list(range(self.num_reqs))
        return BatchProcessors(
            argmax_invariant=list(self.logitsprocs.argmax_invariant),
            non_argmax_invariant=list(self.logitsprocs.non_argmax_invariant),
            batch_size=self.num_reqs,
            rows=None if identity else torch.tensor(index, dtype=torch.long, device=device),
        )
