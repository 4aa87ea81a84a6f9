"""Verification of n-gram drafts: vLLM 0.32's rejection sampler (vllm/v1/sample/rejection_sampler.py)
for drafts without draft probabilities.

A request with d drafts x_1..x_d contributes d + 1 logits rows; row j is the target model's
distribution after the context plus x_1..x_j, processed exactly as the plain sampler would process
it for that context (allowed_token_ids, bad_words, min_tokens, logit_bias, penalties over the outputs
including the drafts before it, temperature, min-p, top-k, top-p: the same code, tokenloom/model/sampler.py).
So a bad word's prefix may end in a draft: vLLM's apply_bad_words_with_drafts checks each draft position
against the outputs plus the drafts before it, as here.
allowed_token_ids and logit_bias were once skipped here: under speculation a request could get a token
outside its allowed set (tests/test_rejection_sampler.py).

* Greedy: emit argmax_j at each row, stopping after the first j with x_{j+1} != argmax_j; when
  every draft matched, the last row's argmax is the bonus token. (The output equals plain greedy
  decoding token for token.)
* Random: at row j draw u ~ U[0, 1) and accept x_{j+1} iff p_j(x_{j+1}) >= u (draft probability
  q = 1 for n-gram drafts: vLLM's `p/q >= u` with q = 1). At the first rejection emit a token
  from p_j with x_{j+1} removed (renormalised); when all are accepted, the bonus token is drawn
  from p_d. Per position this gives P(y) = p(x)[y = x] + (1 - p(x)) p(y) / (1 - p(x)) = p(y):
  the output distribution is plain sampling's. vLLM draws the recovered token as argmax(p / E),
  E ~ Exp(1); here it is the sampler's inverse-CDF draw over the same weights (same distribution).
* A placeholder draft (-1, vLLM's first-decode padding) is always rejected.

Difference from vLLM: vLLM's target distribution for drafts skips min-p (its
`apply_sampling_constraints` applies temperature, top-k and top-p only); here min-p applies too,
so that speculation never changes what a min-p request samples.

Seeded requests draw their uniforms from their own generator, reseeded per (seed, output index),
so a seeded request gives the same tokens on every run and in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenloom.core.outputs import SampleLogprobs
from tokenloom.model.sampler import (
    _GREEDY_EPS,
    _TOP_P_WINDOWS,
    SamplingRow,
    _gather_logprobs,
    _has_penalties,
    _has_processors,
    _min_tokens_active,
    all_plain_greedy,
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    inverse_cdf_sample,
    step_seed,
    top_k_top_p_candidates,
)

PLACEHOLDER_DRAFT = -1


class ExtendedTokens(Sequence[int]):
    """context + drafts as one read-only sequence, without copying the context per row."""

    __slots__ = ("base", "extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self.base = base
        self.extra = extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [*self.base, *self.extra][index]
        n = len(self.base)
        if index < 0:
            index += len(self)
        return self.base[index] if index < n else self.extra[index - n]


@dataclass
class VerifyRequest:
    """One request in the verification: its sampling row before this step (context without the
    drafts) and the drafts scheduled for it (possibly none)."""

    row: SamplingRow
    draft_token_ids: list[int]

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft_token_ids)


def position_rows(reqs: Sequence[VerifyRequest]) -> list[SamplingRow]:
    """One SamplingRow per logits row: row j of a request sees its drafts before j as outputs."""
    rows: list[SamplingRow] = []
    for req in reqs:
        base = req.row
        rows.append(base)
        drafts = [t if t >= 0 else 0 for t in req.draft_token_ids]
        for j in range(1, req.num_rows):
            rows.append(SamplingRow(base.params, ExtendedTokens(base.token_ids, drafts[:j]),
                                    base.num_prompt_tokens, base.generator))
    return rows


def greedy_accept(target_token_ids: Sequence[int], reqs: Sequence[VerifyRequest]) -> list[list[int]]:
    """Per request: the target argmax while it equals the drafts, then one more (mismatch or bonus)."""
    out: list[list[int]] = []
    offset = 0
    for req in reqs:
        emitted: list[int] = []
        for j in range(req.num_rows):
            token = int(target_token_ids[offset + j])
            emitted.append(token)
            if j == len(req.draft_token_ids) or req.draft_token_ids[j] != token:
                break
        out.append(emitted)
        offset += req.num_rows
    return out


def _accept_mask(p_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """vLLM's acceptance test for drafts without probabilities (q = 1): p(x) >= u."""
    return p_draft >= u


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]
    logprobs: list[list[SampleLogprobs] | None] | None


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, reqs: Sequence[VerifyRequest]) -> RejectionOutput:
        """logits [sum of num_rows, V] (fp32), rows grouped per request in order -> emitted tokens."""
        rows = position_rows(reqs)
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all_plain_greedy(rows):
            return RejectionOutput(greedy_accept(logits.argmax(dim=-1).tolist(), reqs), None)
        processed = logits
        if any(_min_tokens_active(r) or _has_penalties(r.params) or _has_processors(r.params) for r in rows):
            # The plain sampler's order (sampler.py): allowed tokens, bad words, min_tokens, logit bias,
            # penalties.
            processed = logits.clone()
            apply_allowed_token_ids(processed, rows)
            apply_bad_words(processed, rows)
            apply_min_tokens(processed, rows)
            apply_logit_bias(processed, rows)
            apply_penalties(processed, rows)
        argmax = processed.argmax(dim=-1).tolist()
        random_idx = [i for i, r in enumerate(rows) if r.params.temperature >= _GREEDY_EPS]
        drafts_per_row = _drafts_per_row(reqs)
        accept: dict[int, bool] = {}
        sample: dict[int, int] = {}
        if random_idx:
            accept, sample = self._random_rows(processed, rows, random_idx, drafts_per_row)
        token_ids: list[list[int]] = []
        emitted_rows: list[int] = []
        offset = 0
        for req in reqs:
            emitted: list[int] = []
            for j in range(req.num_rows):
                r = offset + j
                emitted_rows.append(r)
                is_bonus = j == len(req.draft_token_ids)
                draft = None if is_bonus else req.draft_token_ids[j]
                if r not in sample:  # greedy row
                    emitted.append(argmax[r])
                    if is_bonus or draft != argmax[r]:
                        break
                elif not is_bonus and accept[r]:
                    emitted.append(draft)  # type: ignore[arg-type]
                else:
                    emitted.append(sample[r])  # recovered token, or the bonus token
                    break
            token_ids.append(emitted)
            offset += req.num_rows
        logprobs = self._logprobs(logits, rows, reqs, token_ids)
        return RejectionOutput(token_ids, logprobs)

    def _random_rows(
        self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int], drafts_per_row: list[int | None]
    ) -> tuple[dict[int, bool], dict[int, int]]:
        """For each random row: accept its draft or not, and the token it emits if it is the
        first rejection or the bonus row (a draw from p with the draft removed / from p)."""
        sub = [rows[i] for i in idx]
        device, vocab = logits.device, logits.shape[1]
        temps = torch.tensor([r.params.temperature for r in sub], device=device, dtype=logits.dtype)
        probs = torch.softmax((logits if len(idx) == len(rows) else logits[idx]) / temps.unsqueeze(1), dim=-1)
        apply_min_p(probs, sub)
        u_sample, u_accept = _uniform_pairs(sub, device)
        drafts = [drafts_per_row[i] for i in idx]
        draft_t = torch.tensor([d if d is not None and 0 <= d < vocab else -1 for d in drafts], device=device)
        has_draft = draft_t >= 0
        safe_draft = draft_t.clamp_min(0)
        filtered = [j for j, r in enumerate(sub) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
        p_draft = torch.zeros(len(sub), device=device, dtype=probs.dtype)
        picked = torch.empty(len(sub), dtype=torch.long, device=device)
        filtered_set = set(filtered)
        plain = [j for j in range(len(sub)) if j not in filtered_set]
        if plain:
            sel = slice(None) if len(plain) == len(sub) else torch.tensor(plain, device=device)
            w = probs[sel]
            d, hd = safe_draft[sel], has_draft[sel]
            p_x = w.gather(1, d.unsqueeze(1)).squeeze(1) / w.sum(dim=-1)
            p_draft[sel] = torch.where(hd, p_x, torch.zeros_like(p_x))
            w = w.clone()
            rows_hd = torch.nonzero(hd).squeeze(1)
            w[rows_hd, d[rows_hd]] = 0.0  # the recovered token is never the draft
            picked[sel] = _draw(w, u_sample[sel], probs[sel])
        if filtered:
            self._filtered_rows(probs, sub, filtered, safe_draft, has_draft, u_sample, p_draft, picked)
        accepted = (_accept_mask(p_draft.double(), u_accept) & has_draft).tolist()
        picked_l = picked.tolist()
        return dict(zip(idx, accepted)), dict(zip(idx, picked_l))

    def _filtered_rows(self, probs, sub, filtered, safe_draft, has_draft, u_sample, p_draft, picked) -> None:
        """Top-k / top-p rows: the candidates of the sampler's growing windows (same survivors as
        the sort-based reference), then p(x) and the recovered draw over the survivors."""
        pending = list(filtered)
        for window in (*_TOP_P_WINDOWS, probs.shape[1]):
            vals, ids, complete = top_k_top_p_candidates(
                probs[pending], [sub[j].params.top_k for j in pending], [sub[j].params.top_p for j in pending], window
            )
            d = safe_draft[pending]
            is_draft = (ids == d.unsqueeze(1)) & has_draft[pending].unsqueeze(1)
            p_x = (vals * is_draft).sum(dim=-1) / vals.sum(dim=-1).clamp_min(1e-30)
            w = vals.masked_fill(is_draft, 0.0)
            choice = ids.gather(1, _draw(w, u_sample[pending], vals).unsqueeze(1)).squeeze(1)
            done = complete.tolist()
            rows_done = [j for j, ok in zip(pending, done) if ok]
            sel = [k for k, ok in enumerate(done) if ok]
            p_draft[rows_done] = p_x[sel]
            picked[rows_done] = choice[sel]
            pending = [j for j, ok in zip(pending, done) if not ok]
            if not pending:
                break

    def _logprobs(self, logits, rows, reqs, token_ids) -> list[list[SampleLogprobs] | None] | None:
        want = [i for i, req in enumerate(reqs) if req.row.params.logprobs is not None]
        if not want:
            return None
        starts = []
        offset = 0
        for req in reqs:
            starts.append(offset)
            offset += req.num_rows
        row_idx, tokens, sub_rows = [], [], []
        for i in want:
            for j, t in enumerate(token_ids[i]):
                row_idx.append(starts[i] + j)
                tokens.append(t)
                sub_rows.append(rows[starts[i] + j])
        raw = torch.log_softmax(logits[row_idx].float(), dim=-1)
        got = _gather_logprobs(raw, torch.tensor(tokens, device=logits.device), sub_rows)
        out: list[list[SampleLogprobs] | None] = [None] * len(reqs)
        k = 0
        for i in want:
            n = len(token_ids[i])
            out[i] = [g for g in got[k : k + n] if g is not None]
            k += n
        return out


def _drafts_per_row(reqs: Sequence[VerifyRequest]) -> list[int | None]:
    """The draft each row verifies (None for a request's last row, whose sample is the bonus)."""
    out: list[int | None] = []
    for req in reqs:
        out.extend(req.draft_token_ids)
        out.append(None)
    return out


def _draw(weights: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """inverse_cdf_sample over `weights`; a row whose weights are all zero (the draft held all the
    mass, so it cannot be rejected) draws from `fallback` instead (its result is never used)."""
    empty = weights.sum(dim=-1) <= 0
    if bool(empty.any()):
        weights = torch.where(empty.unsqueeze(1), fallback, weights)
    return inverse_cdf_sample(weights, u)


def _uniform_pairs(rows: Sequence[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two U[0, 1) per row: the sampling draw (the same one the plain sampler makes for that output
    index, from the row's own generator when seeded) and the acceptance draw (float64 as vLLM)."""
    u = torch.rand(len(rows), device=device)
    u_acc = torch.rand(len(rows), device=device, dtype=torch.float64)
    for i, r in enumerate(rows):
        if r.generator is not None:
            r.generator.manual_seed(step_seed(r.params.seed or 0, r.num_output_tokens))
            u[i] = torch.rand(1, generator=r.generator, device=r.generator.device)[0]
            u_acc[i] = torch.rand(1, generator=r.generator, device=r.generator.device, dtype=torch.float64)[0]
    return u, u_acc
