"""LLM.beam_search constrained by structured outputs (vLLM 0.32's offline rule, tokenloom/engine/beam_search.py).

The step rule without a model (which tokens a beam's step may send and keep, a finished grammar completing its
beam, allowed_token_ids always sent), then the tiny random llama on the float path: every returned sequence satisfies
its regex / choice / JSON schema, also with length_penalty and concurrency_limit. A random model makes the point
sharper than a trained one: left alone it would write anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest

from tokenloom.engine import beam_search as bs
from tokenloom.engine.beam_search import BeamSearchInstance, BeamSearchSequence, constrained_step_params
from tokenloom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenloom.logprobs import Logprob
from tokenloom.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

EOS = 2


# The per-step rule, with a stand-in grammar -------------------------------------------------------------------
class FakeGrammar:
    """Allows `allowed[len(generated)]` after `generated` tokens; None past the end (the grammar has ended)."""

    def __init__(self, allowed: list[list[int]]) -> None:
        self.allowed = allowed

    def allowed_next(self, generated: Sequence[int]) -> list[int] | None:
        return self.allowed[len(generated)] if len(generated) < len(self.allowed) else None


def _output(logprobs: dict[int, float]) -> RequestOutput:
    lps = {t: Logprob(lp) for t, lp in logprobs.items()}
    comp = CompletionOutput(index=0, text="", token_ids=[next(iter(lps))], logprobs=[lps], finish_reason="length")
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], prompt_logprobs=None, outputs=[comp],
                         finished=True, metrics=RequestMetrics(arrival_time=0.0))


def test_step_sends_every_allowed_id_and_keeps_only_allowed_candidates() -> None:
    base = SamplingParams(logprobs=4, max_tokens=1, temperature=0.0)
    prompt = {"type": "token", "prompt_token_ids": [9, 9]}
    beam = BeamSearchSequence(prompt, tokens=[9, 9], logprobs=[])
    [(params, allowed)] = constrained_step_params([beam], base, FakeGrammar([[5, 6, 7]]))
    assert params.allowed_token_ids == [5, 6, 7] and allowed == {5, 6, 7} and params.logprobs == 4
    many = list(range(10, 3000))  # past vLLM's 1024 cap: still sent, so the sampled token is an allowed one
    [(params, allowed)] = constrained_step_params([beam], base, FakeGrammar([many]))
    assert params.allowed_token_ids == many and allowed == set(many)

    # The step's raw logprobs (from before the mask) name tokens the grammar forbids: they are no candidates.
    sent: list[Any] = []

    def run_step(prompts: list[dict[str, Any]], params: Any) -> list[RequestOutput]:
        sent.append(params)
        return [_output({1: -0.1, 5: -1.0, 8: -0.2, 7: -2.0})]

    instance = BeamSearchInstance(prompt)
    assert not bs._offline_step([instance], base, run_step, EOS, False, 4, FakeGrammar([[5, 6, 7], [EOS]]))
    assert sorted(b.tokens[-1] for b in instance.beams) == [5, 7]
    assert [p.allowed_token_ids for p in sent[0]] == [[5, 6, 7]]


def test_a_beam_whose_grammar_ended_is_completed_and_an_empty_one_dropped() -> None:
    base = SamplingParams(logprobs=4, max_tokens=1, temperature=0.0)
    prompt = {"type": "token", "prompt_token_ids": [9]}
    calls: list[list[list[int]]] = []

    def run_step(prompts: list[dict[str, Any]], params: Any) -> list[RequestOutput]:
        calls.append([p["prompt_token_ids"] for p in prompts])
        return [_output({5: -0.5, 6: -0.7}) for _ in prompts]

    instance = BeamSearchInstance(prompt)
    done = BeamSearchSequence(prompt, tokens=[9, 5], logprobs=[{}], cum_logprob=-0.5)
    live = BeamSearchSequence(prompt, tokens=[9, 6], logprobs=[{}], cum_logprob=-0.7)
    instance.beams = [done, live]
    grammar = FakeGrammar([[5, 6], [5]])

    class EndsAfterFive(FakeGrammar):
        def allowed_next(self, generated: Sequence[int]) -> list[int] | None:
            return None if generated == [5] else super().allowed_next(generated)

    assert not bs._offline_step([instance], base, run_step, EOS, False, 2, EndsAfterFive(grammar.allowed))
    assert instance.completed == [done]  # ended by its grammar: finished as it stands, not sent to the engine
    assert calls == [[[9, 6]]] and [b.tokens for b in instance.beams] == [[9, 6, 5]]  # 6 is not allowed there

    # A grammar that allows nothing at the start: the beam generated nothing, so nothing is completed.
    fresh = BeamSearchInstance(prompt)
    assert bs._offline_step([fresh], base, run_step, EOS, False, 2, FakeGrammar([]))
    assert fresh.completed == [] and fresh.beams == []


def test_beam_search_params_take_structured_outputs() -> None:
    so = StructuredOutputsParams(choice=["a", "b"])
    assert BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=so).structured_outputs is so
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs={"choice": ["a"]})  # type: ignore[arg-type]


# The tiny random model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.tiny_models import make_tiny_hf_model
    from tokenloom import LLM

    # The float path: batch-invariant, so concurrency_limit cannot change a search (as in test_beam_search.py).
    engine = LLM(str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)),
                 quantization="none", dtype="float32", max_model_len=256, kv_cache_memory=64 << 20)
    yield engine
    engine.shutdown()


PROMPTS = ["hello there", "def main", "x"]
REGEX = r"[0-9]{2,3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


def _generated(llm: Any, seq: BeamSearchSequence) -> str:
    return llm.get_tokenizer().decode(seq.tokens[len(seq.orig_prompt["prompt_token_ids"]):],
                                      skip_special_tokens=True)


def _check(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


SO = {"regex": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=CHOICES),
      "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)}


@pytest.mark.parametrize("kind", ["regex", "choice", "json"])
def test_every_sequence_satisfies_the_constraint(llm: Any, kind: str) -> None:
    # max_tokens leaves room for each (bounded) grammar to end: every beam then finishes with EOS.
    params = BeamSearchParams(beam_width=3, max_tokens=24, structured_outputs=SO[kind])
    outputs = llm.beam_search(PROMPTS, params)
    for output in outputs:
        assert output.sequences
        for seq in output.sequences:
            _check(kind, _generated(llm, seq))
            assert seq.tokens[-1] == EOS
    scores = [[bs.get_beam_search_score(s.tokens, s.cum_logprob, EOS) for s in o.sequences] for o in outputs]
    assert all(s == sorted(s, reverse=True) for s in scores)


def test_with_ignore_eos_the_grammar_end_completes_the_beam(llm: Any) -> None:
    # EOS does not finish a beam here; the grammar, having accepted it, has terminated: the beam is done, long
    # before max_tokens (unconstrained, ignore_eos runs every beam to max_tokens).
    params = BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True, structured_outputs=SO["choice"])
    for output in llm.beam_search(PROMPTS, params):
        assert output.sequences  # not dropped: completed by the grammar
        for seq in output.sequences:
            generated = seq.tokens[len(seq.orig_prompt["prompt_token_ids"]):]
            assert generated[-1] == EOS and len(generated) < 20
            assert _generated(llm, seq) in CHOICES


@pytest.mark.parametrize("length_penalty", [0.0, 2.0])
def test_with_length_penalty_and_concurrency_limit(llm: Any, length_penalty: float) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=24, length_penalty=length_penalty, structured_outputs=SO["json"])
    together = llm.beam_search(PROMPTS, params)
    one_at_a_time = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    for a, b in zip(together, one_at_a_time):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for seq in a.sequences:
            _check("json", _generated(llm, seq))
        scores = [bs.get_beam_search_score(s.tokens, s.cum_logprob, EOS, length_penalty) for s in a.sequences]
        assert scores == sorted(scores, reverse=True)


def test_an_invalid_constraint_is_refused_before_any_step(llm: Any) -> None:
    bad = StructuredOutputsParams(json={"type": "integer", "multipleOf": 5})
    with pytest.raises(ValueError, match="not supported by xgrammar"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=bad))


@pytest.mark.slow
def test_a_trained_model_keeps_its_beams_where_its_top_tokens_are_all_forbidden() -> None:
    """The default model after "A code:100-" wants more digits: none of its top raw logprobs is a letter, and
    4,892 tokens are allowed. Sent vLLM's way (no mask past 1024 ids) every beam died and the search returned
    nothing; masked, the sampled token is an allowed one and the beams go on."""
    from tokenloom import LLM

    llm = LLM()
    try:
        pattern = r"[0-9]{3}-[a-z]{4}"
        out = llm.beam_search(["A code:"], BeamSearchParams(beam_width=2, max_tokens=12,
                                                             structured_outputs=StructuredOutputsParams(regex=pattern)))
        texts = [s.text.removeprefix("A code:") for s in out[0].sequences]
        assert texts and all(re.fullmatch(pattern, t) for t in texts), texts
    finally:
        llm.shutdown()
