"""Feature combinations no other test runs (issue 32, item 2): each works together, or is refused with a
clear error before any model loads.

Every check compares with the same request run without the extra feature, on the float path where
token identity across batch shapes is the claim (docs/speculative.md), or validates what the feature
promises (a schema, a block count). Tiny random models (tests/tiny_models.py) where no real tokenizer is
needed; the default model where a grammar needs one.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams, StructuredOutputsParams
from tokenloom.core.repetition import check_sequence_repetition
from tokenloom.engine.beam_search import BeamSearchParams
from tokenloom.sampling_params import RepetitionDetectionParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TINY = dict(dtype="float32", device="cpu", num_blocks=256, block_size=4, max_model_len=256)
# Prompts with repeats, so n-gram lookup proposes drafts from the first steps on.
PROMPTS = [[5 + (j % (3 + i)) * 7 for j in range(6 + 5 * i)] for i in range(4)]
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=11))


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> str:
    # Mistral's tiny config slides an 8-token window on every layer.
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("mistral"), arch="mistral", seed=12))


def _run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _close(llm: LLM) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    try:
        assert kv.block_pool.get_num_free_blocks() == kv.num_blocks, "blocks leaked"
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("drafts", [None, NGRAM], ids=["plain", "ngram"])
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama, drafts) -> None:
    """A seeded request samples the same tokens, with the same logprobs, alone and beside other requests
    of other lengths (vLLM's per-request generators), with drafts verified by the rejection sampler too."""
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2)
    others = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True)
    llm = LLM(tiny_llama, speculative_config=drafts, **TINY)
    try:
        alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], seeded, use_tqdm=False)[0].outputs[0]
        batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [others, seeded, others, others],
                             use_tqdm=False)[1].outputs[0]
        if drafts:
            stats = llm.llm_engine.scheduler.spec_decoding_totals
            assert stats is not None and stats.num_draft_tokens > 0  # drafts were verified
    finally:
        _close(llm)
    assert list(batch.token_ids) == list(alone.token_ids)
    for a, b in zip(alone.logprobs, batch.logprobs):
        assert a.keys() == b.keys()
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)


def test_n_completions_under_async_scheduling_with_drafts_equal_sync(tiny_llama) -> None:
    """n = 3 seeded completions of one request, async scheduling + n-gram drafts, give the synchronous
    run's tokens (the engine fans the request out into three children; the runner fills their drafts)."""
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    want_llm = LLM(tiny_llama, speculative_config=NGRAM, **TINY)
    try:
        want = _run(want_llm, PROMPTS[:2], params)
    finally:
        _close(want_llm)
    llm = LLM(tiny_llama, speculative_config=NGRAM, async_scheduling=True, **TINY)
    try:
        got = _run(llm, PROMPTS[:2], params)
        stats = llm.llm_engine.scheduler.spec_decoding_totals
        assert stats is not None and stats.num_draft_tokens > 0
    finally:
        _close(llm)
    assert got == want
    assert all(len(c) == 20 for r in got for c in r) and len({tuple(c) for c in got[0]}) > 1


def test_repetition_detection_with_async_scheduling_and_drafts(tiny_llama) -> None:
    """vLLM's repetition_detection ends a request at the token that completes the repeat, after min_tokens, also
    when the step's tokens come as accepted drafts scheduled ahead (async scheduling): no shorter prefix of the
    output past min_tokens repeats already. Two allowed tokens make a repeat certain within a few tokens (no "aa"
    forces "abab")."""
    detect = RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=1, min_count=2)
    min_tokens = (0, 0, 6, 9)
    llm = LLM(tiny_llama, speculative_config=NGRAM, async_scheduling=True, **TINY)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=m,
                                            allowed_token_ids=[5, 12], repetition_detection=detect)
                             for m in min_tokens], use_tqdm=False)
        assert llm.llm_engine.scheduler.spec_decoding_totals.num_draft_tokens > 0
    finally:
        _close(llm)
    for out, floor in zip(outs, min_tokens):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        assert (comp.finish_reason, comp.stop_reason) == ("repetition", "repetition_detected")
        assert check_sequence_repetition(tokens, detect) and len(tokens) >= floor
        assert not any(check_sequence_repetition(tokens[:n], detect) for n in range(floor, len(tokens)))


def test_sliding_window_with_async_scheduling_and_drafts(tiny_mistral) -> None:
    """An 8-token sliding window with 4-token blocks: blocks leave the window while drafts are in flight
    (async) and rejected drafts roll num_computed_tokens back. Greedy tokens equal the plain synchronous
    run's over 48 tokens (6 windows), and every block is free at the end."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(tiny_mistral, **TINY)
    try:
        want = _run(plain, PROMPTS, params)
    finally:
        _close(plain)
    # A pool this small hands a freed block to another request at once, so a block freed while the
    # window still reads it is overwritten.
    llm = LLM(tiny_mistral, speculative_config=NGRAM, async_scheduling=True, **dict(TINY, num_blocks=18))
    try:
        got = _run(llm, PROMPTS, params)
        assert llm.llm_engine.scheduler.kv_cache_manager.kv_cache_groups[0].sliding_window == 8
        stats = llm.llm_engine.scheduler.spec_decoding_totals
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        _close(llm)
    assert got == want


def test_drafts_with_prompt_logprobs_equal_the_plain_run(tiny_llama) -> None:
    """prompt_logprobs are computed on the prefill, which drafts never touch: the same values with and
    without n-gram speculation, and the same greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=3, ignore_eos=True)
    results = []
    for spec in (None, NGRAM):
        llm = LLM(tiny_llama, speculative_config=spec, **TINY)
        try:
            results.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
            if spec:
                stats = llm.llm_engine.scheduler.spec_decoding_totals
                assert stats is not None and stats.num_draft_tokens > 0
        finally:
            _close(llm)
    for plain, spec in zip(*results):
        assert list(spec.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
        assert len(spec.prompt_logprobs) == len(plain.prompt_logprobs)
        for a, b in zip(plain.prompt_logprobs, spec.prompt_logprobs):
            if a is None:
                assert b is None
                continue
            assert a.keys() == b.keys()
            for tok in a:
                assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-5)


