"""Speculative decoding end to end: greedy outputs token-identical to plain decoding (the default
model on chat prompts; a busy batch with chunked prefill and preemption on a tiny model, fused
kernels and torch path), stop strings / EOS inside accepted drafts, seeded sampling, no leaked
blocks, and the config errors before any model loads."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom.config import ConfigError
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams
from tokenloom.workload.grounded import grounded_messages

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _free_all(llm: LLM) -> bool:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    return kv.block_pool.get_num_free_blocks() == kv.num_blocks


def test_bad_speculative_config_fails_before_loading(tmp_path):
    missing = str(tmp_path / "no-such-model")  # would fail later, at load, if the config passed
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(missing, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(missing, speculative_config='{"method": ')
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=2"):
        LLM(None, long_prefill_token_threshold=2, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def _busy_prompts() -> list[dict]:
    # Repetitive prompts, so the n-gram proposer finds matches; lengths vary for chunking.
    return [{"prompt_token_ids": [(i + j % (3 + i % 4)) % 200 + 3 for j in range(18 + 5 * i)]} for i in range(10)]


@pytest.mark.parametrize("kernels,quantization", [("1", None), ("0", None), ("1", "int8")])
def test_busy_batch_greedy_identical(tiny_dir, monkeypatch, kernels, quantization):
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", kernels)
    knobs = dict(dtype="float32", num_blocks=48, block_size=4, max_num_batched_tokens=40, max_num_seqs=8,
                 enable_prefix_caching=True, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_dir), **knobs)
    spec = LLM(str(tiny_dir), speculative_config=NGRAM, **knobs)
    want = [o.outputs[0].token_ids for o in plain.generate(_busy_prompts(), params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(_busy_prompts(), params, use_tqdm=False)]
    assert got == want
    sched = spec.llm_engine.scheduler
    assert sched.num_preemptions_total > 0  # the batch was busy enough to preempt
    assert sched.spec_decoding_totals.num_accepted_tokens > 0
    assert _free_all(spec) and _free_all(plain)


@pytest.fixture(scope="module")
def llms():
    # The dequantized float32 path: token-identical outputs with and without drafts need batch-invariant
    # rows, which neither the default quantized path nor bfloat16 promises (docs/speculative.md); on a CPU
    # with native bf16 (auto dtype bfloat16) test_chat_greedy_identical differed in its third conversation.
    return (LLM(kv_cache_memory=256 << 20, quantization="none", dtype="float32"),
            LLM(kv_cache_memory=256 << 20, speculative_config=NGRAM, quantization="none", dtype="float32"))


@pytest.mark.slow
class TestDefaultModel:
    def test_chat_greedy_identical(self, llms):
        plain, spec = llms
        # Two of the shorter code-grounded prompts (~200 tokens each: answers copy from them, so drafts are
        # accepted) beside four plain questions; the two longest (~500 tokens) doubled the test's time.
        convs = grounded_messages(2, offset=2) + [
            [{"role": "user", "content": q}]
            for q in ("Which city is the capital of France?", "Write a haiku about the sea.",
                      "List the days of the week.", "Explain what a hash map is in two sentences.")
        ]
        params = SamplingParams(temperature=0.0, max_tokens=64)
        want = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in spec.chat(convs, params, use_tqdm=False)]
        assert got == want
        stats = spec.llm_engine.scheduler.spec_decoding_totals
        assert stats.num_accepted_tokens > stats.num_drafts  # copying prompts: > 1 accepted per draft
        assert _free_all(spec)

    def test_stop_string_and_eos_inside_accepted_drafts(self, llms):
        plain, spec = llms
        conv = grounded_messages(1, offset=3)  # ~160 prompt tokens; its answer copies code (drafts accepted)
        params = SamplingParams(temperature=0.0, max_tokens=64)
        full = plain.chat(conv, params, use_tqdm=False)[0].outputs[0]
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 6]
        variants = ({"stop": [stop]}, {"stop": [stop], "include_stop_str_in_output": True},
                    {"stop_token_ids": [full.token_ids[40]]}, {"max_tokens": 37})
        # One batch per engine (the float32 path's rows do not depend on the batch): each variant ends its
        # own request inside or at the edge of an accepted draft while the others go on.
        params = [SamplingParams(temperature=0.0, **{"max_tokens": 64, **kwargs}) for kwargs in variants]
        want = [o.outputs[0] for o in plain.chat(conv * len(variants), params, use_tqdm=False)]
        got = [o.outputs[0] for o in spec.chat(conv * len(variants), params, use_tqdm=False)]
        for kwargs, a, b in zip(variants, want, got):
            assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason), kwargs
        assert [a.finish_reason for a in want] == ["stop", "stop", "stop", "length"]
        assert _free_all(spec)

    def test_seeded_sampling_is_reproducible(self, llms):
        """A seeded request gives the same tokens and logprobs on two engines, alone on the module's (where
        earlier tests may have cached its prompt) and behind three other requests (random, greedy, seeded) on
        a fresh one, and each logprob is the model's: the plain engine's prompt logprob of that token after
        the same context.

        float32 (the fixture's): in bfloat16 a prefill split differently (a prefix-cache hit, another batch)
        moves the logits by ~1e-2 and the seeded draws part ways within 48 tokens, with or without drafts."""
        plain, spec = llms
        conv = grounded_messages(1, offset=2)
        p = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=48, logprobs=1)
        accepted = spec.llm_engine.scheduler.spec_decoding_totals.num_accepted_tokens
        a_out = spec.chat(conv, p, use_tqdm=False)[0]
        a = a_out.outputs[0]
        assert spec.llm_engine.scheduler.spec_decoding_totals.num_accepted_tokens > accepted  # drafts verified
        fresh = LLM(kv_cache_memory=256 << 20, speculative_config=NGRAM, quantization="none", dtype="float32")
        others = [SamplingParams(temperature=1.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=30),
                  SamplingParams(temperature=0.7, seed=5, max_tokens=20)]
        b = fresh.chat(grounded_messages(3, offset=5) + conv, others + [p], use_tqdm=False)[-1].outputs[0]
        del fresh
        assert a.token_ids == b.token_ids and len(a.token_ids) == 48
        got = [lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)]
        assert got == pytest.approx([lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)], abs=1e-3)
        ref = plain.generate([{"prompt_token_ids": a_out.prompt_token_ids + list(a.token_ids)}],
                             SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
        n = len(a_out.prompt_token_ids)
        want = [ref[n + i][t].logprob for i, t in enumerate(a.token_ids)]
        assert got == pytest.approx(want, abs=1e-3)


def test_allowed_token_ids_and_logit_bias_hold_with_drafts(tiny_dir):
    """The n-gram drafts come from the prompt, outside the allowed set: verification must mask them as the
    plain sampler does (it once skipped allowed_token_ids and logit_bias). Greedy, so the tokens equal the
    run without drafts."""
    knobs = dict(dtype="float32", num_blocks=64, block_size=4, quantization="none")
    prompts = [{"prompt_token_ids": [(7 * j) % 40 + 50 for j in range(24)]} for _ in range(2)]
    allowed = list(range(100, 140))
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={60: 100.0})]
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_dir), **knobs).generate(prompts, params, use_tqdm=False)]
    spec_llm = LLM(str(tiny_dir), speculative_config=NGRAM, **knobs)
    spec = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert all(t in allowed for t in spec[0]) and spec[1] == [60] * 16
    assert spec == plain
    assert spec_llm.llm_engine.scheduler.spec_decoding_totals.num_draft_tokens > 0  # drafts were verified
