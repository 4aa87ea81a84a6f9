"""Structured outputs × speculative decoding × async scheduling, all in one batch (issue 32, item 1).

One rule, vLLM's, in scheduler, bitmask and runner alike: a constrained request is speculated on,
its drafts cut to the prefix its grammar accepts. Synchronously the scheduler validates the drafts
before it schedules them (`update_draft_token_ids`); under async scheduling it schedules K
placeholders and, once the step in flight has landed, replaces a constrained request's placeholders
with its validated drafts padded with -1 (`update_draft_token_ids_in_output`) before it builds the
bitmask. The runner verifies the real drafts and trims the padding; the bitmask rows it uses are the
first 1 + d of the request's.

Every cell of {sync, async} × {no drafts, n-gram, suffix} runs a free, a json_schema and a
tool_choice "required" request together; greedy tokens equal the plain synchronous run's (async with
suffix decoding is refused before loading, as vLLM 0.32 refuses it). The
dequantized path: token identity across batch shapes is the claim (docs/speculative.md).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenloom import LLM, SamplingParams, StructuredOutputsParams
from tokenloom.config import ConfigError, has_arctic_inference
from tokenloom.server.tool_grammar import tool_structured_outputs
from tokenloom.server.tools import ToolSetup

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 16}},
    "required": ["name", "city"], "additionalProperties": False}
EXAMPLE = '{"name": "Alice Smith", "city": "Paris"}'
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
KNOBS = dict(max_model_len=512, quantization="none", dtype="float32", num_blocks=256, block_size=16)


def _requests() -> tuple[list[str], list[SamplingParams]]:
    tools = tool_structured_outputs(ToolSetup(mode="required", tools={"get_weather": WEATHER}, parser="hermes"), None)
    assert tools is not None and tools.structural_tag is not None
    prompts = [
        f"Repeat this line twice: {EXAMPLE} {EXAMPLE}\n",                      # free
        f"Copy this JSON exactly.\n{EXAMPLE}\n{EXAMPLE}\n",                    # json_schema
        'Call get_weather for Paris: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n',                                                       # tool_choice required
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=RECORD)),
        SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=tools),
    ]
    return prompts, params


def _free_all(llm: LLM) -> bool:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    return kv.block_pool.get_num_free_blocks() == kv.num_blocks


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    prompts, params = _requests()
    llm = LLM(**KNOBS)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("drafts", ["none", "ngram", "suffix"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_free_json_and_tool_requests_in_one_batch(want, async_scheduling: bool, drafts: str) -> None:
    if drafts == "none" and not async_scheduling:
        pytest.skip("the reference run itself")
    if drafts == "suffix" and not has_arctic_inference():
        pytest.skip("arctic-inference is not installed (`make test` builds it)")
    spec = {"none": None, "ngram": NGRAM, "suffix": SUFFIX}[drafts]
    if drafts == "suffix" and async_scheduling:  # refused before loading, as vLLM 0.32 refuses it
        with pytest.raises(ConfigError, match="async scheduling is only supported with"):
            LLM(**KNOBS, async_scheduling=True, speculative_config=spec)
        return
    prompts, params = _requests()
    llm = LLM(**KNOBS, async_scheduling=async_scheduling, speculative_config=spec)
    try:
        for run in range(2 if drafts == "suffix" else 1):  # the second time suffix decoding drafts from the first
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            assert [o.finish_reason for o in outs] != ["error"] * 3
            for o in outs:
                assert o.finish_reason in ("stop", "length"), (run, o.finish_reason, o.text)
            assert [o.token_ids for o in outs] == want, run
            jsonschema.validate(json.loads(outs[1].text), RECORD)
            assert outs[2].text.startswith("<tool_call>"), outs[2].text
        assert _free_all(llm), "KV blocks leaked"
        if spec is not None:
            totals = llm.llm_engine.scheduler.spec_decoding_totals
            assert totals.num_accepted_tokens > 0, totals
    finally:
        llm.llm_engine.close()


def test_constrained_requests_alone_accept_drafts_under_async() -> None:
    """The constrained requests themselves are speculated on under async scheduling (not only the
    free one beside them): alone in the engine, their drafts are accepted."""
    prompts, params = _requests()
    llm = LLM(**KNOBS, async_scheduling=True, speculative_config=NGRAM)
    try:
        outs = llm.generate(prompts[1:], params[1:], use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0] for o in outs]
        totals = llm.llm_engine.scheduler.spec_decoding_totals
        assert totals.num_accepted_tokens >= 8, totals
        assert _free_all(llm)
    finally:
        llm.llm_engine.close()


def test_constrained_request_admitted_with_one_token_left_under_sync_drafts() -> None:
    """A prefix-cache hit that leaves one prompt token admits the request as a first decode, which the
    scheduler pads with K placeholder drafts (vLLM's pad); its bitmask has 1 + K rows, the runner
    verifies no draft for it and uses the first row."""
    _, params = _requests()
    llm = LLM(**KNOBS, speculative_config=NGRAM)
    try:
        tok = llm.get_tokenizer()
        ids = tok.encode(f"Copy this JSON exactly.\n{EXAMPLE}\n{EXAMPLE}\n" * 3)
        block = llm.llm_engine.scheduler.block_size
        ids = ids[: (len(ids) - 1) // block * block + 1]  # full blocks and one token more
        prompt = {"prompt_token_ids": ids}
        first = llm.generate([prompt], params[1], use_tqdm=False)[0].outputs[0]
        hits_before = llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_totals.hits
        again = llm.generate([prompt], params[1], use_tqdm=False)[0].outputs[0]
        assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_totals.hits - hits_before == len(ids) - 1
        assert again.finish_reason == "stop", again
        assert again.token_ids == first.token_ids
        assert _free_all(llm)
    finally:
        llm.llm_engine.close()
