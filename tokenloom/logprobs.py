"""Logprobs as the engine hands them back: vLLM's `vllm.logprobs` names (Logprob, FlatLogprobs).

A request's logprobs are a list with one {token_id: Logprob} dict per position (the sampled token and the
top-n), or, with `SamplingParams(flat_logprobs=True)`, a FlatLogprobs: the same positions read the same way
(index, iterate, slice, len) but held in a few flat lists, so a long request makes a constant number of
objects for the garbage collector instead of one dict and n Logprobs per position (vLLM's reason for it).
No torch here: the output side of the engine and the server read these.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import overload


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # the token's rank in the vocabulary (1: the likeliest); None when not known
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence[LogprobsOnePosition | None]):
    """vLLM's FlatLogprobs: every position's entries in flat lists, position i being
    [start_indices[i], end_indices[i]). Reads as list[dict[int, Logprob] | None] does; a position appended as
    None (the prompt's first) reads back as {}, as in vLLM. Positions are only appended, never changed."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, logprobs_one_position: LogprobsOnePosition | None) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (logprobs_one_position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_fast(self, token_ids: Iterable[int], logprobs: Iterable[float], ranks: Iterable[int | None],
                    decoded_tokens: Iterable[str | None]) -> None:
        """vLLM's: the next position from parallel sequences, without building its dict."""
        self.start_indices.append(len(self.logprobs))
        for token_id, logprob, rank, decoded_token in zip(token_ids, logprobs, ranks, decoded_tokens):
            self.token_ids.append(token_id)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
            self.decoded_tokens.append(decoded_token)
        self.end_indices.append(len(self.logprobs))

    def extend(self, logprobs_multi_positions: Iterable[LogprobsOnePosition | None]) -> None:
        for one in logprobs_multi_positions:
            self.append(one)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> LogprobsOnePosition | FlatLogprobs:
        if isinstance(index, int):
            return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                    for i in range(self.start_indices[index], self.end_indices[index])}
        if isinstance(index, slice):
            starts, ends = self.start_indices[index], self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            lo, hi = starts[0], ends[-1]  # a slice with a step other than 1 is not contiguous
            if (index.step or 1) != 1:
                out = FlatLogprobs()
                out.extend(self[i] for i in range(*index.indices(len(self))))
                return out
            return FlatLogprobs([s - lo for s in starts], [e - lo for e in ends], self.token_ids[lo:hi],
                                self.logprobs[lo:hi], self.ranks[lo:hi], self.decoded_tokens[lo:hi])
        raise TypeError(f"Invalid index type: {type(index)}")

    def __setitem__(self, index: object, value: object) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: object) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: LogprobsOnePosition | None) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self.start_indices)):
            yield self[i]


# One entry per prompt position (the first None) / per generated token, in either container.
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]


def create_prompt_logprobs(flat_logprobs: bool) -> PromptLogprobs:
    """vLLM's: an empty container for a request's prompt logprobs, holding the first position's None (the first
    prompt token has no logprob)."""
    logprobs: PromptLogprobs = FlatLogprobs() if flat_logprobs else []
    logprobs.append(None)
    return logprobs


def create_sample_logprobs(flat_logprobs: bool) -> SampleLogprobs:
    """vLLM's: an empty container for a request's sample logprobs."""
    return FlatLogprobs() if flat_logprobs else []


def append_logprobs_for_next_position(request_logprobs: PromptLogprobs | SampleLogprobs, token_ids: list[int],
                                      logprobs: list[float], decoded_tokens: Iterable[str | None], rank: int,
                                      num_logprobs: int) -> None:  # fmt: skip
    """vLLM's: one position's entries, the sampled (or prompt) token first with its own `rank`, then the top
    `num_logprobs` (-1: all given) ranked 1, 2, ... (in a dict, a sampled token that is also in the top-n is one
    entry, with the top-n's rank, the second insertion's)."""
    if num_logprobs == -1:
        num_logprobs = len(logprobs)
    ranks = itertools.chain((rank,), range(1, num_logprobs + 1))
    if isinstance(request_logprobs, FlatLogprobs):
        request_logprobs.append_fast(token_ids, logprobs, ranks, decoded_tokens)
    else:
        request_logprobs.append({token_id: Logprob(logprob, rank, token)
                                 for token_id, logprob, rank, token in zip(token_ids, logprobs, ranks, decoded_tokens)})


def as_container(positions: list[LogprobsOnePosition | None] | None, flat: bool) -> PromptLogprobs | None:
    """The positions as the request asked for them: the list itself, or (flat_logprobs) a FlatLogprobs."""
    if positions is None or not flat:
        return positions
    out = FlatLogprobs()
    out.extend(positions)
    return out