def test_beam_search_with_drafts_equals_plain_beam_search(tiny_llama) -> None:
    """Beam search runs each step as a one-token request per beam; with n-gram speculation on, the
    engine verifies drafts for them and the beams (tokens and cumulative logprobs) are the same."""
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    results = []
    for spec in (None, NGRAM):
        llm = LLM(tiny_llama, speculative_config=spec, **TINY)
        try:
            results.append(llm.beam_search(prompts, params))
            if spec:
                stats = llm.llm_engine.scheduler.spec_decoding_totals
                assert stats is not None and stats.num_draft_tokens > 0
        finally:
            _close(llm)
    for plain, spec in zip(*results):
        assert [b.tokens for b in spec.sequences] == [b.tokens for b in plain.sequences]
        for a, b in zip(plain.sequences, spec.sequences):
            assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)


def test_drafts_on_gguf_quantized_weights(tiny_llama, tmp_path) -> None:
    """n-gram speculation on weights kept quantized (Q8_0 GGUF, verified by the quantized GEMMs): the
    drafts are verified and accepted, every request reaches its length, and the blocks come back.
    Token identity with one-row decoding is not claimed on quantized paths (the GEMMs sum in another
    order), so only the prefill's token is compared with the plain quantized run."""
    from tests.tiny_models import write_gguf_from_hf

    gguf = write_gguf_from_hf(tiny_llama, tmp_path / "tiny-q8_0.gguf", qtype="Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(str(gguf), quantization="gguf", **TINY)
    try:
        want = _run(plain, PROMPTS, params)
    finally:
        _close(plain)
    llm = LLM(str(gguf), quantization="gguf", speculative_config=NGRAM, **TINY)
    try:
        got = _run(llm, PROMPTS, params)
        stats = llm.llm_engine.scheduler.spec_decoding_totals
        assert stats is not None and stats.num_accepted_tokens > 0
    finally:
        _close(llm)
    assert all(len(r[0]) == 32 for r in got)
    # The first token comes from the prefill, which drafts never touch: the same on both runs, whatever
    # the CPU's kernels; later ones may part at a near-tie (the verify GEMMs sum in another order).
    assert [g[0][0] for g in got] == [w[0][0] for w in want]


@pytest.fixture(scope="module")
def roomy_default() -> list[list[int]]:
    """Four constrained requests on the default model with room for all: the reference tokens."""
    llm = LLM(quantization="none", dtype="float32", max_model_len=512, num_blocks=256, block_size=16)
    try:
        return [r[0] for r in _run(llm, _json_prompts(llm), _json_params())]
    finally:
        _close(llm)


def _json_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    people = ["Alice, 31", "Bob, 45", "Carol, 27", "Dan, 60"]
    return [tok.encode(f"Write {p} as JSON with name and age, then describe them at length: ") for p in people]


def _json_params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(json=RECORD), **kw)


def test_structured_outputs_survive_preemption(roomy_default) -> None:
    """A KV cache too small for four constrained requests at once preempts some mid-generation; on
    resume the grammar matcher must continue from the tokens kept (not restart, not double-advance):
    the same tokens as the roomy run, each a valid document."""
    llm = LLM(quantization="none", dtype="float32", max_model_len=512, num_blocks=9, block_size=16)
    try:
        got = [r[0] for r in _run(llm, _json_prompts(llm), _json_params())]
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
        texts = [llm.get_tokenizer().decode(t, skip_special_tokens=True) for t in got]
    finally:
        _close(llm)
    assert got == roomy_default
    for text in texts:
        jsonschema.validate(json.loads(text), RECORD)


def test_structured_outputs_with_n_completions() -> None:
    """n = 3 sampled completions of one constrained request: each child has its own matcher, each
    completion a valid document, and they differ."""
    llm = LLM(quantization="none", dtype="float32", max_model_len=512, num_blocks=128, block_size=16)
    try:
        prompt = _json_prompts(llm)[0]
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40,
                                          structured_outputs=StructuredOutputsParams(json=RECORD)),
                           use_tqdm=False)[0]
    finally:
        _close(llm)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), RECORD)
    assert len({c.text for c in out.outputs}) > 1


def test_data_parallel_with_async_scheduling_drafts_and_structured_outputs(roomy_default) -> None:
    """Two engine processes, each with async scheduling and n-gram drafts, serving constrained and free
    requests: the constrained ones give the single engine's tokens, the free ones finish."""
    llm = LLM(quantization="none", dtype="float32", max_model_len=512, num_blocks=256, block_size=16,
              data_parallel_size=2, routing_policy="round_robin", async_scheduling=True, speculative_config=NGRAM)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(f"Write {p} as JSON with name and age, then describe them at length: ")
                   for p in ["Alice, 31", "Bob, 45", "Carol, 27", "Dan, 60"]]
        free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:2]],
                            [_json_params()] * 4 + [free] * 2, use_tqdm=False)
        assert llm.llm_engine.client.client.router.num_routed == [3, 3]
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs[:4]] == roomy_default
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs[4:])
