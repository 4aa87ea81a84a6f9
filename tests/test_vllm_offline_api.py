"""vLLM's offline API beyond generate: LLM.chat's arguments, reset_prefix_cache, the prompt TypedDicts,
SamplingParams' clone / from_optional / truncate_prompt_tokens / detokenize, and the engine's getters.
Each is what vLLM code written against `vllm.LLM` / `vllm.LLMEngine` calls; run on a tiny real model."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, BeamSearchParams, SamplingParams, TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    llm = LLM(str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)), dtype="float32",
              num_blocks=128, block_size=4, max_model_len=64)
    yield llm
    llm.shutdown()


def _rendered(llm: LLM, out) -> str:  # noqa: ANN001 - a RequestOutput
    return llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)


def test_chat_takes_vllms_arguments(tiny) -> None:
    chat = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "How are"}]
    # continue_final_message: the assistant's turn stays open, so the model goes on from "How are".
    out = tiny.chat(chat, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert _rendered(tiny, out).endswith("<|im_start|>assistant\nHow are")
    closed = tiny.chat(chat, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert _rendered(tiny, closed).endswith("How are<|im_end|>\n")
    with pytest.raises(ValueError, match="continue_final_message"):
        tiny.chat(chat, GREEDY, continue_final_message=True)  # add_generation_prompt defaults to True
    # chat_template (the request's own) and chat_template_kwargs (variables the template reads).
    template = "{% for m in messages %}[{{ greeting }} {{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    out = tiny.chat(chat[:1], GREEDY, use_tqdm=False, chat_template=template,
                    chat_template_kwargs={"greeting": "hi"})[0]
    assert _rendered(tiny, out) == "[hi user: Hello]"
    # Content as parts: joined text (vLLM's "string" format, what "auto" picks here); "openai" hands them on.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "you"}]}]
    out = tiny.chat(parts, GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nHello\nyou<|im_end|>" in _rendered(tiny, out)
    listing = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    out = tiny.chat(parts, GREEDY, use_tqdm=False, chat_template=listing, chat_template_content_format="openai")[0]
    assert _rendered(tiny, out) == "<Hello><you>"
    with pytest.raises(ValueError, match="only text parts"):
        tiny.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(ValueError, match="chat_template_content_format"):
        tiny.chat(chat[:1], GREEDY, chat_template_content_format="html")


def test_reset_prefix_cache_drops_the_cached_prompt(tiny) -> None:
    prompt = TokensPrompt(prompt_token_ids=list(range(3, 40)))
    tiny.generate(prompt, GREEDY, use_tqdm=False)
    assert tiny.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert tiny.reset_prefix_cache() is True
    assert tiny.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny) -> None:
    ids = list(range(3, 33))
    out = tiny.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=2, truncate_prompt_tokens=5),
                        use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    long = list(range(3, 3 + 100))  # past max_model_len 64: -1 keeps what leaves room for one token
    out = tiny.generate(TokensPrompt(prompt_token_ids=long), SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-63:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="cannot be greater than max_model_len=64"):
        tiny.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1 or -1"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_detokenize_false_gives_token_ids_only(tiny) -> None:
    text = tiny.generate(TextPrompt(prompt="Hello"), GREEDY, use_tqdm=False)[0].outputs[0]
    ids = tiny.generate(TextPrompt(prompt="Hello"), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                   detokenize=False), use_tqdm=False)[0].outputs[0]
    assert ids.token_ids == text.token_ids and text.text and ids.text == ""
    with pytest.raises(ValueError, match="only supported when detokenize is True"):
        SamplingParams(stop=["x"], detokenize=False)
    # vLLM 0.32's: False puts no space between consecutive special tokens, which tokenloom's fast tokenizers never
    # do: both values are taken and give that text (found by vendoring test_output_processor.py).
    eos = tiny.get_tokenizer().eos_token_id
    for spaces in (True, False):
        out = tiny.generate({"prompt_token_ids": [eos]}, SamplingParams(
            max_tokens=2, ignore_eos=True, temperature=0.0, skip_special_tokens=False,
            spaces_between_special_tokens=spaces, logit_bias={eos: 100.0}), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [eos, eos] and out.text == 2 * tiny.get_tokenizer().decode([eos], False)
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be true or false"):
        SamplingParams(spaces_between_special_tokens="no")
    with pytest.raises(ValueError, match="per-request logits_processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    # vLLM's test_detokenize_false: no decoded_token on any logprob (sampled or prompt) without detokenizing.
    quiet = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, logprobs=3, prompt_logprobs=3)
    out = tiny.generate(TextPrompt(prompt="Hello, world! How are you"), quiet, use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.prompt_logprobs) > 1 and len(out.outputs[0].logprobs) == 4
    for position in out.prompt_logprobs[1:] + out.outputs[0].logprobs:
        assert 3 <= len(position) <= 4 and all(lp.decoded_token is None for lp in position.values())


def test_best_of_other_than_n_is_refused_when_the_request_is_added(tiny) -> None:
    params = SamplingParams(n=2, best_of=3, seed=1)  # made as vLLM's test makes it; refused by generate
    with pytest.raises(ValueError, match="best_of is not supported"):
        tiny.generate("Hello", params, use_tqdm=False)
    assert len(tiny.generate("Hello", SamplingParams(n=2, best_of=2, seed=1, max_tokens=2), use_tqdm=False)[0]
               .outputs) == 2
    with pytest.raises(ValueError, match="best_of must be an integer >= n"):
        SamplingParams(n=3, best_of=2)


def test_sampling_params_clone_and_from_optional() -> None:
    params = SamplingParams(stop=["a"], logit_bias={3: 1.0}, max_tokens=5)
    twin = params.clone()
    twin.stop.append("b")
    twin.logit_bias[4] = 2.0
    assert params.stop == ["a"] and params.logit_bias == {3: 1.0} and twin.max_tokens == 5
    made = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, seed=None)
    assert (made.temperature, made.top_p, made.max_tokens, made.seed) == (1.0, 0.5, 16, None)


def test_prompt_dicts_for_other_inputs_are_refused_by_name(tiny) -> None:
    for key, value in (("multi_modal_data", {"image": object()}), ("prompt_embeds", [[0.0]]), ("cache_salt", "s")):
        with pytest.raises(ValueError, match=f"'{key}' is not supported"):
            tiny.generate({"prompt": "Hello", key: value}, GREEDY, use_tqdm=False)
    assert tiny.llm_engine.get_num_unfinished_requests() == 0  # nothing was queued


def test_engine_getters_and_outputs_name_their_adapter(tiny) -> None:
    engine = tiny.llm_engine
    rid = engine.add_request(None, "Hello", SamplingParams(max_tokens=3, n=2, seed=1))
    assert engine.get_num_unfinished_requests() == 1 and engine.get_tokenizer() is tiny.get_tokenizer()
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == rid), last)
    assert engine.get_num_unfinished_requests() == 0
    assert last.lora_request is None and all(c.lora_request is None for c in last.outputs)


def test_one_priority_applies_to_every_prompt(tiny) -> None:
    """vLLM's test_multiple_priority / test_single_prompt_priority: an integer is every prompt's priority."""
    prompts = ["Hello", "How are you", "One two three"]
    assert len(tiny.generate(prompts, GREEDY, priority=1, use_tqdm=False)) == 3
    assert len(tiny.generate(prompts[0], GREEDY, priority=1, use_tqdm=False)) == 1
    assert len(tiny.generate(prompts[0], GREEDY, priority=[0], use_tqdm=False)) == 1
    for bad in ([0, 0], []):
        with pytest.raises(ValueError, match="value\\(s\\) for 3 prompt"):
            tiny.generate(prompts, GREEDY, priority=bad, use_tqdm=False)
    with pytest.raises(TypeError, match="priority must be an integer or a list"):
        tiny.generate(prompts, GREEDY, priority=True, use_tqdm=False)


def test_vllms_gpu_arguments_are_taken(tiny_dir_for_args, caplog) -> None:
    """Code written for vLLM passes gpu_memory_utilization and enforce_eager: both are engine arguments here.
    On CPU the first is named as not applying (the pool is kv_cache_memory's); on CUDA it sizes the KV cache."""
    from tokenloom.config import ConfigError
    from tokenloom.engine.core_host import cuda_kv_budget

    with caplog.at_level("INFO", logger="tokenloom.engine.core_host"):
        # and the model-source arguments most vLLM scripts pass (no effect on a local model, as in vLLM)
        llm = LLM(str(tiny_dir_for_args), dtype="float32", gpu_memory_utilization=0.5, enforce_eager=True,
                  kv_cache_memory=None, max_model_len=32, trust_remote_code=True, revision="main",
                  tokenizer_revision="main", download_dir="/nonexistent", load_format="auto",
                  compilation_config={"level": 3}, kernel_config={"enable_jit_warmup": False}, use_tqdm_on_load=False)
    try:
        assert "gpu_memory_utilization applies to CUDA devices" in caplog.text
        assert len(llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()
    gib = 1 << 30
    # vLLM's share of the whole GPU, less what is in use (weights, other processes), less the activation reserve.
    assert cuda_kv_budget(free=60 * gib, total=80 * gib, gpu_memory_utilization=0.9) == 72 * gib - 20 * gib - gib
    assert cuda_kv_budget(free=60 * gib, total=80 * gib, gpu_memory_utilization=None) == 54 * gib - gib
    with pytest.raises(ConfigError, match="leaves no room for the KV cache"):
        cuda_kv_budget(free=10 * gib, total=80 * gib, gpu_memory_utilization=0.5)
    for bad, match in ((dict(load_format="dummy"), "load_format 'dummy' is vLLM's"),
                       (dict(trust_remote_code="yes"), "trust_remote_code must be true or false"),
                       (dict(revision=3), "revision must be a string")):
        with pytest.raises(ConfigError, match=match):
            LLM(str(tiny_dir_for_args), **bad)
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ConfigError, match="gpu_memory_utilization must be a number in"):
            LLM(str(tiny_dir_for_args), gpu_memory_utilization=bad)


@pytest.fixture(scope="module")
def tiny_dir_for_args(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_args"), arch="llama", seed=5)


def test_delta_outputs_with_async_speculation_structured_outputs_and_bad_words(tiny_dir_for_args) -> None:
    """DELTA is the front end's: under async scheduling with n-gram drafts, a JSON grammar or bad words its
    pieces still add up to the CUMULATIVE run's output (text, token ids, logprobs)."""
    from tokenloom.sampling_params import RequestOutputKind, StructuredOutputsParams

    llm = LLM(str(tiny_dir_for_args), dtype="float32", num_blocks=128, block_size=4, max_model_len=64,
              async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.llm_engine
    try:
        for extra in ({}, {"structured_outputs": StructuredOutputsParams(json={"type": "object"})},
                      {"bad_words": ["the"]}):
            runs = {}
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
                params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1,
                                        output_kind=kind, **extra)
                rid = engine.add_request(None, "one two three one two three one two", params)
                outs = []
                while engine.has_unfinished_requests():
                    outs += [o for o in engine.step() if o.request_id == rid]
                runs[kind] = outs
            last, deltas = runs[RequestOutputKind.CUMULATIVE][-1].outputs[0], runs[RequestOutputKind.DELTA]
            assert "".join(o.outputs[0].text for o in deltas) == last.text, extra
            assert [t for o in deltas for t in o.outputs[0].token_ids] == last.token_ids, extra
            assert sum(len(o.outputs[0].logprobs) for o in deltas) == len(last.logprobs) == len(last.token_ids)
    finally:
        llm.shutdown()


def test_refusals_are_vllms_validation_error_with_its_words(tiny) -> None:
    """Code written for vLLM catches `vllm.exceptions.VLLMValidationError`; tokenloom raises it by that name
    (also a ValueError), with the words vLLM's tests match (tests/entrypoints/llm/test_prompt_validation.py,
    test_generate.py, tests/samplers/test_non_finite_params.py)."""
    from tokenloom.exceptions import ValidationError, VLLMValidationError

    assert VLLMValidationError is ValidationError and issubclass(VLLMValidationError, ValueError)
    with pytest.raises(VLLMValidationError, match="decoder prompt cannot be empty"):
        tiny.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="out of vocabulary"):
        tiny.generate({"prompt_token_ids": [999999]}, GREEDY, use_tqdm=False)
    with pytest.raises(VLLMValidationError) as exc:
        tiny.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert exc.value.parameter == "sampling_params"
    with pytest.raises(VLLMValidationError, match="priority"):
        tiny.generate(["a", "b"], GREEDY, priority=[], use_tqdm=False)
    for field in ("temperature", "repetition_penalty"):
        with pytest.raises(VLLMValidationError, match=field):
            SamplingParams(**{field: float("nan")})
    with pytest.raises(VLLMValidationError, match="decoder prompt cannot be empty"):
        tiny.beam_search([""], BeamSearchParams(beam_width=2, max_tokens=2))


def test_max_logprobs_is_an_engine_argument_and_flat_logprobs_read_as_the_lists(tiny_dir_for_args) -> None:
    """vLLM's LLM(max_logprobs=N) caps logprobs / prompt_logprobs when a request is added (its words), and
    SamplingParams(flat_logprobs=True) hands back FlatLogprobs holding what the lists hold (vLLM's
    tests/samplers/test_logprobs.py takes both)."""
    from tokenloom.exceptions import VLLMValidationError
    from tokenloom.logprobs import FlatLogprobs

    llm = LLM(str(tiny_dir_for_args), dtype="float32", num_blocks=64, block_size=4, max_model_len=64,
              max_logprobs=3)
    try:
        with pytest.raises(VLLMValidationError, match="Requested sample logprobs of 4, which is greater than max "
                                                      "allowed: 3"):
            llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="Requested prompt logprobs of 5, which is greater than max "
                                                      "allowed: 3") as exc:
            llm.generate("Hello", SamplingParams(max_tokens=2, prompt_logprobs=5), use_tqdm=False)
        assert exc.value.parameter == "prompt_logprobs"
        assert llm.llm_engine.get_num_unfinished_requests() == 0
        runs = {flat: llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                                                 prompt_logprobs=3, flat_logprobs=flat),
                                   use_tqdm=False)[0] for flat in (False, True)}
    finally:
        llm.shutdown()
    lists, flat = runs[False], runs[True]
    assert isinstance(lists.outputs[0].logprobs, list) and isinstance(lists.prompt_logprobs, list)
    assert isinstance(flat.outputs[0].logprobs, FlatLogprobs) and isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert flat.outputs[0].token_ids == lists.outputs[0].token_ids
    assert list(flat.outputs[0].logprobs) == lists.outputs[0].logprobs
    assert flat.prompt_logprobs[0] == {} and lists.prompt_logprobs[0] is None  # vLLM's: None reads back as {}
    assert list(flat.prompt_logprobs[1:]) == lists.prompt_logprobs[1:]
    assert len(flat.outputs[0].logprobs[1:3]) == 2 and flat.outputs[0].logprobs[1:3][0] == lists.outputs[0].logprobs[1]


