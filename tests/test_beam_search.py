"""LLM.beam_search on the default model (SmolLM2-135M-Instruct): vLLM's algorithm over the engine.

Checked against an independent beam search over transformers' logprobs on the same GGUF weights, against
greedy decoding (beam_width 1), against the length-penalty formula, for prefix-cache reuse and for KV
blocks all returned; plus the score formula and the early stop on their own.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tokenloom.engine.beam_search import (
    BeamSearchSequence,
    beam_search_offline,
    get_beam_search_score,
    search_is_decided,
)
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import BeamSearchParams, SamplingParams

QUESTIONS = ["Is water wet? Answer yes or no.", "What is 2+2?", "Say hi."]


# The formula and the early stop, without a model ---------------------------------------------------------------
def test_score_is_cum_logprob_over_length_to_the_penalty_without_a_final_eos() -> None:
    eos = 2
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos, 1.0) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, eos], -2.0, eos, 1.0) == pytest.approx(-2.0 / 3)  # EOS not counted
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos, 0.0) == -2.0
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos, 2.0) == pytest.approx(-2.0 / 16)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos, 1e300) == 0.0  # the limit, not an OverflowError
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos, -1e300) == -math.inf


def _seq(tokens: list[int], cum: float) -> BeamSearchSequence:
    return BeamSearchSequence({"prompt_token_ids": tokens[:1]}, tokens=tokens, logprobs=[], cum_logprob=cum)


def test_search_is_decided_only_when_no_later_beam_can_outscore_the_finished_ones() -> None:
    eos = 2
    done = [_seq([1, 5, eos], -0.5), _seq([1, 6, eos], -0.6)]  # scores -0.25, -0.3 at length_penalty 1
    live = [_seq([1, 7, 8], -3.0)]  # anything later: cum <= -3 at length <= 10, so score <= -0.3
    assert not search_is_decided(done[:1], live, 2, eos, 1.0, max_len=10)  # fewer than beam_width finished
    assert search_is_decided(done, live, 2, eos, 1.0, max_len=9)  # bound -3/9 = -0.33 < -0.3
    assert not search_is_decided(done, live, 2, eos, 1.0, max_len=10)  # bound -0.3: a tie could reorder
    assert not search_is_decided(done, live, 2, eos, 3.0, max_len=10)  # -3/1000 beats them all
    assert search_is_decided(done, [], 2, eos, 1.0, max_len=10)  # no live beam left


def test_beam_search_params_validation() -> None:
    for kwargs, word in [({"beam_width": 0}, "beam_width"), ({"beam_width": 2.0}, "beam_width"),
                         ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                         ({"length_penalty": float("nan")}, "length_penalty")]:
        with pytest.raises(ValueError, match=word):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


# The default model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    # The dequantized float path: its kernels give a row the same numbers whatever batch it shares,
    # which beam width 1 == greedy and the transformers reference need. The default quantized path
    # is not batch-invariant (fused decode step, small-batch tiles and the prefill GEMM sum the
    # same integer products in different float orders; docs/performance.md).
    return LLM(dtype="float32", quantization="none")


def _chat_ids(llm: LLM, question: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}],
                                                   add_generation_prompt=True, tokenize=True)


@pytest.mark.slow
def test_beam_width_1_is_greedy(llm) -> None:
    prompts = [{"prompt_token_ids": _chat_ids(llm, q)} for q in QUESTIONS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for prompt, g, b in zip(prompts, greedy, beams):
        [seq] = b.sequences
        n = len(prompt["prompt_token_ids"])
        assert seq.tokens[:n] == prompt["prompt_token_ids"]
        assert seq.tokens[n:] == g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-4)
        assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # offline: the prompt's text included


@functools.lru_cache(maxsize=256)
def _hf_next_logprobs(hf, tokens: tuple[int, ...]) -> torch.Tensor:
    """transformers' next-token log-softmax after `tokens` (cached: two cases below search the same beams and
    differ only in their final ranking)."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)


