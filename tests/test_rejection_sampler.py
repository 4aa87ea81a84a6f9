"""The rejection sampler: vLLM 0.32's greedy rows (tests/v1/sample/test_rejection_sampler.py), seeded
determinism, and a chi-square test that random sampling with drafts draws plain sampling's
distribution (failing on a planted bias)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenloom.model import rejection_sampler as rs
from tokenloom.model.rejection_sampler import RejectionSampler, VerifyRequest, greedy_accept
from tokenloom.model.sampler import SamplingRow, make_generator
from tokenloom.sampling_params import SamplingParams

V = 6


def _greedy_logits(targets: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.full((len(targets), vocab), -10.0)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 10.0
    return logits


def _req(drafts, params=None, context=(0, 1), prompt=2, generator=None):
    return VerifyRequest(SamplingRow(params or SamplingParams(temperature=0.0), list(context), prompt, generator),
                         list(drafts))


@pytest.mark.parametrize(
    "drafts,targets,expected",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # perfect match + bonus
        ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5]]),  # early mismatch
        ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4]]),
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7], [4, 8]]),
        ([[]], [[5]], [[5]]),  # no drafts: just the sample
        ([[-1, -1, -1]], [[7, 1, 1, 1]], [[7]]),  # placeholder drafts always rejected
        ([[1]], [[2, 3]], [[2]]),  # first mismatch
    ],
)
def test_greedy(drafts, targets, expected):
    reqs = [_req(d) for d in drafts]
    flat = [t for row in targets for t in row]
    assert greedy_accept(flat, reqs) == expected
    assert RejectionSampler()(_greedy_logits(flat), reqs).token_ids == expected


def test_greedy_with_penalty_sees_earlier_drafts():
    # Row 1's repetition penalty must count draft 0 as an output: token 3 leads row 1 only
    # before the penalty, then token 4 does.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    logits = torch.full((2, 10), 0.0)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 4] = 5.0, 3.0
    out = RejectionSampler()(logits, [_req([3], params, context=(0, 1))])
    assert out.token_ids == [[3, 4]]


def test_seeded_is_deterministic_and_recovered_never_the_draft():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    params = SamplingParams(temperature=1.0, seed=1234)
    runs = []
    for _ in range(20):
        gen = make_generator("cpu")
        runs.append(RejectionSampler()(logits, [_req([1, 2, 3], params, generator=gen)]).token_ids)
    assert all(r == runs[0] for r in runs)
    # A draft with almost no mass is rejected, and the recovered token is never that draft.
    logits = torch.zeros(64 * 2, 10)
    logits[:, 5] = -30.0
    reqs = [_req([5], SamplingParams(temperature=1.0)) for _ in range(64)]
    for out in RejectionSampler()(logits, reqs).token_ids:
        assert len(out) == 1 and out[0] != 5


def test_logprobs_for_every_emitted_token():
    logits = _greedy_logits([1, 2, 4])
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = RejectionSampler()(logits, [_req([1, 2], params)])
    assert out.token_ids == [[1, 2, 4]]
    assert [lp.token_id for lp in out.logprobs[0]] == [1, 2, 4]
    assert all(lp.rank == 1 and len(lp.top) == 2 for lp in out.logprobs[0])


# ---------------------------------------------------------------- distribution (chi-square)
_TABLE = torch.randn(V, V, V, generator=torch.Generator().manual_seed(7)) * 1.5


def _model_logits(context: list[int]) -> torch.Tensor:
    """A tiny fixed 'model': logits of the next token from the last two tokens."""
    return _TABLE[context[-2], context[-1]]


def _drafter(context: list[int]) -> list[int]:
    """Any drafter will do; this one proposes plausible-but-wrong runs (a repeat, then +1)."""
    return [context[-1], (context[-1] + 1) % V]


def _target_probs(context: list[int], params: SamplingParams) -> torch.Tensor:
    logits = _model_logits(context) / params.temperature
    if params.top_k:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _sample_with_spec(params: SamplingParams, n: int, length: int = 3) -> dict[tuple, int]:
    seqs = [[2, 3] for _ in range(n)]
    sampler = RejectionSampler()
    while any(len(s) < 2 + length for s in seqs):
        active = [s for s in seqs if len(s) < 2 + length]
        reqs, rows = [], []
        for s in active:
            drafts = _drafter(s)
            reqs.append(VerifyRequest(SamplingRow(params, list(s), 2, None), drafts))
            ctx = s[-1:] + drafts
            rows.extend((ctx[j - 1] if j else s[-2], ctx[j]) for j in range(len(drafts) + 1))
        pairs = torch.tensor(rows)
        out = sampler(_TABLE[pairs[:, 0], pairs[:, 1]], reqs)
        for s, toks in zip(active, out.token_ids):
            s.extend(toks)
    counts: dict[tuple, int] = {}
    for s in seqs:
        key = tuple(s[2 : 2 + length])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _chi_square_p(counts: dict[tuple, int], params: SamplingParams, n: int, length: int = 3) -> float:
    observed, expected = [], []
    for seq in itertools.product(range(V), repeat=length):
        ctx, prob = [2, 3], 1.0
        for t in seq:
            prob *= float(_target_probs(ctx, params)[t])
            ctx = ctx + [t]
        if prob * n >= 5:  # pool cells too small for the chi-square approximation
            observed.append(counts.get(seq, 0))
            expected.append(prob * n)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    rest_obs, rest_exp = n - obs.sum(), n - exp.sum()
    stat = float(((obs - exp) ** 2 / exp).sum() + ((rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)))
    df = len(observed)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_random_sampling_keeps_the_target_distribution(params):
    torch.manual_seed(0)
    n = 4000
    assert _chi_square_p(_sample_with_spec(params, n), params, n) > 1e-3


def test_chi_square_catches_a_planted_bias(monkeypatch):
    # Accepting drafts a little too often (p(x) >= 0.8 u) must be detected.
    monkeypatch.setattr(rs, "_accept_mask", lambda p, u: p >= 0.8 * u)
    torch.manual_seed(0)
    n = 4000
    params = SamplingParams(temperature=1.0)
    assert _chi_square_p(_sample_with_spec(params, n), params, n) < 1e-6