def test_logprobs_past_twenty_and_the_whole_vocabulary_follow_the_engines_cap(tiny_dir_for_args) -> None:
    """vLLM's SamplingParams takes any count or -1 (the whole vocabulary); the LLM's max_logprobs decides when
    the request is added. SamplingParams refused 21 and -1 when made, so LLM(max_logprobs=-1) could never be
    used offline."""
    from tests.tiny_models import TINY_VOCAB
    from tokenloom.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="logprobs must be non-negative or -1, got -2."):
        SamplingParams(logprobs=-2)
    whole = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    capped = LLM(str(tiny_dir_for_args), dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    try:
        with pytest.raises(VLLMValidationError, match=f"Requested sample logprobs of {TINY_VOCAB}, which is greater "
                                                      "than max allowed: 20"):
            capped.generate("Hello", whole, use_tqdm=False)
    finally:
        capped.shutdown()
    llm = LLM(str(tiny_dir_for_args), dtype="float32", num_blocks=64, block_size=4, max_model_len=64,
              max_logprobs=-1)
    try:
        out = llm.generate("Hello there", whole, use_tqdm=False)[0]
        assert all(len(entry) == TINY_VOCAB for entry in out.outputs[0].logprobs)
        assert all(len(entry) == TINY_VOCAB for entry in out.prompt_logprobs[1:])
        assert whole.logprobs == -1  # the caller's params are left as they were
        out = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=2, logprobs=25),
                           use_tqdm=False)[0]
        assert all(len(entry) in (25, 26) for entry in out.outputs[0].logprobs)
    finally:
        llm.shutdown()


