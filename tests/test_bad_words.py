"""vLLM 0.32's bad_words (SamplingParams.bad_words): the words tokenized as vLLM's update_from_tokenizer
does (on the default model's real tokenizer), the sampler's ban (a sequence's last token, once the outputs
end with the rest of it: never on the prompt), the same ban where the prefix ends in drafts being verified,
and greedy generation through the engine (the default model on the float path, where greedy tokens do not
depend on the batch shape): plain, with n-gram drafts, with async scheduling, and with both."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenloom.model.rejection_sampler import RejectionSampler, VerifyRequest
from tokenloom.model.sampler import Sampler, SamplingRow
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# --------------------------------------------------------------------------- tokenization


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # SmolLM2's, the default model's


def _ids(tokenizer: Any, *words: str, vocab_size: int | None = None) -> list[list[int]] | None:
    params = SamplingParams(bad_words=list(words))
    params.update_from_tokenizer(tokenizer, vocab_size)
    return params.bad_words_token_ids


def test_words_tokenize_as_vllm_does(tokenizer) -> None:
    # Each word as written (left-stripped) and after a space: the spaced form is kept only when it starts
    # with another token and has as many tokens.
    assert tokenizer.encode("foo", add_special_tokens=False) == [15236]
    assert tokenizer.encode(" foo", add_special_tokens=False) == [29856]
    assert _ids(tokenizer, "foo") == [[15236], [29856]]
    # Leading spaces are stripped first: "the mat" and " the mat" (' the', ' mat').
    assert _ids(tokenizer, "  the mat") == [[1195, 1171], [260, 1171]]
    # " 2018" is a lone space token then the digits (one token longer): not kept. "😀" spaced is shorter.
    assert tokenizer.encode(" 2018", add_special_tokens=False) == [216, 34, 32, 33, 40]
    assert _ids(tokenizer, "2018") == [[34, 32, 33, 40]]
    assert _ids(tokenizer, "😀") == [[10813, 242, 218]]
    # Several words, in order, each with its forms.
    assert _ids(tokenizer, "foo", "2018") == [[15236], [29856], [34, 32, 33, 40]]
    assert SamplingParams().bad_words_token_ids is None


class _Words:
    """A tokenizer of fixed answers, for the rule's case that byte-level BPE rarely shows: a spaced form
    starting with the same token as the plain one."""

    vocab_size = 100

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens  # vLLM tokenizes bad words without BOS
        return self.table[text]


def test_a_spaced_form_starting_with_the_same_token_is_not_kept() -> None:
    same_first = _Words({"ab": [5, 6], " ab": [5, 7]})
    assert _ids(same_first, "ab") == [[5, 6]]
    other_first = _Words({"ab": [5, 6], " ab": [8, 6]})
    assert _ids(other_first, "ab") == [[5, 6], [8, 6]]


def test_bad_words_refused_with_a_clear_message(tokenizer) -> None:
    for value, message in (("foo", "got str"), ({"foo": 1}, "got dict"), ([1], "got an entry of type int"),
                           (["a", None], "got an entry of type NoneType")):
        with pytest.raises(ValueError, match=f"bad_words must be a list of strings, {message}"):
            SamplingParams(bad_words=value)
    for word in ("", "   "):  # nothing to ban once left-stripped
        with pytest.raises(ValueError, match="bad_words entries must tokenize to at least one token"):
            _ids(tokenizer, word)
    with pytest.raises(ValueError, match=r"out of the vocabulary \(size 20000\): \[29856\]"):
        _ids(tokenizer, "foo", vocab_size=20_000)  # " foo" is 29856


# --------------------------------------------------------------------------- the sampler


def _row(words: list[list[int]], prompt: list[int], output: list[int], **kw: Any) -> SamplingRow:
    params = SamplingParams(**{"temperature": 0.0, **kw}, _bad_words_token_ids=words)
    return SamplingRow(params, prompt + output, len(prompt))


def _peaked(rows: int, order: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits ranking `order` first, second, ... in every row."""
    logits = torch.zeros(rows, vocab)
    for rank, token in enumerate(order):
        logits[:, token] = 10.0 - rank
    return logits


def test_a_one_token_word_is_banned_from_the_first_output() -> None:
    sampler = Sampler()
    logits = _peaked(2, [5, 6])
    # An all-greedy batch takes the argmax shortcut when nothing needs processing: bad words must stop it.
    assert sampler(logits, [_row([[5]], [1, 2], []), _row([[5]], [1, 2], [5])]).token_ids == [6, 6]
    assert sampler(logits, [_row([], [1, 2], []), _row([[7]], [1, 2], [])]).token_ids == [5, 5]
    # A random row never draws it either, however likely.
    rows = [_row([[5]], [1], [], temperature=1.0) for _ in range(200)]
    assert 5 not in sampler(_peaked(200, [5, 6]), rows).token_ids


def test_a_multi_token_word_is_banned_only_after_its_prefix_among_the_outputs() -> None:
    sampler = Sampler()
    word = [[3, 5]]
    cases = [
        ([1, 2], [3], 6),  # the outputs end with the prefix: 5 is banned
        ([1, 2], [4, 3], 6),
        ([1, 2], [3, 4], 5),  # the prefix is there, but not last
        ([1, 3], [], 5),  # the prefix ends the prompt: the prompt does not count (vLLM's)
        ([1, 2], [], 5),
    ]
    rows = [_row(word, prompt, output) for prompt, output, _ in cases]
    assert sampler(_peaked(len(rows), [5, 6]), rows).token_ids == [want for _, _, want in cases]
    # A three-token word needs both prefix tokens among the outputs.
    word3 = [[1, 3, 5]]
    rows = [_row(word3, [1], [3]), _row(word3, [0], [1, 3]), _row(word3, [0], [2, 3])]
    assert sampler(_peaked(3, [5, 6]), rows).token_ids == [5, 6, 5]


def test_verification_bans_after_a_prefix_that_ends_in_drafts() -> None:
    """vLLM's apply_bad_words_with_drafts: draft position j sees the outputs plus drafts 0..j-1."""
    word = [[3, 5]]
    targets = torch.stack([_peaked(1, [3, 6])[0], _peaked(1, [5, 6])[0], _peaked(1, [5, 6])[0]])
    # Drafts 3, 5: row 0 accepts 3; row 1 would take 5, but 3 now precedes it, so 6 (the draft 5 rejected).
    params = SamplingParams(temperature=0.0, _bad_words_token_ids=word)
    req = VerifyRequest(SamplingRow(params, [1, 2, 9], 2), [3, 5])
    assert RejectionSampler()(targets, [req]).token_ids == [[3, 6]]
    # Without the word, both drafts and the bonus token are accepted.
    plain = VerifyRequest(SamplingRow(SamplingParams(temperature=0.0), [1, 2, 9], 2), [3, 5])
    assert RejectionSampler()(targets, [plain]).token_ids == [[3, 5, 5]]
    # The bonus row sees every draft: 3 as the last draft bans 5 there too.
    req = VerifyRequest(SamplingRow(params, [1, 2, 9], 2), [3])
    assert RejectionSampler()(targets[:2], [req]).token_ids == [[3, 6]]
