"""The n-gram proposer against vLLM 0.32's examples (tests/v1/spec_decode/test_ngram.py) and its KMP,
in both the compiled (numba) and the numpy version."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.spec_decode import ngram_proposer as ng
from tokenloom.spec_decode.ngram_proposer import NgramProposer, propose_numpy_one, propose_one_reference

VERSIONS = [False] + ([True] if ng.HAVE_NUMBA else [])


@pytest.mark.parametrize("use_numba", VERSIONS)
@pytest.mark.parametrize(
    "context,min_n,max_n,k,max_model_len,expected",
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, 100, [4, 1, 2]),
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, 9, [4, 1]),  # k capped at max_model_len - len
        ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, 100, [1, 2]),  # the 4-gram wins
        ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, 100, [100, 1]),  # earliest
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, 100, [6, 2]),
        ([5, 5, 5, 5], 2, 2, 3, 100, [5, 5]),  # overlaps the suffix
        ([1, 2, 3, 4, 5], 2, 2, 3, 100, []),  # no match
        ([1], 2, 2, 3, 100, []),  # shorter than min_n
        ([1, 2, 1, 2], 2, 2, 3, 4, []),  # at max_model_len
    ],
)
def test_vllm_examples(use_numba, context, min_n, max_n, k, max_model_len, expected):
    arr = np.asarray(context, dtype=np.int32)
    assert propose_one_reference(arr, min_n, max_n, max_model_len, k) == expected
    s, c = propose_numpy_one(arr, min_n, max_n, max_model_len, k)
    assert arr[s : s + c].tolist() == expected
    p = NgramProposer(k, min_n, max_n, max_model_len, use_numba=use_numba)
    p.add_request("r", context)
    assert p.propose(["r"]) == [expected]


@pytest.mark.parametrize("use_numba", VERSIONS)
def test_multibatch_unknown_and_removed(use_numba):
    # upstream: [[1,2,3,1,2],[4,5,6]] with min 1, max 2, k 2 -> [3,1], [].
    p = NgramProposer(2, 1, 2, 100, use_numba=use_numba, initial_rows=1)  # rows grow on demand
    p.add_request("a", [1, 2, 3, 1, 2])
    p.add_request("b", [4, 5, 6])
    assert p.propose(["a", "b", "missing"]) == [[3, 1], [], []]
    p.append_tokens("b", [4, 5])
    assert p.propose(["b"]) == [[6, 4]]
    p.remove_request("a")
    assert p.propose(["a"]) == [[]]
    p.add_request("c", [7, 7, 7])
    assert p.propose(["c"], k=1) == [[7]]


@pytest.mark.parametrize("use_numba", VERSIONS)
def test_matches_vllm_kmp_on_random_contexts(use_numba):
    rng = np.random.default_rng(0)
    p = NgramProposer(5, 1, 5, 64, use_numba=use_numba)
    for trial in range(300):
        vocab = int(rng.integers(1, 6))
        ctx = rng.integers(0, vocab, int(rng.integers(1, 60))).astype(np.int32)
        mn = int(rng.integers(1, 4))
        mx = mn + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        q = NgramProposer(k, mn, mx, 64, use_numba=use_numba) if trial % 30 == 0 else p
        if q is p:
            k, mn, mx = 5, 1, 5
        q.add_request("x", ctx.tolist())
        assert q.propose(["x"]) == [propose_one_reference(ctx, mn, mx, 64, k)], (ctx.tolist(), mn, mx, k)
