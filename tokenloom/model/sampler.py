"""Batched sampling with per-request parameters (vLLM V1 semantics).

Order of operations, per row:
  1. raw logprobs (log_softmax of the model's logits) if the request asked for logprobs;
  2. allowed_token_ids: every other token masked to -inf; then bad_words: the last token of each
     bad-word sequence masked to -inf where the row's outputs end with the rest of it; then
     min_tokens: stop tokens masked to -inf while fewer than min_tokens outputs exist; then
     logit_bias added (vLLM's order of its logits processors);
  3. penalties: repetition (prompt + output; divide positive logits, multiply negative ones),
     then frequency (x count in output) and presence (x seen in output), OpenAI style; then a spent
     thinking_token_budget's forced token (its logit 1e9, vLLM's);
  4. custom logits processors that may change the argmax (vLLM's non-argmax-invariant ones: --logits-processors,
     tokenloom/sample/logits_processor), then penalties;
  5. greedy rows take the argmax here;
  6. temperature, min-p, then the argmax-invariant custom processors (only when some row samples randomly;
     greedy rows keep their argmax), top-k, top-p, then an inverse-CDF draw with one uniform per row (from the
     row's own generator when seeded).

Custom processors see the batch as vLLM's persistent batch holds it: a row per scheduled request
(BatchProcessors maps the sampled rows there; rows of requests still in their prompt's chunks hold zeros, as
those requests sample nothing this step).

Costs are kept off the [rows, vocab] plane where possible: penalties touch only seen tokens,
top-k/top-p look at a window of the most likely tokens before falling back to a full sort, and
one uniform per row replaces vLLM's one exponential per vocabulary entry.

A seeded request reseeds its generator per output token from (seed, output index), so its tokens
depend only on its own logits: identical alone, in any batch, and after preemption + resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.core.outputs import SampleLogprobs
from tokenloom.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over 64 bits


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request that samples this step.

    `token_ids` is the whole sequence so far (prompt + outputs); slices are taken only when a
    penalty needs them, so plain rows cost nothing per token.
    """

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None  # set for seeded requests
    # thinking_token_budget spent: the token this row must sample now (tokenloom/model/thinking_budget.py)
    forced_token: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # One entry per row; None for rows that did not ask for logprobs. The list is None if no row did.
    logprobs: list[SampleLogprobs | None] | None


def make_generator(device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device)


def step_seed(seed: int, output_index: int) -> int:
    """A 63-bit seed for the draw of output token `output_index` of a request seeded with `seed`."""
    return ((seed * _SEED_MIX) ^ (output_index * 0xBF58476D1CE4E5B9) ^ output_index) & ((1 << 63) - 1)


