"""vLLM's helper for processors that keep a dict from row to per-request state (its builtin.py's
`process_dict_updates`, which its examples and tests import from here).

vLLM's built-in processors (min_tokens, logit_bias, min_p) are not classes in tokenloom: its sampler applies
them per row (tokenloom/model/sampler.py), at the places vLLM's processors run, and custom processors run
after them as after vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tokenloom.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
from tokenloom.sampling_params import SamplingParams

T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Bring `req_entries` (row -> state) up to date with `batch_update`: an added request gets
    `new_state(params, prompt_token_ids, output_token_ids)` (None: no entry), a removed one loses its entry,
    moved entries follow their request. Returns whether any entry changed."""
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
        if (state := new_state(params, prompt_tok_ids, output_tok_ids)) is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:  # the row's previous request had one
            updated = True
    if req_entries:
        for index in batch_update.removed:
            if req_entries.pop(index, None) is not None:
                updated = True
        for a_index, b_index, direction in batch_update.moved:
            a_entry = req_entries.pop(a_index, None)
            b_entry = req_entries.pop(b_index, None)
            if a_entry is not None:
                req_entries[b_index] = a_entry
                updated = True
            if b_entry is not None:
                updated = True
                if direction == MoveDirectionality.SWAP:
                    req_entries[a_index] = b_entry
    return updated
