"""Engine behaviours that had no test: aborts mid-prefill, priority preemption with prefix caching,
multi-token stop strings and n > 1 children stopping apart, UTF-8 split across streamed tokens,
n > 1 with a seed against separate requests, a prompt of max_model_len - 1 tokens, and chunked prefill
on top of a prefix hit — all through the real runner (tiny random Llama, float32)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom.core.outputs import EngineCoreOutput
from tokenloom.engine.llm import LLM
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def roomy(tiny_dir):
    """No chunking, a big pool, prefix caching: the reference."""
    return LLM(str(tiny_dir), dtype="float32", num_blocks=512, block_size=4)


@pytest.fixture(scope="module")
def chunked(tiny_dir):
    """8-token budget: every prompt longer than that is prefilled in chunks."""
    return LLM(str(tiny_dir), dtype="float32", num_blocks=512, block_size=4, max_num_batched_tokens=8,
               max_num_seqs=8)


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 290 + 5 for j in range(n)]


def _tokens(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids


def _pool(llm: LLM):
    return llm.llm_engine.scheduler.kv_cache_manager.block_pool


def test_abort_mid_prefill_frees_everything(chunked, roomy) -> None:
    engine = chunked.llm_engine
    rid = engine.add_request(None, {"prompt_token_ids": _ids(1, 30)}, GREEDY)
    engine.step()  # 8 of 30 prompt tokens computed
    request = engine.scheduler.requests["0" if rid == "0" else rid]
    assert 0 < request.num_computed_tokens < 30 and request.num_output_tokens == 0
    assert rid in engine.runner.requests
    (out,) = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert _pool(chunked).get_num_free_blocks() == _pool(chunked).num_blocks
    assert not engine.has_unfinished_requests()
    # the next request runs normally (and the runner forgets the aborted one on that step)
    assert _tokens(chunked, _ids(2, 20)) == _tokens(roomy, _ids(2, 20))
    assert rid not in engine.runner.requests


def test_abort_mid_chunk_after_a_prefix_hit_keeps_the_cached_blocks_valid(chunked, roomy) -> None:
    engine = chunked.llm_engine
    shared = _ids(3, 24)
    first = _tokens(chunked, shared + [7, 8, 9])  # caches the shared 24 tokens (6 full blocks)
    rid = engine.add_request(None, {"prompt_token_ids": shared + _ids(4, 20)}, GREEDY)
    engine.step()
    request = engine.scheduler.requests[rid]
    assert request.num_cached_tokens >= 24 - 4  # a prefix hit ...
    assert request.num_computed_tokens < request.num_prompt_tokens  # ... and still mid-chunk
    engine.abort_request(rid)
    assert _pool(chunked).get_num_free_blocks() == _pool(chunked).num_blocks
    again = chunked.generate([{"prompt_token_ids": shared + [7, 8, 9]}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 24 and again.outputs[0].token_ids == first
    assert first == _tokens(roomy, shared + [7, 8, 9])


def test_chunked_prefill_on_top_of_a_prefix_hit(chunked, roomy) -> None:
    shared = _ids(5, 20)
    _tokens(chunked, shared + [1, 2])
    engine = chunked.llm_engine
    rid = engine.add_request(None, {"prompt_token_ids": shared + _ids(6, 30)}, GREEDY)
    steps_in_prefill, out = 0, None
    while engine.has_unfinished_requests():
        req = engine.scheduler.requests.get(rid)
        if req is not None and req.num_output_tokens == 0:
            steps_in_prefill += 1
        for o in engine.step():
            if o.finished:
                out = o
    assert out.num_cached_tokens >= 20 - 4  # the hit covered the shared blocks ...
    assert steps_in_prefill >= 4  # ... and the 30-token rest went in 8-token chunks
    assert out.outputs[0].token_ids == _tokens(roomy, shared + _ids(6, 30))


def test_priority_preemption_with_prefix_caching_keeps_tokens(tiny_dir, roomy) -> None:
    """A low-priority request is preempted for high-priority arrivals sharing a prefix with it; after
    recomputing (partly from the prefix cache) it finishes with the tokens it gets alone."""
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=24, block_size=4, scheduling_policy="priority",
              max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.llm_engine
    shared = _ids(7, 16)
    params = replace(GREEDY, max_tokens=30)
    low = engine.add_request("low", {"prompt_token_ids": shared + [3, 4]}, params, priority=5)
    for _ in range(3):
        engine.step()
    highs = [engine.add_request(f"high{i}", {"prompt_token_ids": shared + _ids(10 + i, 6)}, params, priority=0)
             for i in range(2)]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[low].metrics.num_preemptions >= 1
    assert engine.scheduler.kv_cache_manager.prefix_cache_totals.hits > 0
    assert finals[low].outputs[0].token_ids == _tokens(roomy, shared + [3, 4], params)
    for i, h in enumerate(highs):
        assert finals[h].outputs[0].token_ids == _tokens(roomy, shared + _ids(10 + i, 6), params)


@pytest.mark.parametrize("stop, before", [("e th", " th"), ("he the t", " t"), (" the the", "")])
def test_stop_string_spanning_several_tokens(roomy, stop, before) -> None:
    """The case is built, not searched for: with only " the" allowed the text is " the the the ...", whatever
    the model's weights, so each stop string spans two or three tokens at a known place."""
    tok = roomy.get_tokenizer()
    [the] = tok.encode(" the", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=[the])
    free = roomy.generate([{"prompt_token_ids": _ids(8, 10)}], params, use_tqdm=False)[0].outputs[0]
    assert free.text == " the" * 12 and free.finish_reason == "length"
    out = roomy.generate([{"prompt_token_ids": _ids(8, 10)}], replace(params, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == before
    assert len(out.token_ids) == (len(before) + len(stop) + 3) // 4  # generation ended at the stop's last token
    assert _pool(roomy).get_num_free_blocks() == _pool(roomy).num_blocks


def _unique_stop(texts: list[str]) -> str:
    """The shortest substring of texts[0] that starts after its first character, first occurs there, ends
    at least 4 characters before its end and is in no other text: seeded, so the same on every run."""
    first = texts[0]
    for length in range(2, len(first)):
        for i in range(1, len(first) - length - 3):
            stop = first[i:i + length]
            if first.find(stop) == i and all(stop not in t for t in texts[1:]):
                return stop
    raise AssertionError(f"no stop string only child 0 produces: {texts}")


def test_one_child_of_n_stops_early_the_others_run_on(roomy) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=11, ignore_eos=True)
    free = roomy.generate(["Once"], params, use_tqdm=False)[0].outputs
    texts = [c.text for c in free]
    stop = _unique_stop(texts)  # a stop string in child 0's text that the other two never produce
    outs = roomy.generate(["Once"], replace(params, stop=[stop]), use_tqdm=False)[0].outputs
    assert outs[0].finish_reason == "stop" and outs[0].text == texts[0][: texts[0].find(stop)]
    assert len(outs[0].token_ids) < 16
    assert [(c.finish_reason, c.token_ids) for c in outs[1:]] == [("length", c.token_ids) for c in free[1:]]
    assert _pool(roomy).get_num_free_blocks() == _pool(roomy).num_blocks


def test_n_with_a_seed_equals_separate_requests_with_derived_seeds(roomy) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, n=3, seed=100, ignore_eos=True)
    together = roomy.generate(["Hello"], params, use_tqdm=False)[0].outputs
    apart = roomy.generate(["Hello"] * 3, [replace(params, n=1, seed=100 + i) for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in together] == [o.outputs[0].token_ids for o in apart]
    assert len({tuple(c.token_ids) for c in together}) > 1


def test_prompt_of_max_model_len_minus_one(tiny_dir) -> None:
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=64, block_size=4, max_model_len=32)
    out = llm.generate([{"prompt_token_ids": _ids(9, 31)}], SamplingParams(temperature=0.0), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 1 and comp.finish_reason == "length"  # room for exactly one token
    assert comp.token_ids == _tokens(llm, _ids(9, 31), SamplingParams(temperature=0.0, max_tokens=1))


def test_utf8_split_across_streamed_tokens_is_never_torn(roomy) -> None:
    """A character whose bytes span several tokens appears in one delta, whole, never as U+FFFD."""
    tok = roomy.get_tokenizer()
    text = "a😀b日本é"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-level: some characters take several tokens
    proc = OutputProcessor(tok)
    from tokenloom.core.request import Request

    params = SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.CUMULATIVE)
    core = Request("u", [5], params)
    proc.add_request("u", None, [5], [core], 0.0)
    deltas = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        outs, _ = proc.process_outputs([EngineCoreOutput("u", [t], finish_reason="length" if last else None)])
        deltas += [o.outputs[0].delta_text for o in outs]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas), deltas


