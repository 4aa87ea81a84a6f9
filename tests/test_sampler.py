"""Sampler: per-request parameters in one batched call, checked against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.model.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    inverse_cdf_sample,
    make_generator,
    top_k_top_p_candidates,
)
from tokenloom.sampling_params import SamplingParams

EOS = 2
PROBS = [0.5, 0.3, 0.15, 0.05]


def row(prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingRow:
    params = SamplingParams(**kw)
    params.eos_token_id = EOS
    prompt, output = list(prompt or [0]), list(output or [])
    generator = make_generator("cpu") if params.seed is not None else None
    return SamplingRow(params, prompt + output, len(prompt), generator)


def logits_from_probs(probs: list[float], n_rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(n_rows, -1).clone()


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    assert sampler(logits, [row(temperature=0.0) for _ in range(16)]).token_ids == expected
    # Not the fast path (logprobs asked), same answer.
    assert sampler(logits, [row(temperature=0.0, logprobs=2) for _ in range(16)]).token_ids == expected


def test_top_k_1_is_greedy(sampler: Sampler) -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    out = sampler(logits, [row(temperature=1.3, top_k=1) for _ in range(32)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_sampler_leaves_input_logits_untouched(sampler: Sampler) -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    sampler(logits, [row(temperature=0.7, top_p=0.5, repetition_penalty=1.5, logprobs=1) for _ in range(3)])
    assert torch.equal(logits, before)


def test_samples_follow_the_distribution(sampler: Sampler) -> None:
    torch.manual_seed(0)
    n = 20000
    out = sampler(logits_from_probs(PROBS, n), [row(temperature=1.0) for _ in range(n)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor(PROBS), atol=0.015, rtol=0)


def test_temperature_sharpens(sampler: Sampler) -> None:
    torch.manual_seed(0)
    n = 20000
    out = sampler(logits_from_probs(PROBS, n), [row(temperature=0.5) for _ in range(n)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    sharpened = torch.tensor(PROBS) ** 2
    torch.testing.assert_close(freq, sharpened / sharpened.sum(), atol=0.015, rtol=0)


def _seeded_tokens(sampler: Sampler, logits: torch.Tensor, batch: list[SamplingRow], at: int, steps: int) -> list[int]:
    """Tokens the row at index `at` draws over `steps` steps (its outputs grow as in a real run)."""
    tokens = []
    for _ in range(steps):
        t = sampler(logits, batch).token_ids[at]
        tokens.append(t)
        target = batch[at]
        batch[at] = SamplingRow(target.params, list(target.token_ids) + [t], target.num_prompt_tokens, target.generator)
    return tokens


def test_seeded_sampling_reproducible_and_batch_independent(sampler: Sampler) -> None:
    vocab = 64
    flat = torch.zeros(1, vocab)  # uniform: every draw is decided by the generator alone
    alone = _seeded_tokens(sampler, flat, [row(temperature=1.0, seed=1234)], 0, 12)
    again = _seeded_tokens(sampler, flat, [row(temperature=1.0, seed=1234)], 0, 12)
    assert alone == again
    torch.manual_seed(99)
    batch = [row(temperature=1.0), row(temperature=0.9, seed=7), row(temperature=1.0, seed=1234), row(temperature=0.0)]
    in_batch = _seeded_tokens(sampler, torch.zeros(4, vocab), batch, 2, 12)
    assert in_batch == alone
    other_seed = _seeded_tokens(sampler, flat, [row(temperature=1.0, seed=4321)], 0, 12)
    assert other_seed != alone


def test_seeded_draw_depends_on_output_index_not_history(sampler: Sampler) -> None:
    """After preemption the runner rebuilds the generator and recomputes the request: the draw of output
    token k must depend on (seed, k) alone — not on the tokens before it (prompt or outputs), nor on
    what the generator drew before."""
    logits = torch.zeros(1, 4096)  # uniform: the draw is the generator's alone

    def draw(prompt: list[int], output: list[int], generator: torch.Generator | None = None) -> int:
        r = row(prompt=prompt, output=output, temperature=1.0, seed=5)
        if generator is not None:
            r = SamplingRow(r.params, r.token_ids, r.num_prompt_tokens, generator)
        return sampler(logits, [r]).token_ids[0]

    base = draw([5, 6], [1, 2, 3])
    assert draw([5, 6], [1, 2, 3]) == base
    assert draw([9, 9, 9, 9, 9], [7, 8, 40]) == base  # another history, same output index 3
    used = make_generator("cpu")
    torch.rand(1000, generator=used)  # a generator with a past
    assert draw([5, 6], [1, 2, 3], used) == base
    by_index = [draw([5, 6], [1] * k) for k in range(8)]
    assert by_index[3] == base and len(set(by_index)) >= 7  # the index does move the draw


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = logits_from_probs(PROBS)
    kept = apply_top_k_top_p(logits, [row(top_p=0.7)])
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]
    kept = apply_top_k_top_p(logits, [row(top_p=0.85)])
    assert torch.isfinite(kept[0]).tolist() == [True, True, True, False]
    kept = apply_top_k_top_p(logits, [row(top_p=0.01)])  # the top token always survives
    assert torch.isfinite(kept[0]).tolist() == [True, False, False, False]


def test_top_k_and_min_p_exclude_tokens() -> None:
    logits = logits_from_probs(PROBS, 2)
    kept = apply_top_k_top_p(logits, [row(top_k=2), row(top_k=3, top_p=0.7)])
    assert torch.isfinite(kept).tolist() == [[True, True, False, False], [True, True, False, False]]
    # min_p=0.2: threshold 0.2 * 0.5 = 0.1, so only the 0.05 token goes.
    probs = torch.tensor(PROBS).expand(2, -1).clone()
    apply_min_p(probs, [row(min_p=0.2), row(min_p=0.0)])
    assert (probs > 0).tolist() == [[True, True, True, False], [True] * 4]


@pytest.mark.parametrize("window", [1024, 8])
def test_candidate_filter_matches_sort_based_reference(window: int) -> None:
    """The windowed top-k/top-p keeps exactly the tokens vLLM's full-sort version keeps; with a
    tiny window, flat rows are flagged incomplete and the full-vocabulary rerun agrees too."""
    g = torch.Generator().manual_seed(3)
    n, vocab = 64, 200
    logits = torch.randn(n, vocab, generator=g) * torch.rand(n, 1, generator=g) * 4
    ks = torch.randint(0, 40, (n,), generator=g).tolist()
    ps = (torch.rand(n, generator=g) * 0.9 + 0.1).tolist()
    ks = [k if i % 3 else 0 for i, k in enumerate(ks)]  # a third of the rows: top-p only
    rows = [row(top_k=k, top_p=p) for k, p in zip(ks, ps)]
    expected = torch.isfinite(apply_top_k_top_p(logits, rows))
    probs = torch.softmax(logits, -1)
    vals, ids, complete = top_k_top_p_candidates(probs, ks, ps, window=window)
    full_vals, full_ids, _ = top_k_top_p_candidates(probs, ks, ps, window=vocab)
    if window < vocab:
        assert not complete.all()
    for i in range(n):
        v, t = (vals[i], ids[i]) if complete[i] else (full_vals[i], full_ids[i])
        got = torch.zeros(vocab, dtype=torch.bool)
        got[t[v > 0]] = True
        assert torch.equal(got, expected[i]), i


@pytest.mark.parametrize("vocab", [5, 1000])  # one cumsum / chunk sums + a cumsum in one chunk
def test_inverse_cdf_sample_is_exact_on_unnormalized_weights(vocab: int) -> None:
    torch.manual_seed(0)
    n = 40000
    places = [1, 3, 4] if vocab == 5 else [1, 255, 256, 999]
    mass = [2.0, 1.0, 1.0] if vocab == 5 else [2.0, 1.0, 0.5, 0.5]
    weights = torch.zeros(vocab)
    weights[places] = torch.tensor(mass)
    idx = inverse_cdf_sample(weights.expand(n, -1), torch.rand(n))
    freq = torch.bincount(idx, minlength=vocab).float() / n
    expected = weights / weights.sum()
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    # u at the very top never lands on a zero weight.
    top = inverse_cdf_sample(weights.unsqueeze(0), torch.tensor([1.0 - 1e-9]))
    assert top.item() == places[-1]


def test_filters_hold_when_sampling(sampler: Sampler) -> None:
    torch.manual_seed(0)
    n = 4000
    logits = logits_from_probs(PROBS, n)
    for kw, allowed in (({"top_p": 0.7}, {0, 1}), ({"min_p": 0.4}, {0, 1}), ({"top_k": 3}, {0, 1, 2})):
        tokens = set(sampler(logits, [row(temperature=1.0, **kw) for _ in range(n)]).token_ids)
        assert tokens == allowed, kw


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = row(prompt=[0, 1], output=[1, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [r])
    # repetition (prompt+output {0,1,3}): 2 -> 1, -1 -> -2, 3 -> 1.5
    # frequency (output counts 1:1, 3:2) and presence (output {1,3}):
    #   token 1: -2 - 0.5 - 0.25 = -2.75; token 3: 1.5 - 1.0 - 0.25 = 0.25
    torch.testing.assert_close(logits, torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0]]))


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5], [2.0, 1.0, 0.5]])
    apply_penalties(logits, [row(prompt=[0], output=[1], presence_penalty=1.0), row(prompt=[0], output=[1])])
    torch.testing.assert_close(logits, torch.tensor([[2.0, 0.0, 0.5], [2.0, 1.0, 0.5]]))


def test_greedy_with_repetition_penalty_changes_choice(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5]])
    assert sampler(logits, [row(temperature=0.0, output=[1], repetition_penalty=1.5)]).token_ids == [2]


def test_min_tokens_masks_stop_tokens(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 3.0, 1.0]])  # EOS (2) first, then 3, then 4
    g = dict(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert sampler(logits, [row(output=[5], **g)]).token_ids == [4]  # EOS and stop id 3 masked
    assert sampler(logits, [row(output=[5, 5, 5], **g)]).token_ids == [EOS]  # min_tokens reached
    assert sampler(logits, [row(output=[5], ignore_eos=True, **g)]).token_ids == [EOS]  # EOS not a stop
    # In a batch, only the row still under min_tokens is masked.
    both = sampler(logits.expand(2, -1).clone(), [row(output=[5], **g), row(output=[5, 5, 5], **g)])
    assert both.token_ids == [4, EOS]


def test_logprobs_are_raw_log_softmax_with_ranks(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0, 0.0], [0.5, 0.2, 0.1, 0.0, 4.0]])
    rows = [
        # The repetition penalty pushes token 1 below token 2: the sampled token has rank 2.
        row(temperature=0.0, output=[1], repetition_penalty=1.5, logprobs=3),
        row(temperature=0.5, top_k=1, logprobs=0),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids == [2, 4]
    first, second = out.logprobs
    assert (first.token_id, first.rank) == (2, 2)
    assert math.isclose(first.logprob, raw[0, 2].item(), rel_tol=1e-6)
    assert [t for t, _ in first.top] == [1, 2, 0]
    for t, lp in first.top:
        assert math.isclose(lp, raw[0, t].item(), rel_tol=1e-6)
    # logprobs=0: only the sampled token; raw (temperature-free) logprob.
    assert (second.token_id, second.rank, second.top) == (4, 1, [])
    assert math.isclose(second.logprob, raw[1, 4].item(), rel_tol=1e-6)


def test_logprobs_only_for_rows_that_ask(sampler: Sampler) -> None:
    logits = torch.randn(3, 20)
    out = sampler(logits, [row(temperature=0.0), row(temperature=0.0, logprobs=5), row(temperature=0.0)])
    assert out.logprobs is not None and out.logprobs[0] is None and out.logprobs[2] is None
    assert len(out.logprobs[1].top) == 5
    assert sampler(logits, [row(temperature=0.0)] * 3).logprobs is None


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.1}])
def test_nan_logits_stay_among_the_allowed_tokens(sampler: Sampler, kw) -> None:
    """Logits that overflowed (NaN, +inf: a LoRA with huge weights) softmax to NaN everywhere; the inverse-cdf
    pick then read the last token of the vocabulary, one allowed_token_ids (or a grammar) forbids. The row takes
    its argmax instead: NaN counts as the largest, masked tokens are -inf."""
    logits = torch.randn(3, 50)
    logits[0, 7] = float("nan")
    logits[1, :] = float("nan")
    logits[2, 9] = float("inf")
    rows = [row(temperature=1.0, seed=1, allowed_token_ids=[4, 9, 11], **kw) for _ in range(3)]
    assert all(t in (4, 9, 11) for t in sampler(logits, rows).token_ids)
    assert sampler(logits, rows).token_ids[1:] == [4, 9]


def test_min_tokens_gives_the_stop_token_back_when_the_grammar_allows_nothing_else() -> None:
    """vLLM's MinTokensLogitsProcessor: under min_tokens a structured-output row whose grammar mask left only
    the stop token samples it (the grammar is complete) instead of a token the grammar refuses; a row without a
    grammar, or with other tokens left, keeps its stop token masked."""
    from tokenloom.model.sampler import apply_min_tokens
    from tokenloom.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams(json={"type": "boolean"})
    only_eos = torch.full((3, 4), float("-inf"))
    only_eos[:, EOS] = -0.1
    rows = [row(min_tokens=5, max_tokens=8, structured_outputs=grammar), row(min_tokens=5, max_tokens=8)]
    apply_min_tokens(only_eos[:2], rows)
    assert only_eos[0, EOS] == -0.1 and torch.isneginf(only_eos[1]).all()
    open_row = torch.tensor([[-1.0, -2.0, -0.1, float("-inf")]])
    apply_min_tokens(open_row, rows[:1])
    assert torch.isneginf(open_row[0, EOS]) and open_row[0, 0] == -1.0