def test_chat_takes_priority_as_generate_does(tiny) -> None:
    """vLLM's LLM.chat(priority=...) (tests/entrypoints/llm/test_chat.py::test_chat_priority): one value for every
    conversation or one each, a list of the wrong length refused by name; it was an unknown keyword here."""
    from tokenloom.exceptions import VLLMValidationError

    chat = [{"role": "user", "content": "Hello"}]
    assert len(tiny.chat(chat, GREEDY, use_tqdm=False, priority=1)) == 1
    assert len(tiny.chat([chat, chat], GREEDY, use_tqdm=False, priority=[0, 1])) == 2
    with pytest.raises(VLLMValidationError, match="priority"):
        tiny.chat([chat, chat], GREEDY, use_tqdm=False, priority=[0])
    assert tiny.llm_engine.get_num_unfinished_requests() == 0


def test_a_prompt_filling_the_context_is_refused_in_vllms_offline_words(tiny) -> None:
    """vLLM's input processor, which its tests/v1/e2e/general/test_context_length.py matches: a prompt exactly
    max_model_len long leaves no room for the one output token. One token shorter runs."""
    from tokenloom.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as exc:
        tiny.generate({"prompt_token_ids": [43] * 64}, GREEDY, use_tqdm=False)
    assert ("The decoder prompt (length 64) plus the number of requested output tokens (at least 1) is longer than "
            "the maximum model length of 64. Make sure that `max_model_len` is no smaller than the number of text "
            "tokens (prompt + requested output tokens).") in str(exc.value)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    assert len(tiny.generate({"prompt_token_ids": [43] * 63}, one, use_tqdm=False)[0].outputs[0].token_ids) == 1
    with pytest.raises(VLLMValidationError, match="maximum context length is 64"):  # longer: vLLM's renderer's
        tiny.generate({"prompt_token_ids": [43] * 65}, GREEDY, use_tqdm=False)


