"""vLLM's sampling extensions through the real engine (tiny model): prompt_logprobs against the
reference forward, logit_bias, allowed_token_ids, logprob_token_ids, and get_tokenizer()'s
transformers-shaped apply_chat_template."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_hf_model
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 9, 101, 33, 7, 250, 64, 12, 90, 3, 44]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    # A small budget: the prompt is computed in chunks, so prompt_logprobs are stitched across steps.
    return LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=5,
               max_num_seqs=4)


def _reference_logprobs(tiny_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_match_the_reference_forward(tiny, tiny_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    out = tiny.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    ref = _reference_logprobs(tiny_dir, PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = plp[pos]
        tok = PROMPT[pos]
        assert tok in entry, pos
        assert entry[tok].logprob == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
        assert entry[tok].rank == int((ref[pos - 1] >= ref[pos - 1, tok]).sum())
        assert set(ref[pos - 1].topk(3).indices.tolist()) <= set(entry)
    # No prefix-cache shortcut for a prompt_logprobs request: a second run scores the whole prompt again.
    again = tiny.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert [None if e is None else e[t].logprob for e, t in zip(again.prompt_logprobs, PROMPT)] == \
           [None if e is None else e[t].logprob for e, t in zip(plp, PROMPT)]


def test_allowed_token_ids_and_logit_bias_steer_sampling(tiny) -> None:
    greedy = tiny.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=6,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    free = greedy.outputs[0].token_ids
    allowed = [11, 22, 33]
    for temperature in (0.0, 1.0):
        out = tiny.generate([{"prompt_token_ids": PROMPT}],
                            SamplingParams(temperature=temperature, max_tokens=8, allowed_token_ids=allowed,
                                           ignore_eos=True, seed=1), use_tqdm=False)[0]
        assert set(out.outputs[0].token_ids) <= set(allowed)
    target = 77 if free[0] != 77 else 78
    biased = tiny.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=6, logit_bias={target: 100.0},
                                          ignore_eos=True), use_tqdm=False)[0]
    assert biased.outputs[0].token_ids == [target] * 6
    banned = tiny.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=1, logit_bias={free[0]: -100.0},
                                          ignore_eos=True), use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != free[0]


def test_logprob_token_ids_report_exactly_those_tokens(tiny, tiny_dir) -> None:
    wanted = [8, 16, 300]
    out = tiny.generate([{"prompt_token_ids": PROMPT}],
                        SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, logprob_token_ids=wanted,
                                       ignore_eos=True), use_tqdm=False)[0]
    entry = out.outputs[0].logprobs[0]
    sampled = out.outputs[0].token_ids[0]
    assert set(entry) == set(wanted) | {sampled}
    ref = _reference_logprobs(tiny_dir, PROMPT)[-1]
    for t in wanted:
        assert entry[t].logprob == pytest.approx(ref[t].item(), abs=1e-4)


def test_get_tokenizer_apply_chat_template_is_transformers_shaped(tiny) -> None:
    tok = tiny.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)  # tokenize=True by default
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and tok.encode(text, add_special_tokens=False) == ids
    # transformers' default: no generation prompt.
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"] == ids