def test_logprob_decoded_tokens_of_a_split_character_carry_it_whole(roomy) -> None:
    """vLLM's LogprobsProcessor._correct_decoded_token: a token whose own text is a partial character (U+FFFD) is
    read with the sampled tokens before it: "" while the character is unfinished, the whole character on the token
    that completes it; top-n alternatives at that position too (found by vendoring test_output_processor.py)."""
    from tokenloom.core.outputs import SampleLogprobs
    from tokenloom.core.request import Request

    tok = roomy.get_tokenizer()
    ids = tok.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3 and tok.decode([ids[-1]], False).endswith("\ufffd")  # the emoji's bytes over 2+ tokens
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=len(ids), logprobs=1, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    proc.add_request("u", None, ids, [Request("u", ids, params)], 0.0)
    # The prompt is the same text: its positions read their context from the prompt tokens before them.
    prompt_rows = [SampleLogprobs(t, -1.0, 1, [(t, -1.0)]) for t in ids[1:]]
    rows = [SampleLogprobs(t, -1.0, 2, [(ids[-1], -0.5)]) for t in ids]  # the last token also as every top-1
    outs, _ = proc.process_outputs([EngineCoreOutput("u", ids, rows, finish_reason="length",
                                                     new_prompt_logprobs=(1, prompt_rows))])
    sample = [{t: lp.decoded_token for t, lp in pos.items()} for pos in outs[0].outputs[0].logprobs]
    assert [pos[t] for pos, t in zip(sample, ids)] == ["a"] + [""] * (len(ids) - 2) + ["😀"]
    assert sample[-2][ids[-1]] == "" and sample[0][ids[-1]] == ""  # without the bytes before it: nothing yet
    prompt = [pos[t].decoded_token for pos, t in zip(outs[0].prompt_logprobs[1:], ids[1:])]
    assert prompt[-1] == "😀" and "\ufffd" not in "".join(prompt)