@dataclass
class BatchProcessors:
    """One step's custom logits processors (vLLM's LogitsProcessors, split as it splits them) and where the
    sampled rows sit in the persistent batch they keep state for (tokenloom/model/input_batch.py)."""

    argmax_invariant: list[Any]
    non_argmax_invariant: list[Any]
    batch_size: int  # the persistent batch's rows: every request the step runs
    # The batch row of each sampled row; None: the sampled rows are the batch's rows, in order.
    rows: torch.Tensor | None = None

    def apply(self, processors: list[Any], logits: torch.Tensor) -> torch.Tensor:
        """`logits` (the sampled rows) through `processors`, which see the whole batch: a row per request, zeros
        where a request samples nothing this step (vLLM computes those rows and drops their token)."""
        if not processors:
            return logits
        batch = logits
        if self.rows is not None:
            batch = logits.new_zeros((self.batch_size, logits.shape[1]))
            batch[self.rows] = logits
        for proc in processors:
            batch = proc.apply(batch)
        return batch if self.rows is None else batch[self.rows]


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar: GrammarRows | None = None,
        processors: BatchProcessors | None = None,
    ) -> SamplerOutput:
        """logits [S, V] (fp32) for S rows -> one token per row (+ logprobs where asked).

        `logits` is left untouched (callers may keep it for debugging), except that the grammar
        bitmask of constrained rows is applied to it in place, first: everything after (logprobs,
        penalties, custom processors, temperature, top-k/top-p) sees only the tokens the grammar allows.
        `processors`: the engine's custom logits processors, if it runs any.
        """
        if grammar is not None:
            apply_grammar_bitmask(logits, grammar)
        custom_first = processors.non_argmax_invariant if processors is not None else []
        if all_plain_greedy(rows) and not custom_first:  # argmax-invariant processors never run for greedy rows
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=None)
        raw_logprobs = _raw_logprobs(logits, rows)
        if custom_first or any(_min_tokens_active(r) or _has_penalties(r.params) or _has_processors(r.params)
                               or r.forced_token is not None for r in rows):  # fmt: skip
            logits = logits.clone()
            apply_allowed_token_ids(logits, rows)
            apply_bad_words(logits, rows)
            apply_min_tokens(logits, rows)
            apply_logit_bias(logits, rows)
            if processors is not None:  # after vLLM's built-in min_tokens and logit_bias processors
                logits = processors.apply(custom_first, logits)
            apply_penalties(logits, rows)
            apply_forced_tokens(logits, rows)
        token_ids = _sample(logits, rows, processors)
        logprobs = _gather_logprobs(raw_logprobs, token_ids, rows) if raw_logprobs is not None else None
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)


@dataclass
class GrammarRows:
    """Structured outputs for one step: bitmask row j constrains logits row `rows[j]`."""

    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32, bit set = token allowed
    rows: list[int]


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarRows) -> None:
    """Disallowed tokens to -inf, in place, for the constrained rows only (vLLM's
    apply_grammar_bitmask): xgrammar's compiled CPU kernel, no Python loop over the vocabulary."""
    import xgrammar as xgr

    bitmask, rows = grammar.bitmask, grammar.rows
    if rows != list(range(logits.shape[0])):
        # The kernel pairs bitmask row i with logits row i: spread the rows out to their places
        # (cheap: V/32 words a row), unconstrained rows all-allowed and skipped via `indices`.
        aligned = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
        aligned[rows] = bitmask
        bitmask = aligned
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


# --------------------------------------------------------------------------- row classification


def _has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _has_processors(p: SamplingParams) -> bool:
    # bad_words count even when no word's prefix ends the outputs this step: the greedy shortcuts
    # (here, the runner's kernels argmax, speculative verification) must not skip the check.
    return bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.bad_words_token_ids)


def _min_tokens_active(row: SamplingRow) -> bool:
    return row.num_output_tokens < row.params.min_tokens and bool(row.params.all_stop_token_ids)


