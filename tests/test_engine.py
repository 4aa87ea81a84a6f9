"""The engine end to end: LLM.generate / LLM.chat over the real runner, the scheduler, the front end."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_hf_model, reference_logprobs
from tokenloom.config import ConfigError
from tokenloom.core.scheduler import RequestRejected
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4)


def _prompts(n: int, length: int = 20) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(length + i)]} for i in range(n)]


def test_generate_returns_vllm_shaped_outputs(tiny) -> None:
    outs = tiny.generate(["Hello, world!", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]
    assert outs[1].prompt_token_ids == [5, 6, 7] and outs[0].prompt == "Hello, world!"
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and isinstance(c.text, str)
        m = o.metrics
        assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    assert tiny.llm_engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 256


def test_final_only_outputs_come_once_and_equal_cumulative_ones(tiny) -> None:
    """LLM.generate asks for FINAL_ONLY (as vLLM's LLM does): the engine hands out one output per
    request, the same as the last of a CUMULATIVE run."""
    from dataclasses import replace

    from tokenloom.sampling_params import RequestOutputKind

    engine = tiny.llm_engine
    seen: dict[str, dict[str, list]] = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        params = replace(GREEDY, output_kind=kind)
        ids = [engine.add_request(None, p, params) for p in _prompts(3)]
        outs: dict[str, list] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id].append(out)
        seen[kind.name] = outs
    for outs in seen["FINAL_ONLY"].values():
        assert len(outs) == 1 and outs[0].finished
    finals = [o[-1].outputs[0] for o in seen["CUMULATIVE"].values()]
    assert all(len(o) > 1 for o in seen["CUMULATIVE"].values())
    assert [(c.token_ids, c.text) for c in finals] == [
        (o[0].outputs[0].token_ids, o[0].outputs[0].text) for o in seen["FINAL_ONLY"].values()
    ]
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


def test_same_tokens_alone_and_in_a_busy_batch_with_chunking_and_preemption(tiny_dir) -> None:
    target = {"prompt_token_ids": [11 + (j * 5) % 200 for j in range(37)]}
    alone = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4)
    want = alone.generate([target], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # A small budget chunks every prompt; a small pool forces preemption and recompute.
    busy = LLM(str(tiny_dir), dtype="float32", num_blocks=40, block_size=4, max_num_batched_tokens=16,
               max_num_seqs=8)
    prompts = _prompts(6) + [target] + _prompts(3, 30)
    outs = busy.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[6].outputs[0].token_ids == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert busy.llm_engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 40


@pytest.mark.parametrize("mode", ["static", "request"])
def test_batching_modes_give_the_same_tokens(tiny_dir, mode) -> None:
    cont = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4, max_num_seqs=4)
    other = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4, max_num_seqs=4, batching=mode)
    prompts = _prompts(7)
    a = [o.outputs[0].token_ids for o in cont.generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)]
    assert a == b


def test_prefix_cache_hits_do_not_change_tokens(tiny) -> None:
    shared = [9] * 40
    p1 = {"prompt_token_ids": shared + [1, 2, 3]}
    first = tiny.generate([p1], GREEDY, use_tqdm=False)[0]
    again = tiny.generate([p1], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 40 - 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_n_completions(tiny) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, n=3, ignore_eos=True)
    a = tiny.generate(["Once upon a time"], params, use_tqdm=False)[0]
    b = tiny.generate(["Once upon a time", "noise"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # different seeds per completion


def test_stop_string_truncates_and_frees(tiny) -> None:
    base = tiny.generate(["The quick brown"], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert len(base) > 6
    stop = base[3:6]
    out = tiny.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
                        use_tqdm=False)[0].outputs[0]
    assert out.text == base[: base.find(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    incl = tiny.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                             include_stop_str_in_output=True),
                         use_tqdm=False)[0].outputs[0]
    assert incl.text == base[: base.find(stop) + len(stop)]
    assert tiny.llm_engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 256


def test_stop_token_text_left_out_unless_include_stop_str_in_output(tiny) -> None:
    """vLLM's detokenizer leaves the text of the token that stopped the request (a stop token id, EOS) out of
    the output, unless include_stop_str_in_output; the token id stays in token_ids either way."""
    prompt = "The quick brown"
    ids = tiny.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tok = tiny.get_tokenizer()
    k = next(i for i in range(2, len(ids)) if tok.decode([ids[i]]).strip() and ids[i] not in ids[:i])
    stop_id = ids[k]
    texts = {}
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        got = tiny.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (ids[: k + 1], "stop", stop_id)
        texts[include] = got.text
    assert texts[False] == tok.decode(ids[:k]) and texts[True] == tok.decode(ids[: k + 1])


def test_cumulative_stream_holds_back_a_possible_stop_string(tiny) -> None:
    """vLLM's CUMULATIVE outputs, as its DELTA ones, hold back the text's last len(stop) - 1 characters while
    the request runs (they could begin a stop string), so no output shows text that a later one cuts."""
    engine = tiny.llm_engine

    def stream(**kwargs: object) -> list[str]:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kwargs)
        rid = engine.add_request(None, "Once upon a", params)
        texts = []
        while engine.has_unfinished_requests():
            texts += [out.outputs[0].text for out in engine.step() if out.request_id == rid]
        return texts

    texts = stream()
    text, ends = texts[-1], [len(t) for t in texts]  # the text after each token
    # A stop string across a token boundary: the token before it ends with its first character.
    m = next(k for k in range(1, len(ends) - 1) if ends[k] > ends[k - 1] and ends[k + 1] - ends[k] >= 2
             and text.find(text[ends[k] - 1 : ends[k] + 2]) == ends[k] - 1)
    stop = text[ends[m] - 1 : ends[m] + 2]
    texts = stream(stop=[stop])
    assert texts[-1] == text[: ends[m] - 1]
    assert all(texts[-1].startswith(t) for t in texts), (stop, texts)


def test_min_tokens_holds_back_stop_strings_as_vllm(tiny) -> None:
    """vLLM checks stop strings only once the output is longer than min_tokens, and only one ending in the
    text of a token past the first min_tokens: a stop string completed by token m ends the output with
    min_tokens = m - 1, not with min_tokens = m (it was one token early)."""
    engine = tiny.llm_engine
    prompt = "Once upon a"
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    offsets, text = [0], ""  # text length after each token, as the engine's own detokenizer builds it
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                text = out.outputs[0].text
                offsets.append(len(text))
    m = next(i for i in range(3, 15) if offsets[i] > offsets[i - 1])  # a token with text of its own
    stop = text[offsets[m - 1]:offsets[m]]

    def expected(min_tokens: int) -> str:
        idx = text.find(stop)
        while idx != -1 and idx + len(stop) <= offsets[min_tokens]:  # ends within the first min_tokens
            idx = text.find(stop, idx + 1)
        return text if idx == -1 else text[:idx]

    for min_tokens in (m - 1, m):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        got = tiny.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.text == expected(min_tokens), (min_tokens, m, stop)
    assert expected(m - 1) != expected(m)  # the case tells the off-by-one apart


def test_delta_outputs_add_up_to_the_cumulative_ones(tiny_dir) -> None:
    """vLLM's RequestOutputKind.DELTA: each output carries only what is new (text, token ids, logprobs, and
    the prompt's logprobs chunk by chunk) and the pieces add up to a CUMULATIVE run's last output."""
    from dataclasses import replace

    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.sampling_params import RequestOutputKind

    def values(lps: list) -> list:
        return [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in lps]

    # A budget of 8 tokens splits the 22-token prompt into chunks, each scoring its own prompt logprobs.
    engine = LLMEngine.from_args(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4,
                                 max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                                n=2)
        prompt = _prompts(1, length=22)[0]
        runs = {}
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
            rid = engine.add_request(None, prompt, replace(params, output_kind=kind))
            outs = []
            while engine.has_unfinished_requests():
                outs += [o for o in engine.step() if o.request_id == rid]
            runs[kind] = outs
    finally:
        engine.close()
    cumulative, deltas = runs[RequestOutputKind.CUMULATIVE], runs[RequestOutputKind.DELTA]
    last = cumulative[-1]
    assert len(deltas) > 12 and deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    # vLLM's shape with n > 1: each streamed output carries the one child that progressed.
    assert all(len(o.outputs) == 1 for o in deltas + cumulative)
    for i in range(2):
        mine = [o.outputs[0] for o in deltas if o.outputs[0].index == i]
        whole = [o.outputs[0] for o in cumulative if o.outputs[0].index == i][-1]
        assert "".join(c.text for c in mine) == whole.text
        assert [t for c in mine for t in c.token_ids] == whole.token_ids
        assert len(mine[-1].token_ids) < 12  # the last output is a delta, not the whole
        assert values([lp for c in mine for lp in c.logprobs]) == values(whole.logprobs)
        assert mine[-1].cumulative_logprob == pytest.approx(whole.cumulative_logprob)
    pieces = [o.prompt_logprobs for o in deltas]
    assert sum(1 for p in pieces if p) >= 3  # one piece per scored chunk, each position once
    flat = [lp for p in pieces for lp in p]
    assert flat[0] is None and len(flat) == len(last.prompt_logprobs) == 22
    assert values(flat) == values(last.prompt_logprobs)


def test_streaming_deltas_never_show_a_stop_string(tiny) -> None:
    engine = tiny.llm_engine
    base = tiny.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = base[5:9]
    rid = engine.add_request(None, "Hello", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                streamed += out.outputs[0].delta_text
                assert stop not in streamed
    assert streamed == base[: base.find(stop)]


def test_logprobs(tiny, tiny_dir) -> None:
    """Ranks, lengths and values: each reported logprob is the log-softmax of transformers' logits."""
    out = tiny.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    ref = reference_logprobs(tiny_dir, out.prompt_token_ids + comp.token_ids[:-1])
    n_prompt = len(out.prompt_token_ids)
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        want = ref[n_prompt - 1 + i]
        assert tok in lp and lp[tok].rank == 1  # greedy: the chosen token is the most likely
        top = torch.topk(want, 3)
        assert sorted(lp) == sorted(top.indices.tolist())
        for t, entry in lp.items():
            assert entry.logprob == pytest.approx(want[t].item(), abs=1e-4), (i, t)
            assert entry.rank == 1 + int((want > want[t]).sum())
    assert comp.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(comp.token_ids,
                                                                                           comp.logprobs)))