def test_request_output_add_merges_delta_outputs_into_the_cumulative_one(tiny) -> None:
    """vLLM's RequestOutput.add: the DELTA outputs of a request, each merged into the first with aggregate=True,
    are the CUMULATIVE run's final output (every completion of n=2: text, token ids, logprobs, finish); with
    aggregate=False a later output replaces the completion of its index. It did not exist here. Each output of
    the n=2 stream carries one child (vLLM's shape), so the whole one is the outputs merged."""
    from tokenloom.sampling_params import RequestOutputKind

    def run(kind: RequestOutputKind) -> list:
        engine = tiny.llm_engine
        engine.add_request("add-" + kind.name, "Hello there", SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=1, output_kind=kind))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs

    # Each streamed output of n=2 carries one child (vLLM's ParentRequest.get_outputs): the CUMULATIVE run's
    # outputs merged with aggregate=False hold each child's last (whole) completion.
    cumulative = run(RequestOutputKind.CUMULATIVE)
    final = {c.index: c for out in cumulative for c in out.outputs}
    first = cumulative[0]
    for out in cumulative[1:]:
        first.add(out, aggregate=False)
    assert sorted((c.index, c.text) for c in first.outputs) == sorted((i, c.text) for i, c in final.items())
    deltas = run(RequestOutputKind.DELTA)
    merged = deltas[0]
    for out in deltas[1:]:
        merged.add(out, aggregate=True)
    assert merged.finished and len(merged.outputs) == 2 and len(final) == 2
    for a in merged.outputs:
        b = final[a.index]
        assert (a.text, list(a.token_ids), a.finish_reason) == (b.text, list(b.token_ids), b.finish_reason)
        assert [list(lp) for lp in a.logprobs] == [list(lp) for lp in b.logprobs]
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)