def all_plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Every row takes the argmax and needs nothing else (no logprobs, penalties, min_tokens, logits
    processors: allowed_token_ids, logit_bias, bad_words)."""
    return all(
        r.params.temperature < _GREEDY_EPS
        and r.params.logprobs is None
        and not _has_penalties(r.params)
        and not _has_processors(r.params)
        and not _min_tokens_active(r)
        and r.forced_token is None
        for r in rows
    )


def apply_forced_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """A row whose thinking budget is spent takes the end-of-thinking token: its logit set to 1e9 after the
    penalties (vLLM's thinking-budget forcing), so greedy and random sampling both pick it."""
    for i, row in enumerate(rows):
        if row.forced_token is not None:
            logits[i, row.forced_token] = 1e9


# --------------------------------------------------------------------------- logits processing


def apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed is not None:
            keep = torch.tensor([t for t in allowed if t < vocab], dtype=torch.long, device=logits.device)
            masked = torch.full_like(logits[i], float("-inf"))
            masked[keep] = logits[i, keep]
            logits[i] = masked


def bad_word_bans(row: SamplingRow) -> list[int]:
    """The tokens `row` may not sample next for its bad words (vLLM's _apply_bad_words_single_batch): the
    last token of every sequence whose other tokens are the row's last outputs. Only outputs count, not
    the prompt, so a word needs room for its prefix among them; a one-token word is always banned."""
    words = row.params.bad_words_token_ids
    if not words:
        return []
    tokens, end, num_outputs = row.token_ids, len(row.token_ids), row.num_output_tokens
    banned = []
    for word in words:
        prefix = len(word) - 1
        # Indexed one by one rather than sliced: a verification row's ExtendedTokens would copy the
        # whole context for each slice.
        if prefix <= num_outputs and all(tokens[end - prefix + j] == word[j] for j in range(prefix)):
            banned.append(word[-1])
    return banned


def apply_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        banned = [t for t in bad_word_bans(row) if t < vocab]
        if banned:
            logits[i, banned] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = [t for t in bias if t < vocab]
            logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype, device=logits.device)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Stop tokens to -inf while a row has fewer than min_tokens outputs. A structured-output row whose grammar
    (applied first) leaves only stop tokens gets them back, as vLLM's MinTokensLogitsProcessor does: a grammar
    that can only end must end, not sample outside itself (which tokenloom reported as a grammar dead end)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if _min_tokens_active(row):
            ids = [t for t in row.params.all_stop_token_ids if t < vocab]
            kept = logits[i, ids].clone() if row.params.structured_outputs is not None else None
            logits[i, ids] = float("-inf")
            if kept is not None and bool(torch.isneginf(logits[i]).all()):
                logits[i, ids] = kept


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties, in place.

    Only tokens a row has seen change, so this touches (row, token) pairs gathered with numpy
    instead of building [rows, vocab] count tensors: cost grows with sequence length, not vocab.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if not idx:
        return
    vocab = logits.shape[1]
    row_ids, token_ids, counts, params = [], [], [], []
    for i in idx:
        row = rows[i]
        out_ids, out_counts = np.unique(np.asarray(row.output_token_ids, dtype=np.int64), return_counts=True)
        seen = np.union1d(np.asarray(row.prompt_token_ids, dtype=np.int64), out_ids)
        seen = seen[(seen >= 0) & (seen < vocab)]
        count = np.zeros(len(seen), dtype=np.float32)
        in_vocab = (out_ids >= 0) & (out_ids < vocab)
        count[np.searchsorted(seen, out_ids[in_vocab])] = out_counts[in_vocab]
        row_ids.append(np.full(len(seen), i, dtype=np.int64))
        token_ids.append(seen)
        counts.append(count)
        params.append(np.tile(_penalty_values(row.params), (len(seen), 1)))
    device = logits.device
    rows_t = torch.from_numpy(np.concatenate(row_ids)).to(device)
    tokens_t = torch.from_numpy(np.concatenate(token_ids)).to(device)
    count_t = torch.from_numpy(np.concatenate(counts)).to(device, logits.dtype)
    rep, freq, pres = torch.from_numpy(np.concatenate(params)).to(device, logits.dtype).unbind(1)
    vals = logits[rows_t, tokens_t]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - freq * count_t - pres * (count_t > 0).to(vals.dtype)
    logits[rows_t, tokens_t] = vals


def _penalty_values(p: SamplingParams) -> np.ndarray:
    return np.array([p.repetition_penalty, p.frequency_penalty, p.presence_penalty], dtype=np.float32)


