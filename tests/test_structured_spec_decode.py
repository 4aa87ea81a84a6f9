"""Structured outputs with speculative decoding (issue 13 + 18, vLLM's shape): n-gram drafts of a
constrained request are cut to the prefix its grammar accepts, each scheduled draft position gets its
own bitmask row (the matcher walks the drafts and is rolled back), and the drafts are verified against
grammar-masked logits. Greedy output is token-identical to decoding without drafts, on the default
model, with drafts actually accepted."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenloom import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 16},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["name", "city", "tags"], "additionalProperties": False}
EXAMPLE = '{"name": "Alice Smith", "city": "Paris", "tags": ["red", "blue", "green"]}'
PROMPTS = [
    f"Copy this JSON exactly.\n{EXAMPLE}\n{EXAMPLE}\n",
    'Write a person record as JSON like {"name": "Bob", "city": "Rome", "tags": ["x"]}:\n',
    "List the colours red, blue, green, red, blue, green as a JSON array of strings:\n",
]


def _params(i: int, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=RECORD) if i < 2 else StructuredOutputsParams(
        json={"type": "array", "items": {"enum": ["red", "blue", "green"]}, "maxItems": 8})
    return SamplingParams(max_tokens=60, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def engines():
    # The dequantized path: token-identical outputs with and without drafts need batch-invariant rows,
    # which the default quantized path does not promise (docs/speculative.md).
    return (LLM(max_model_len=512, quantization="none", dtype="float32"),
            LLM(max_model_len=512, speculative_config=NGRAM, quantization="none", dtype="float32"))


def test_greedy_constrained_output_is_identical_with_drafts(engines) -> None:
    plain, spec = engines
    params = [_params(i, temperature=0.0) for i in range(len(PROMPTS))]
    # A free request in the same batch speculates alongside the constrained ones.
    prompts = [*PROMPTS, f"Repeat: {EXAMPLE} {EXAMPLE}"]
    params.append(SamplingParams(max_tokens=40, temperature=0.0))
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got[:2]:
        jsonschema.validate(json.loads(out.text), RECORD)
    totals = spec.llm_engine.scheduler.spec_decoding_totals
    assert totals.num_accepted_tokens > 10, totals  # drafts were proposed, verified and accepted


def test_seeded_sampling_with_drafts_still_fits_the_schema(engines) -> None:
    _, spec = engines
    before = spec.llm_engine.scheduler.spec_decoding_totals.num_accepted_tokens
    outs = spec.generate(PROMPTS[:2] * 3, [_params(i % 2, temperature=0.8, seed=i) for i in range(6)], use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        jsonschema.validate(json.loads(out.outputs[0].text), RECORD)
    assert spec.llm_engine.scheduler.spec_decoding_totals.num_accepted_tokens > before


def test_bitmask_rows_follow_the_drafts_and_leave_the_matcher_alone(engines) -> None:
    from types import SimpleNamespace

    import torch

    from tokenloom.core.structured_output import StructuredOutputManager, StructuredOutputRequest
    from tokenloom.model.grammar import make_xgrammar_backend

    plain, _ = engines
    tok = plain.llm_engine.tokenizer
    vocab = plain.llm_engine.scheduler.structured_output_manager.get_backend().vocab_size
    manager = StructuredOutputManager(lambda: make_xgrammar_backend(tok, vocab), max_workers=1)
    so = StructuredOutputsParams(json=RECORD)
    request = SimpleNamespace(request_id="r", structured_output_request=StructuredOutputRequest(so.key),
                              sampling_params=SamplingParams(structured_outputs=so))
    manager.grammar_init(request)
    request.structured_output_request.compiled.result()
    assert manager.is_ready(request)
    good = tok.encode('{"name": ', add_special_tokens=False)  # a string value must follow
    bad = tok.encode("hello", add_special_tokens=False)[:1]
    # validate_tokens keeps the grammar-valid prefix only.
    assert manager.validate_tokens(request, good + bad + good) == good
    rows = manager.grammar_bitmask([request], {"r": good})
    assert rows.shape[0] == len(good) + 1
    # Row i is the mask after the first i drafts: compare with stepping a fresh matcher by hand.
    for i in range(len(good) + 1):
        step = manager.get_backend().allocate_bitmask(1)
        request.structured_output_request.matcher.fill_bitmask(step, 0)
        assert torch.equal(rows[i], step[0]), i
        if i < len(good):
            assert request.structured_output_request.matcher.accept_token(good[i])
    request.structured_output_request.matcher.rollback(len(good))
    # A rejected draft: the rows after it repeat the last valid one; a placeholder leaves its row free.
    rows = manager.grammar_bitmask([request], {"r": [good[0], bad[0], good[1]]})
    assert torch.equal(rows[1], rows[2]) and torch.equal(rows[2], rows[3])
    rows = manager.grammar_bitmask([request], {"r": [-1, -1]})
    assert not torch.equal(rows[0], rows[1]) and bool((rows[1] == -1).all()) and bool((rows[2] == -1).all())
    fresh = manager.get_backend().allocate_bitmask(1)
    request.structured_output_request.matcher.fill_bitmask(fresh, 0)
    assert torch.equal(fresh[0], rows[0])  # the matcher is back where it started
    manager.free(request)
    manager.clear_backend()