def test_llm_engine_step_streams_n_children_one_at_a_time(tiny) -> None:
    """vLLM 0.32's LLMEngine.step with n > 1 (ParentRequest.get_outputs): with DELTA and CUMULATIVE each
    RequestOutput carries the one child that progressed (its index says which), a finished child is not sent
    again, `finished` comes with the output finishing the last child; FINAL_ONLY gives all n once. The children
    are the same in every kind; an abort ends the unfinished children in one final output."""
    from tests.n_stream_shape import check_final_only, check_staggered, check_streamed, staggered_params
    from tokenloom.sampling_params import RequestOutputKind

    engine = tiny.llm_engine

    def run(kind: RequestOutputKind) -> list:
        engine.add_request("nstep-" + kind.name, "Hello there", staggered_params(kind))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs

    finals = check_final_only(run(RequestOutputKind.FINAL_ONLY))
    check_staggered(finals)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        assert check_streamed(run(kind), kind, one_child_each=True) == finals
    engine.add_request("nstep-abort", "Hello", SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=40,
                                                             ignore_eos=True))
    first = engine.step()
    assert sorted(c.index for o in first for c in o.outputs) == [0, 1, 2] and not any(o.finished for o in first)
    (cut,) = engine.abort_request("nstep-abort")
    assert cut.finished and [(c.index, c.finish_reason) for c in cut.outputs] == [(i, "abort") for i in range(3)]
    assert not engine.has_unfinished_requests()