def test_cache_creation_tokens_are_the_prompt_tokens_a_request_adds_to_the_prefix_cache(tiny_dir, roomy,
                                                                                        chunked) -> None:
    """vLLM's num_cache_creation_tokens (PrefillStats.finalize): the prompt's full blocks cached at the first
    output, less the prefix-cache hit (block size 4 here)."""
    def run(llm: LLM, prompt: list[int], max_tokens: int = 3) -> tuple[int, int]:
        out = llm.generate([{"prompt_token_ids": prompt}], replace(GREEDY, max_tokens=max_tokens),
                           use_tqdm=False)[0]
        return out.num_cached_tokens, out.num_cache_creation_tokens

    prompt = _ids(71, 10)
    assert run(roomy, prompt) == (0, 8)  # two full blocks written; the last 2 tokens fill no block
    assert run(roomy, prompt) == (8, 0)  # a hit on both blocks (never the last token), nothing new
    assert run(roomy, prompt + _ids(72, 6)) == (8, 8)  # 16 tokens: 4 blocks cached, 2 of them a hit
    assert run(roomy, _ids(73, 9), max_tokens=1) == (0, 8)  # finished by its first token: counted before the free
    assert run(chunked, _ids(74, 30)) == (0, 28)  # chunked prefill: counted once, at the first output
    uncached = LLM(str(tiny_dir), dtype="float32", num_blocks=512, block_size=4, enable_prefix_caching=False)
    assert run(uncached, prompt) == (0, 0) and run(uncached, prompt) == (0, 0)
