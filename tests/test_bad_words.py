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
    with pytest.raises(ValueError, match="bad_words cannot contain an empty string"):  # vLLM's, when made
        SamplingParams(bad_words=["a", ""])
    with pytest.raises(ValueError, match="bad_words entries must tokenize to at least one token"):
        _ids(tokenizer, "   ")  # nothing to ban once left-stripped
    with pytest.raises(ValueError, match=r"vocabulary size is 20000, but the following tokens were specified as "
                                         r"bad: \[29856\]"):
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


# --------------------------------------------------------------------------- through the engine

# Greedy continuations of the default model (float path): " small town nestled in the heart of a bustling
# city. The town was known for ..." (" town" twice, " was" after the second), and " sat on the mat.\n\n..."
# after a prompt that repeats "sat on the mat", so n-gram drafts propose " mat" right after " the".
PROMPTS = ["Once upon a time, there was a",
           "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"]
WORDS = [["town was"], ["the mat"], ["town"]]
FLOAT = dict(quantization="none", dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


def _first_ban(tokens: list[int], sequences: list[list[int]]) -> int | None:
    """The index of the first output that completes one of `sequences` (all of it among the outputs)."""
    for k in range(len(tokens)):
        if any(len(s) <= k + 1 and tokens[k + 1 - len(s) : k + 1] == s for s in sequences):
            return k
    return None


def _generate(llm: Any, words: list[str] | None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=words)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _close(llm: Any) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    try:
        assert kv.block_pool.get_num_free_blocks() == kv.num_blocks, "blocks leaked"
    finally:
        llm.llm_engine.close()


@pytest.fixture(scope="module")
def plain_runs() -> dict[str, Any]:
    """The plain synchronous engine's greedy tokens: without bad words, and with each of WORDS (and the
    words' token-id sequences, as the engine's input processor made them)."""
    from tokenloom import LLM

    llm = LLM(None, **FLOAT)
    try:
        sequences = {w[0]: llm.llm_engine.input_processor.process_params(SamplingParams(bad_words=w))
                     .bad_words_token_ids for w in WORDS}  # fmt: skip
        return {"free": _generate(llm, None), "banned": {w[0]: _generate(llm, w) for w in WORDS},
                "sequences": sequences}
    finally:
        _close(llm)


@pytest.mark.slow
def test_greedy_generation_avoids_the_word_exactly_where_it_would_complete(plain_runs) -> None:
    free, sequences = plain_runs["free"], plain_runs["sequences"]
    assert sequences["town was"] == [[19090, 436], [3102, 436]]  # "town was", " town was"
    assert sequences["town"] == [[19090], [3102]]
    for word, outputs in plain_runs["banned"].items():
        for prompt, want, got in zip(PROMPTS, free, outputs):
            k = _first_ban(want, sequences[word])
            assert _first_ban(got, sequences[word]) is None, (word, prompt)
            if k is None:  # the word never came up: nothing changes
                assert got == want, (word, prompt)
                continue
            # Token for token the same up to the token that would complete the word, then another one.
            assert got[:k] == want[:k] and got[k] != want[k], (word, prompt, k)
    # A multi-token word is banned only after its prefix: " town" is still generated, twice (once before
    # " nestled", then where " was" followed it), and " was" elsewhere would be too.
    town_was = plain_runs["banned"]["town was"][0]
    assert town_was.count(3102) == 2 and town_was[:13] == free[0][:13] and town_was[13] != 436
    # " the" (the prefix) is still generated, only " mat" never after it.
    the_mat = plain_runs["banned"]["the mat"][1]
    assert the_mat[:3] == free[1][:3] == [2643, 335, 260] and free[1][3] == 1171 and the_mat[3] != 1171
    # A one-token word is never generated, in either form.
    assert not {19090, 3102} & set(plain_runs["banned"]["town"][0]) and 3102 in free[0]


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(speculative_config=NGRAM), dict(async_scheduling=True),
                                   dict(speculative_config=NGRAM, async_scheduling=True)],
                         ids=["ngram", "async", "async-ngram"])
def test_bad_words_give_the_same_tokens_with_drafts_and_async_scheduling(plain_runs, knobs) -> None:
    """No output holds a banned sequence, and the tokens are the plain engine's, word for word. With drafts,
    " the mat" is proposed from the prompt: the " mat" draft must be rejected because the " the" draft
    before it is the prefix."""
    from tokenloom import LLM

    llm = LLM(None, **FLOAT, **knobs)
    try:
        got = {w[0]: _generate(llm, w) for w in WORDS}
        if "speculative_config" in knobs:
            stats = llm.llm_engine.scheduler.spec_decoding_totals
            assert stats is not None and stats.num_draft_tokens > 0
    finally:
        _close(llm)
    for word, outputs in got.items():
        assert all(_first_ban(tokens, plain_runs["sequences"][word]) is None for tokens in outputs), word
    assert got == plain_runs["banned"]
