"""vLLM 0.32's bad_words (SamplingParams.bad_words): the words tokenized as vLLM's update_from_tokenizer
does (on the default model's real tokenizer), the sampler's ban (a sequence's last token, once the outputs
end with the rest of it: never on the prompt), the same ban where the prefix ends in drafts being verified,
and greedy generation through the engine (the default model on the float path, where greedy tokens do not
depend on the batch shape): plain, with n-gram drafts, with async scheduling, and with both."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.sampling_params import SamplingParams

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