def _reference_beam_search(hf, prompt: list[int], width: int, steps: int, eos: int, ignore_eos: bool,
                           length_penalty: float) -> list[tuple[list[int], float]]:
    """The same search written out over transformers' log-softmax: each beam's top 2*width tokens are
    its candidates, the best `width` by cumulative logprob live on, EOS ends a beam, and the finished
    and live beams are ranked by cum / len ** length_penalty (len: prompt + output, EOS not counted)."""
    beams: list[tuple[list[int], float]] = [(prompt, 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            top = _hf_next_logprobs(hf, tuple(tokens)).topk(2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                (finished if tok == eos and not ignore_eos else candidates).append((tokens + [tok], cum + lp))
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
    finished += beams

    def score(c: tuple[list[int], float]) -> float:
        return c[1] / (len(c[0]) - (c[0][-1] == eos and not ignore_eos)) ** length_penalty

    return sorted(finished, key=score, reverse=True)[:width]


@pytest.mark.slow
def test_equals_a_beam_search_over_transformers_logprobs(llm, transformers_default_model) -> None:
    hf = transformers_default_model
    eos = llm.get_tokenizer().eos_token_id
    cases = [(QUESTIONS[0], 3, 5, False, 1.0), (QUESTIONS[0], 3, 5, False, 0.0), (QUESTIONS[1], 3, 3, True, 1.0)]
    for question, width, steps, ignore_eos, lp in cases:
        prompt = _chat_ids(llm, question)
        [ours] = llm.beam_search([{"prompt_token_ids": prompt}],
                                 BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=ignore_eos,
                                                  length_penalty=lp))
        ref = _reference_beam_search(hf, prompt, width, steps, eos, ignore_eos, lp)
        assert [s.tokens for s in ours.sequences] == [t for t, _ in ref], (question, width)
        assert [s.cum_logprob for s in ours.sequences] == pytest.approx([c for _, c in ref], abs=2e-3)
        if not ignore_eos:  # the case finishes some beams with EOS, so the EOS rule is exercised
            assert any(s.tokens[-1] == eos for s in ours.sequences)


@pytest.mark.slow
def test_length_penalty_ranks_by_the_formula(llm) -> None:
    """The beams searched do not depend on length_penalty, only their final ranking does: the first
    answer under each penalty is the best, by that penalty's score, of every sequence any run returned."""
    prompt = _chat_ids(llm, QUESTIONS[0])
    eos = llm.get_tokenizer().eos_token_id
    runs = {lp: llm.beam_search([{"prompt_token_ids": prompt}],
                                BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=lp))[0].sequences
            for lp in (-1.0, 0.0, 1.0, 3.0)}
    pool = {tuple(s.tokens): s.cum_logprob for seqs in runs.values() for s in seqs}
    for lp, seqs in runs.items():
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, lp) for s in seqs]
        assert scores == sorted(scores, reverse=True), lp
        best = max(get_beam_search_score(list(t), c, eos, lp) for t, c in pool.items())
        assert scores[0] == best, lp
    orders = {lp: [tuple(s.tokens) for s in seqs] for lp, seqs in runs.items()}
    assert orders[0.0] != orders[3.0]  # this prompt's answers differ in length, so the penalty matters
    by_cum = sorted(runs[0.0], key=lambda s: -s.cum_logprob)
    assert [s.tokens for s in runs[0.0]] == [s.tokens for s in by_cum]  # penalty 0: plain cumulative logprob


@pytest.mark.slow
def test_early_stop_returns_what_running_every_step_returns(llm) -> None:
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    prompts = [{"prompt_token_ids": _chat_ids(llm, q), "prompt": None} for q in QUESTIONS[:2]]
    params = BeamSearchParams(beam_width=2, max_tokens=16)
    calls = {True: 0, False: 0}
    results = {}
    for early in (True, False):
        def run_step(step_prompts, step_params, early=early):
            calls[early] += 1
            return llm.generate(step_prompts, step_params, use_tqdm=False)

        results[early] = beam_search_offline(prompts, params, run_step, lambda ids, skip: tok.decode(ids), eos,
                                             early_stop=early)
    for a, b in zip(results[True], results[False]):
        assert [(s.tokens, s.cum_logprob) for s in a.sequences] == [(s.tokens, s.cum_logprob) for s in b.sequences]
    assert calls[False] == 16 and calls[True] < calls[False]


@pytest.mark.slow
def test_reuses_the_prefix_cache_and_frees_every_block(llm) -> None:
    engine = llm.llm_engine
    prompt = _chat_ids(llm, "Write one sentence about the sea.")
    before = engine.scheduler.make_stats()
    width, steps = 3, 6
    [out] = llm.beam_search([{"prompt_token_ids": prompt}],
                            BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    after = engine.scheduler.make_stats()
    assert len(out.sequences) == width
    block = engine.cache_config.block_size
    # Every step after the first re-sends each beam's prefix: at least the prompt's full blocks are hits.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= (steps - 1) * width * (len(prompt) // block) * block
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks  # every step's blocks came back
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_text_prompts_and_concurrency_limit(llm) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    texts = ["The capital of France is", "One, two, three,"]
    together = llm.beam_search(texts, params)
    one_at_a_time = llm.beam_search([{"prompt": t} for t in texts], params, concurrency_limit=1)
    for a, b, text in zip(together, one_at_a_time, texts):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert a.sequences[0].text.startswith(text) and len(a.sequences) == 2
    with pytest.raises(ValueError, match="beam_width=11"):
        llm.beam_search(texts, BeamSearchParams(beam_width=11, max_tokens=2))  # 22 logprobs > max_logprobs 20
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.beam_search(texts, params, lora_request=object())
    from tokenloom.lora.request import LoRARequest

    with pytest.raises(ValueError, match="LoRA is not enabled"):  # beam search with adapters: tests/test_lora.py
        llm.beam_search(texts, params, lora_request=LoRARequest("a", 1, "/nowhere"))
