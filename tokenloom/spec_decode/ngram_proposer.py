"""The n-gram ("prompt lookup") proposer, decision for decision vLLM 0.32's
(vllm/v1/spec_decode/ngram_proposer.py).

For one request with context = prompt + accepted outputs (never unverified drafts):

1. take the largest n in [min_n, max_n] such that the last n tokens occur earlier in the context
   (the suffix itself does not count; an occurrence may overlap it);
2. among occurrences of that length take the earliest;
3. propose the (up to) k tokens that follow it, k capped at max_model_len - len(context);
4. propose nothing when the context is shorter than min_n or nothing matches.

vLLM finds the match with KMP over the reversed context (`_find_longest_matched_ngram`, a port below
that reads the context back to front in place instead of reversing a copy: one implementation for a
single sequence and for the batch); it is compiled with numba when numba is installed (as vLLM does),
else the batch runs a vectorised numpy equivalent (`propose_numpy_one`, an independent algorithm with
the same answers; the tests hold the two equal).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.int32)


def _find_longest_matched_ngram(tokens: np.ndarray, total: int, min_n: int, max_n: int, max_model_len: int,
                                k: int, lps: np.ndarray) -> tuple[int, int]:
    """(start, count) of the proposal for the context `tokens[:total]`; count 0 = no proposal.

    vLLM's KMP (`_find_longest_matched_ngram`), run over the reversed context: vLLM reverses a copy;
    this reads `tokens[total - 1 - i]` in place, so the batch below can pass rows of its token buffer
    as they are. `lps` is scratch of at least max_n int32s (one buffer serves a whole batch). The one
    implementation for a single sequence and for the batch (compiled with numba there)."""
    if total < min_n:
        return 0, 0
    k = min(k, max_model_len - total)
    if k <= 0:
        return 0, 0
    last = total - 1  # reversed index i reads tokens[last - i]
    # lps[i] = longest proper prefix of reversed[:i+1] that is also its suffix, kept for i < max_n.
    for j in range(max_n):
        lps[j] = 0
    longest = 0
    position = 0
    prev_lps = 0
    i = 1
    while i < total:
        if tokens[last - prev_lps] == tokens[last - i]:
            prev_lps += 1
            # >=: a later i in the reversed tokens is an earlier occurrence in the context.
            if prev_lps >= longest:
                longest = prev_lps
                position = i
            if i < max_n:
                lps[i] = prev_lps
            if prev_lps == max_n:
                prev_lps = lps[max_n - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest < min_n:
        return 0, 0
    start = total - 1 - position + longest
    return start, min(k, total - start)


def propose_one_reference(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> list[int]:
    """One request, pure Python (the tests' reference)."""
    tokens = np.asarray(tokens)
    start, count = _find_longest_matched_ngram(tokens, tokens.shape[0], min_n, max_n, max_model_len, k,
                                               np.zeros(max_n, dtype=np.int32))
    return [int(t) for t in tokens[start : start + count]]


def propose_numpy_one(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> tuple[int, int]:
    """The KMP's answer, vectorised: every earlier position holding the last token is a candidate
    end of an occurrence; extend all candidates backwards together (up to max_n) and take the
    longest match, at its earliest position."""
    total = tokens.shape[0]
    if total < min_n:
        return 0, 0
    k = min(k, max_model_len - total)
    if k <= 0:
        return 0, 0
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # occurrences end before the last token
    if ends.size == 0:
        return 0, 0
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, max_n):
        idx = ends - j
        alive &= idx >= 0
        alive[alive] = tokens[idx[alive]] == tokens[total - 1 - j]
        if not alive.any():
            break
        length += alive
    longest = int(length.max())
    if longest < min_n:
        return 0, 0
    start = int(ends[np.argmax(length == longest)]) + 1
    return start, min(k, total - start)


def _batch_loop(buf, rows, lengths, min_n, max_n, max_model_len, k, out_start, out_count):  # pragma: no cover
    """The KMP over every row of a [num_rows, max_model_len] token buffer, in place (no reversed
    copy, one lps buffer for the batch). Runs compiled only (it calls the compiled matcher)."""
    lps = np.zeros(max_n, dtype=np.int32)
    for r in range(rows.shape[0]):
        out_start[r], out_count[r] = _match_compiled(buf[rows[r]], lengths[r], min_n, max_n, max_model_len, k, lps)


try:  # vLLM compiles the proposer with numba; so do we when it is installed.
    from numba import njit

    _match_compiled = njit(cache=True, nogil=True)(_find_longest_matched_ngram)
    _batch_compiled = njit(cache=True, nogil=True)(_batch_loop)
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False


class NgramProposer:
    """Batch proposer over a token buffer it keeps per request, as vLLM's runner keeps
    `token_ids_cpu` (one row per request, prompt + accepted outputs, no drafts).

    The runner calls `add_request` (a new or resumed request: its whole sequence), `append_tokens`
    (tokens it sampled), `remove_request`, and after sampling `propose(req_ids)` for the requests
    that sampled this step (vLLM skips the rest: partial prefills; and requests at max_model_len).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int, use_numba: bool | None = None, initial_rows: int = 16) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len
        if use_numba and not HAVE_NUMBA:
            logger.warning("numba is not installed; the n-gram proposer runs its numpy version")
        self.use_numba = HAVE_NUMBA if use_numba is None else (use_numba and HAVE_NUMBA)
        self.buf = np.zeros((initial_rows, max_model_len), dtype=np.int32)
        self.lengths = np.zeros(initial_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(initial_rows - 1, -1, -1))
        if self.use_numba:  # compile now (vLLM does too), not inside the first step
            self.add_request("_warmup", [1, 2, 3, 1, 2])
            self.propose(["_warmup"])
            self.remove_request("_warmup")

    @classmethod
    def from_config(cls, spec_config, max_model_len: int) -> NgramProposer:
        return cls(spec_config.num_speculative_tokens, spec_config.prompt_lookup_min,
                   spec_config.prompt_lookup_max, max_model_len)

    # The per-request token rows ------------------------------------------------------------
    def add_request(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int | None = None) -> None:
        """A new or resumed request's whole sequence (the prompt length is not needed here)."""
        row = self.row_of.get(req_id)
        if row is None:
            if not self.free_rows:
                self._grow()
            row = self.row_of[req_id] = self.free_rows.pop()
        n = min(len(token_ids), self.max_model_len)
        self.buf[row, :n] = np.asarray(token_ids[:n], dtype=np.int32)
        self.lengths[row] = n

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        row = self.row_of.get(req_id)
        if row is None:
            return
        n = int(self.lengths[row])
        m = min(len(token_ids), self.max_model_len - n)
        if m > 0:
            self.buf[row, n : n + m] = token_ids[:m]
            self.lengths[row] = n + m

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.lengths[row] = 0
            self.free_rows.append(row)

    def reset(self) -> None:
        for req_id in list(self.row_of):
            self.remove_request(req_id)

    def _grow(self) -> None:
        old = self.buf.shape[0]
        self.buf = np.concatenate([self.buf, np.zeros_like(self.buf)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    # Proposing -------------------------------------------------------------------------------
    def propose(self, req_ids: Sequence[str], k: int | None = None,
                batch_req_ids: Sequence[str] | None = None) -> list[list[int]]:
        """Drafts for each request (empty: none); `k` lowers the draft count for this call.
        `batch_req_ids` (the step's scheduled requests) matters to the suffix proposer only."""
        k = self.k if k is None else min(k, self.k)
        rows = np.fromiter((self.row_of.get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))
        known = rows >= 0
        lengths = np.where(known, self.lengths[np.where(known, rows, 0)], 0)
        lengths[lengths >= self.max_model_len] = 0  # vLLM: nothing for a request at max_model_len
        rows = np.where(known, rows, 0)
        starts = np.zeros(len(req_ids), dtype=np.int64)
        counts = np.zeros(len(req_ids), dtype=np.int64)
        if self.use_numba:
            _batch_compiled(self.buf, rows, lengths, self.min_n, self.max_n, self.max_model_len, k, starts, counts)
        else:
            for i, (row, n) in enumerate(zip(rows.tolist(), lengths.tolist())):
                if n:
                    starts[i], counts[i] = propose_numpy_one(self.buf[row, :n], self.min_n, self.max_n,
                                                             self.max_model_len, k)
        return [self.buf[row, s : s + c].tolist() if c else []
                for row, s, c in zip(rows.tolist(), starts.tolist(), counts.tolist())]
