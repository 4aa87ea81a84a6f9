"""The offline API under malformed arguments (hypothesis): `LLM.generate` / `chat` / `beam_search` on a generation
model and `embed` / `classify` / `score` / `encode` on a pooling model either answer or raise ValueError /
TypeError with a message that names what is wrong, and leave the engine as they found it: no request queued
before the bad one was found stays behind, and the same greedy request gives the same tokens afterwards.
The server's side of the same rule is tests/test_malformed_sweep.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.pooling_models import make_tiny_bert
from tests.test_malformed_sweep import GARBAGE, SWEEP, UNCLEAR
from tests.tiny_models import TINY_VOCAB, make_tiny_hf_model
from tokenloom import LLM, BeamSearchParams, PoolingParams, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

_PROMPTS = st.one_of(
    GARBAGE,
    st.sampled_from(["hi", "", [], [[]], [TINY_VOCAB], [-1], [2**63], [1.5], [True], [None], {"x": 1},
                     {"prompt": 5}, {"prompt_token_ids": "ab"}, {"prompt_token_ids": [TINY_VOCAB]}, ["hi", [10**6]],
                     ["hi", None], "hello " * 400, b"bytes", ("hi", "ho"), 5, None]),
)
_PARAM_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens",
                 "min_tokens", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "logprob_token_ids",
                 "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "structured_outputs", "extra_args"]
_HOSTILE_VALUES = st.sampled_from([float("nan"), float("inf"), -float("inf"), 2**63, -(2**63) - 1, 10**30,
                                   {TINY_VOCAB: 1.0}, {1: float("nan")}, {1: "x"}, [TINY_VOCAB], [-1], [], "x", 5,
                                   {"regex": "(ab"}, (1, 2), {1, 2}])


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    fields = draw(st.lists(st.sampled_from(_PARAM_FIELDS), max_size=3, unique=True))
    return {f: draw(GARBAGE | _HOSTILE_VALUES) for f in fields}


def _holds_the_rule(call: Any) -> Any:
    """Run `call`: it answers, or raises ValueError / TypeError with a message naming the problem."""
    try:
        return call()
    except (ValueError, TypeError) as exc:
        assert str(exc) and not UNCLEAR.search(str(exc)), f"an unclear message: {type(exc).__name__}: {exc}"
        return exc


def _idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.output_processor.num_unfinished()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=7)
    llm = LLM(str(model_dir), dtype="float32", num_blocks=256, block_size=4)
    llm.reference = llm.generate(["The quick brown"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def pooling_llm(tmp_path_factory):
    model_dir = make_tiny_bert(tmp_path_factory.mktemp("bert"), sentence_transformers_pooling="mean", seed=4)
    llm = LLM(str(model_dir), dtype="float32")
    yield llm
    llm.shutdown()


@SWEEP
@given(prompts=_PROMPTS, kwargs=sampling_kwargs(),
       priority=st.none() | GARBAGE | st.sampled_from([[0], [0, 0], ["x"], 3, [2**63]]),
       many_params=st.booleans())
def test_generate_with_malformed_arguments(llm, prompts, kwargs, priority, many_params) -> None:
    params = _holds_the_rule(lambda: SamplingParams(**{"max_tokens": 3, **kwargs}))
    if isinstance(params, Exception):
        params = kwargs  # a dict where a SamplingParams goes: the generate call must refuse it too
    if many_params:
        params = [params, params]
    _holds_the_rule(lambda: llm.generate(prompts, params, use_tqdm=False, priority=priority))
    _idle(llm)


_MESSAGES = st.one_of(
    GARBAGE,
    st.sampled_from([[{}], [{"role": None}], [{"role": "user", "content": 5}], [{"role": "user"}], [[]],
                     [[{"role": "user", "content": "x"}], "x"], "hi", [5], None, [{"role": "user", "content": [1]}],
                     [{"role": "user", "content": {"a": 1}}], [{"role": 5, "content": "x"}]]),
)


@SWEEP
@given(messages=_MESSAGES)
def test_chat_with_malformed_messages(llm, messages) -> None:
    _holds_the_rule(lambda: llm.chat(messages, GREEDY, use_tqdm=False))
    _idle(llm)


@SWEEP
@given(prompts=_PROMPTS, width=GARBAGE | st.sampled_from([0, 1, 2, 2**40]), max_tokens=st.sampled_from([0, 2, -1]))
def test_beam_search_with_malformed_arguments(llm, prompts, width, max_tokens) -> None:
    params = _holds_the_rule(lambda: BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    _holds_the_rule(lambda: llm.beam_search(prompts, params))
    _idle(llm)


_POOLING_FIELDS = ["truncate_prompt_tokens", "dimensions", "normalize", "use_activation", "task"]


@SWEEP
@given(method=st.sampled_from(["embed", "classify", "encode", "score"]), prompts=_PROMPTS, other=_PROMPTS,
       fields=st.dictionaries(st.sampled_from(_POOLING_FIELDS), GARBAGE | _HOSTILE_VALUES, max_size=2))
def test_pooling_with_malformed_arguments(pooling_llm, method, prompts, other, fields) -> None:
    params = _holds_the_rule(lambda: PoolingParams(**fields))
    if isinstance(params, Exception):
        params = fields
    if method == "score":
        _holds_the_rule(lambda: pooling_llm.score(prompts, other, use_tqdm=False, pooling_params=params))
    else:
        _holds_the_rule(lambda: getattr(pooling_llm, method)(prompts, params, use_tqdm=False))
    _idle(pooling_llm)


def test_engines_unchanged_after_the_sweeps(llm, pooling_llm) -> None:
    assert llm.generate(["The quick brown"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == llm.reference
    emb = pooling_llm.embed(["a cat"], use_tqdm=False)[0].outputs.embedding
    assert len(emb) == 32 and all(math.isfinite(x) for x in emb)


# The regressions the sweep found, each pinned by one example -------------------------------------------------
@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda llm: llm.generate(["a", "b"], GREEDY, priority=[0]), ValueError, "priority: 1 value"),  # IndexError
    (lambda llm: llm.generate(["a"], GREEDY, priority=["x"]), TypeError, "priority must be"),  # was accepted
    (lambda llm: llm.generate(5, GREEDY), TypeError, "prompts must be"),  # 'int' object is not iterable
    (lambda llm: llm.generate(["a"], {"temperature": 0}), TypeError, "sampling_params must be"),  # replace()
    (lambda llm: llm.generate(["a"], SamplingParams(logit_bias={TINY_VOCAB: 1.0})), ValueError, "logit_bias"),
    (lambda llm: llm.generate(["a"], SamplingParams(allowed_token_ids=[TINY_VOCAB])), ValueError,
     "allowed_token_ids"),  # both were accepted: check_vocab was never called
    (lambda llm: llm.generate([{"prompt": 5}], GREEDY), ValueError, "'prompt' must be a string"),
    (lambda llm: llm.chat([{"content": "x"}], GREEDY), ValueError, "needs a 'role'"),  # jinja2 UndefinedError
    (lambda llm: llm.chat([{"role": "user", "content": 5}], GREEDY), ValueError, "'content' must be"),
    (lambda llm: llm.chat([{"role": "user", "content": [5]}], GREEDY), ValueError, "only text parts are supported"),
    (lambda llm: llm.chat([5], GREEDY), TypeError, "messages must be"),
    (lambda llm: SamplingParams(top_p="x"), ValueError, "top_p must be a number"),  # '<' not supported
    (lambda llm: SamplingParams(stop=5), ValueError, "stop must be a list"),  # 'int' object is not iterable
    (lambda llm: SamplingParams(logit_bias={1: float("nan")}), ValueError, "finite"),  # NaN bias reached logits
    (lambda llm: SamplingParams(allowed_token_ids=float("nan")), ValueError, "allowed_token_ids"),  # not iterable
])
def test_offline_regressions(llm, call, error, words) -> None:
    with pytest.raises(error, match=words):
        call(llm)
    _idle(llm)


@pytest.mark.parametrize(("call", "error", "words"), [
    # unhashable type: 'dict'; now vLLM 0.32's refusal of a multimodal score input on a text model
    (lambda llm: llm.score("a", {"text": "b"}), ValueError, "MultiModalParam is not supported for BertModel"),
    (lambda llm: llm.score(None, "b"), TypeError, "data_1 must be a text"),  # 'NoneType' object is not iterable
    (lambda llm: llm.embed(["a"], PoolingParams(truncate_prompt_tokens={})), ValueError,
     "truncate_prompt_tokens must be an int"),  # '<' not supported between instances of 'dict' and 'int'
    (lambda llm: llm.embed(["a"], {"normalize": True}), TypeError, "pooling_params must be"),
])
def test_offline_pooling_regressions(pooling_llm, call, error, words) -> None:
    with pytest.raises(error, match=words):
        call(pooling_llm)
    _idle(pooling_llm)