def test_sleep_and_wake_up_without_sleep_mode(tiny, caplog) -> None:
    """vLLM's LLM.sleep() / wake_up() on a platform without sleep mode (its CPU): scheduling pauses, level 1 drops the
    prefix cache and its executor tags sleep (nothing freed, vLLM's CPU worker's warning); requests added meanwhile
    wait for wake_up; generate() while asleep is refused (vLLM would wait forever); modes abort / wait / keep."""
    engine = tiny.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = tiny.generate("Sleepy prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    with caplog.at_level("WARNING", logger="tokenloom.engine.sleep"):
        tiny.sleep(level=1)
    assert engine.is_sleeping() and "sleep mode is not supported on CPU, ignore it." in caplog.text
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 128  # the prefix cache dropped
    with pytest.raises(RuntimeError, match="the engine is sleeping .* call LLM.wake_up"):
        tiny.generate("Sleepy prompt", params, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # the refused generate took its requests back
    engine.add_request("held", "Sleepy prompt", params)
    assert engine.step() == [] and not engine.scheduler.has_unfinished_requests()  # held, not scheduled
    assert tiny.wake_up(tags=["weights"]) is False and engine.is_sleeping()  # kv_cache still asleep
    assert tiny.wake_up(tags=["kv_cache"]) is True and not engine.is_sleeping()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected
    # level 0 pauses only; "scheduling" resumes it. keep: a running request stays and goes on after wake_up.
    engine.add_request("kept", "Sleepy prompt", params)
    engine.step()
    tiny.sleep(level=0, mode="keep")
    assert engine.step() == [] and engine.has_unfinished_requests()
    assert tiny.wake_up(tags=["scheduling"]) is True
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "kept" and outs[-1].outputs[0].token_ids == expected
    # abort ends what runs (its final output comes from the next step); wait lets it finish first.
    for mode, reason in (("abort", "abort"), ("wait", "length")):
        engine.add_request(mode, "Sleepy prompt", params)
        engine.step()
        tiny.sleep(level=1, mode=mode)
        final = engine.step()
        assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in final][-1] == (mode, True, reason)
        assert not engine.has_unfinished_requests() and tiny.wake_up() is True
    with pytest.raises(ValueError, match="Invalid pause mode: later"):
        tiny.sleep(mode="later")
    assert not engine.is_sleeping()


def test_hf_overrides_on_the_default_model_run_its_first_layers() -> None:
    """vLLM's hf_overrides on the default (GGUF, quantized) model, as a callable: it runs on the GGUF's config in
    Hugging Face's names, its change (num_hidden_layers 2) is what the load applies, the later layers are not
    loaded, and the truncated model generates."""

    def two_layers(config):  # noqa: ANN001, ANN202 - a transformers LlamaConfig
        config.num_hidden_layers = 2
        return config

    llm = LLM(hf_overrides=two_layers, max_model_len=256, num_blocks=64)
    try:
        assert llm.llm_engine.config.hf_overrides == {"num_hidden_layers": 2}
        assert llm.llm_engine.model_config.num_hidden_layers == 2
        assert len(llm.llm_engine.runner.model.layers) == 2
        out = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 6
    finally:
        llm.shutdown()