def test_chat_uses_the_models_template(tiny) -> None:
    out = tiny.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    tok = tiny.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                              add_special_tokens=False)


def test_bad_input_gives_clear_errors_and_the_engine_goes_on(tiny) -> None:
    with pytest.raises(ValueError, match="out of vocabulary"):
        tiny.generate([{"prompt_token_ids": [1, 10**6]}], GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="empty"):
        tiny.generate([{"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="maximum context length"):
        tiny.generate([{"prompt_token_ids": [5] * 5000}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM("x", not_a_knob=1)
    assert not tiny.llm_engine.has_unfinished_requests()
    assert len(tiny.generate(["still alive"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_abort_frees_blocks_at_once(tiny) -> None:
    engine = tiny.llm_engine
    rid = engine.add_request(None, "abort me", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < 256
    (out,) = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 256
    assert not engine.has_unfinished_requests()


def test_a_failing_step_finishes_its_requests_with_an_error(tiny, monkeypatch) -> None:
    """The forward raises (as a failing kernel would) after the runner took in the step's bookkeeping;
    only the step's requests end, with the error, and the runner keeps no state for them."""
    engine = tiny.llm_engine
    bystander = engine.add_request(None, "waits its turn", GREEDY)
    engine.step()  # the bystander is decoding; the next step is its and the new request's

    def boom(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    rid = engine.add_request(None, "fail", GREEDY)
    monkeypatch.setattr(engine.runner.model, "forward", boom)
    outs = engine.step()
    monkeypatch.undo()
    assert {o.request_id for o in outs} == {rid, bystander}  # the step's two requests, and only them
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "error" and "simulated" in out.error
    later = engine.add_request(None, "after the failure", GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done[later].outputs[0].token_ids) == 24 and done[later].outputs[0].finish_reason == "length"
    assert set(engine.runner.requests) <= {later}  # told about the failed two at the next step