def apply_top_k_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM's sort-based top-k then top-p on logits (top-k keeps ties with the k-th value).

    The reference semantics; sampling uses the cheaper `top_k_top_p_candidates`, which the tests
    hold to this.
    """
    vocab = logits.shape[1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    device = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    k = torch.tensor(top_k, device=device, dtype=torch.long)
    kth_value = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    p = torch.tensor(top_p, device=device, dtype=logits.dtype)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


# --------------------------------------------------------------------------- sampling


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow], processors: BatchProcessors | None = None
            ) -> torch.Tensor:  # fmt: skip
    random_idx = [i for i, r in enumerate(rows) if r.params.temperature >= _GREEDY_EPS]
    if random_idx and processors is not None and processors.argmax_invariant:
        return _sample_with_processors(logits, rows, random_idx, processors)
    if len(random_idx) == len(rows):
        return _sample_random(logits, rows)
    token_ids = logits.argmax(dim=-1)  # right for greedy rows; random rows are overwritten
    if random_idx:
        token_ids[random_idx] = _sample_random(logits[random_idx], [rows[i] for i in random_idx])
    return token_ids


def _sample_with_processors(logits: torch.Tensor, rows: Sequence[SamplingRow], random_idx: list[int],
                            processors: BatchProcessors) -> torch.Tensor:  # fmt: skip
    """vLLM's order when argmax-invariant custom processors run: greedy rows take their argmax first; then every
    row is divided by its temperature (a greedy row's counts as 1), min_p masks the rows that set it, and the
    processors see the whole batch; the random rows sample from what they return."""
    token_ids = logits.argmax(dim=-1)
    random_rows = [rows[i] for i in random_idx]
    scaled = logits.clone()
    temps = torch.tensor([r.params.temperature for r in random_rows], device=logits.device, dtype=logits.dtype)
    scaled[random_idx] = logits[random_idx] / temps.unsqueeze(1)
    apply_min_p_to_logits(scaled, rows)  # vLLM's MinPLogitsProcessor runs before the custom ones
    scaled = processors.apply(processors.argmax_invariant, scaled)
    token_ids[random_idx] = _sample_random(scaled[random_idx], random_rows, scaled=True)
    return token_ids


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow], scaled: bool = False) -> torch.Tensor:
    """`scaled`: the logits are already divided by the temperature and masked by min_p."""
    device, vocab = logits.device, logits.shape[1]
    if scaled:
        probs = torch.softmax(logits, dim=-1)
    else:
        temps = torch.tensor([r.params.temperature for r in rows], device=device, dtype=logits.dtype)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        apply_min_p(probs, rows)
    u = _uniforms(rows, device)
    filtered = [j for j, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    if not filtered:
        return _argmax_broken_rows(logits, probs, inverse_cdf_sample(probs, u))
    out = torch.empty(len(rows), dtype=torch.long, device=device)
    plain = [j for j in range(len(rows)) if j not in set(filtered)]
    if plain:
        out[plain] = inverse_cdf_sample(probs[plain], u[plain])
    f_rows = [rows[j] for j in filtered]
    out[filtered] = _sample_top_k_top_p(
        probs[filtered], [r.params.top_k for r in f_rows], [r.params.top_p for r in f_rows], u[filtered]
    )
    return _argmax_broken_rows(logits, probs, out)


def _argmax_broken_rows(logits: torch.Tensor, probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows whose logits hold a NaN or +inf (activations that overflowed, e.g. under a LoRA adapter with huge
    weights) softmax to NaN everywhere, and the inverse-cdf search then picks the last token of the vocabulary,
    which a grammar or allowed_token_ids may forbid (the request then failed). Such a row takes its argmax, as
    a greedy row does: NaN counts as the maximum and masked tokens are -inf, so it stays among the allowed."""
    broken = probs[:, 0].isnan()  # a NaN anywhere in the softmax's input makes every entry NaN: one column tells
    if bool(broken.any()):
        token_ids[broken] = logits[broken].argmax(dim=-1)
    return token_ids


def apply_min_p_to_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """vLLM's MinPLogitsProcessor, in place: -inf for every token whose probability under `logits` is below min_p x
    the row's top probability, on the rows that set min_p (the argmax-invariant processors then see it applied)."""
    idx = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if not idx:
        return
    min_p = torch.tensor([rows[i].params.min_p for i in idx], device=logits.device, dtype=logits.dtype)
    probs = torch.softmax(logits[idx], dim=-1)
    below = probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits[idx] = logits[idx].masked_fill(below, float("-inf"))


def apply_min_p(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Zero (in place) every probability under min_p x the row's top probability."""
    if all(r.params.min_p == 0.0 for r in rows):
        return
    min_p = torch.tensor([r.params.min_p for r in rows], device=probs.device, dtype=probs.dtype)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)


_CDF_CHUNK = 256


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row, drawn with probability proportional to `weights` (need not sum to 1).

    One uniform per row instead of vLLM's one exponential per vocabulary entry, and a two-level
    search instead of a full-row cumsum (which is sequential and the slowest pass on CPU): chunk
    sums pick the chunk, then a cumsum inside that one chunk picks the token.
    """
    rows, vocab = weights.shape
    if vocab <= _CDF_CHUNK:
        return _fix_zero_picks(weights, _search(weights.cumsum(dim=-1), u))
    pad = -vocab % _CDF_CHUNK
    w = F.pad(weights, (0, pad)) if pad else weights
    chunks = w.view(rows, -1, _CDF_CHUNK)
    chunk_mass = chunks.sum(dim=-1)
    chunk_cdf = chunk_mass.cumsum(dim=-1)
    target = u * chunk_cdf[:, -1]
    c = torch.searchsorted(chunk_cdf, target.unsqueeze(1), right=True).squeeze(1)
    c.clamp_max_(chunk_cdf.shape[1] - 1)
    before = (chunk_cdf.gather(1, c.unsqueeze(1)) - chunk_mass.gather(1, c.unsqueeze(1))).squeeze(1)
    inner = chunks[torch.arange(rows, device=w.device), c]  # [rows, chunk]
    j = _search(inner.cumsum(dim=-1), (target - before) / inner.sum(dim=-1).clamp_min(1e-30))
    return _fix_zero_picks(weights, (c * _CDF_CHUNK + j).clamp_max_(vocab - 1))


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose cdf exceeds u x (the cdf total), per row."""
    total = cdf[:, -1]
    target = (u * total).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(cdf.shape[1] - 1)


def _fix_zero_picks(weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rounding can put the target just past the last nonzero weight at or before the chosen
    place (the very top of a cdf, or of a chunk): step back to that weight."""
    zero = weights.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0
    if bool(zero.any()):
        w, at = weights[zero], idx[zero]
        positive = w > 0
        upto = positive & (torch.arange(w.shape[1], device=w.device) <= at.unsqueeze(1))
        last_upto = w.shape[1] - 1 - upto.flip(-1).int().argmax(dim=-1)
        idx[zero] = torch.where(upto.any(dim=-1), last_upto, positive.int().argmax(dim=-1))
    return idx


# Top-p without top-k looks for its nucleus among the most likely tokens, in growing windows, and
# sorts the whole vocabulary only for rows whose nucleus is larger still. Partial top-k is cheap
# for a small window (128 x 49k rows: 11 ms at 64, 59 ms at 1024, 460 ms for a full sort).
_TOP_P_WINDOWS = (64, 1024)


def top_k_top_p_candidates(
    probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], window: int = _TOP_P_WINDOWS[0]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p over the `window` most likely tokens of each row, in probability space.

    Returns (weights, token ids) of the candidates, best first, weights zeroed where filtered out,
    and `complete` [rows] bool: False where the row's nucleus may reach beyond the window (only
    rows without top-k), whose result must then be recomputed over the whole vocabulary.
    Same survivors as `apply_top_k_top_p`: a token stays if top-k keeps it and the mass of the
    surviving tokens above it is below top_p of the surviving mass.
    """
    device, vocab = probs.device, probs.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    width = min(vocab, max(k if k < vocab else window for k in ks))
    vals, ids = probs.topk(width, dim=-1)  # sorted, best first
    has_k = torch.tensor([k < vocab for k in ks], device=device)
    k_t = torch.tensor([min(k, width) for k in ks], device=device)
    kth = vals.gather(1, (k_t - 1).unsqueeze(1))
    vals = vals.masked_fill(has_k.unsqueeze(1) & (vals < kth), 0.0)
    # With top-k every survivor is a candidate; without, the survivors are the whole row.
    total = torch.where(has_k, vals.sum(dim=-1), probs.sum(dim=-1)).unsqueeze(1)
    p = torch.tensor(list(top_p), device=device, dtype=probs.dtype).unsqueeze(1)
    cum = vals.cumsum(dim=-1)
    vals = vals.masked_fill(cum - vals >= p * total, 0.0)
    complete = has_k | (cum[:, -1:] >= p * total).squeeze(1) | (width == vocab)
    return vals, ids, complete


def _sample_top_k_top_p(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor
) -> torch.Tensor:
    tokens = torch.empty(len(top_k), dtype=torch.long, device=probs.device)
    pending = list(range(len(top_k)))  # rows (of probs) not sampled yet
    for window in (*_TOP_P_WINDOWS, probs.shape[1]):
        sub = probs if len(pending) == len(top_k) else probs[pending]
        vals, ids, complete = top_k_top_p_candidates(
            sub, [top_k[i] for i in pending], [top_p[i] for i in pending], window
        )
        picked = ids.gather(1, inverse_cdf_sample(vals, u[pending]).unsqueeze(1)).squeeze(1)
        done = complete.tolist()
        rows = [i for i, d in zip(pending, done) if d]
        tokens[rows] = picked[[j for j, d in enumerate(done) if d]]
        pending = [i for i, d in zip(pending, done) if not d]
        if not pending:
            break
    return tokens


def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """U[0, 1) per row: the row's own generator when seeded, the global one otherwise."""
    u = torch.rand(len(rows), device=device)
    for i, r in enumerate(rows):
        if r.generator is not None:
            r.generator.manual_seed(step_seed(r.params.seed or 0, r.num_output_tokens))
            u[i] = torch.rand(1, generator=r.generator, device=r.generator.device)[0]
    return u


# --------------------------------------------------------------------------- logprobs


def _logprob_rows(rows: Sequence[SamplingRow]) -> list[int]:
    return [i for i, r in enumerate(rows) if r.params.logprobs is not None]


def _raw_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
    """log_softmax of the unprocessed logits, for the rows that asked for logprobs only."""
    idx = _logprob_rows(rows)
    return torch.log_softmax(logits[idx].float(), dim=-1) if idx else None


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[SampleLogprobs | None]:
    idx = _logprob_rows(rows)
    chosen = token_ids[idx]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    # Rank 1 = the most likely token; ties share the worse rank (vLLM counts logprobs >= chosen).
    ranks = (logprobs >= chosen_lp).float().sum(dim=-1).long()  # float sum: ~4x faster than bool sum
    n_max = max(rows[i].params.logprobs or 0 for i in idx)
    top_lp, top_ids = logprobs.topk(n_max, dim=-1) if n_max else (logprobs[:, :0], chosen[:, None][:, :0])
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist()
    out: list[SampleLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(idx):
        n = rows[i].params.logprobs or 0
        top = list(zip(top_ids_l[j][:n], top_lp_l[j][:n]))
        if rows[i].params.logprob_token_ids is not None:  # these tokens instead of the top-n
            top = _chosen_tokens(logprobs[j], rows[i].params.logprob_token_ids)
        out[i] = SampleLogprobs(token_id=chosen_l[j], logprob=chosen_lp_l[j], rank=ranks_l[j], top=top)
    return out


def _chosen_tokens(row_logprobs: torch.Tensor, token_ids: list[int]) -> list[tuple[int, float]]:
    vocab = row_logprobs.shape[0]
    ids = [t for t in token_ids if t < vocab]
    return list(zip(ids, row_logprobs[ids].tolist()))
