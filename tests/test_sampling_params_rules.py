"""SamplingParams holds vLLM 0.32's rules (vllm/sampling_params.py) with its messages, so the offline LLM
and the server refuse and accept the same values vLLM does."""

from __future__ import annotations

import pytest

from tokenloom.sampling_params import (
    MAX_STRUCTURED_OUTPUT_JSON_NESTING,
    SamplingParams,
    StructuredOutputsParams,
    check_json_nesting,
)
from tokenloom.server.errors import APIError
from tokenloom.server.params import check_request_chat_template
from tokenloom.server.protocol import ChatCompletionRequest


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 2, "temperature": 0.0}, "n must be 1 when using greedy sampling, got 2."),
    ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": -0.1}, "temperature must be non-negative"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
    ({"n": 0}, "n must be at least 1, got 0."),
    ({"n": 20_000}, "VLLM_MAX_N_SEQUENCES"),
    ({"n": True}, "n must be an int"),
    ({"logit_bias": {"x": 1.0, "7": 2.0, "9" * 5000: 1.0}}, "cannot be converted to integer token IDs"),
])  # fmt: skip
def test_vllm_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_vllm_acceptances():
    assert SamplingParams(seed=-1).seed is None  # -1: no seed
    assert SamplingParams(repetition_penalty=3.0).repetition_penalty == 3.0  # any finite value > 0
    assert SamplingParams(temperature=2.0, n=4).n == 4
    assert SamplingParams(n=1, temperature=0.0).greedy
    assert SamplingParams(logit_bias={"5": 300.0}).logit_bias == {5: 100.0}  # clamped


def test_max_n_follows_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    SamplingParams(n=4, temperature=1.0)
    with pytest.raises(ValueError, match="n must be at most 4, got 5"):
        SamplingParams(n=5, temperature=1.0)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_json_nesting_bound():
    # {"type": "object", "properties": {...}}: two JSON levels per schema level.
    ok = _nested(MAX_STRUCTURED_OUTPUT_JSON_NESTING // 2)
    check_json_nesting(ok)
    StructuredOutputsParams(json=ok).check_request("auto")
    deep = StructuredOutputsParams(json=_nested(MAX_STRUCTURED_OUTPUT_JSON_NESTING))  # made; refused as a request
    with pytest.raises(ValueError, match="nested too deeply"):
        deep.check_request("auto")
    with pytest.raises(ValueError, match="nested too deeply"):
        check_json_nesting("[" * 100_000 + "]" * 100_000)  # too deep even for json.loads: no RecursionError
    check_json_nesting("not json")  # malformed text is the grammar backend's to report


def test_request_chat_template_needs_trust():
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template": "{{ 'X' }}"})
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        check_request_chat_template(chat, trusted=False)
    check_request_chat_template(chat, trusted=True)
    kwargs = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                   "chat_template_kwargs": {"chat_template": "y"}})
    with pytest.raises(APIError):
        check_request_chat_template(kwargs, trusted=False)
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    check_request_chat_template(plain, trusted=False)


def test_min_tokens_refusals_use_vllms_words() -> None:
    """vLLM's SamplingParams sentences, which its tests/v1/e2e/general/test_min_tokens.py matches."""
    from tokenloom.exceptions import VLLMValidationError
    from tokenloom.sampling_params import SamplingParams as _SP

    with pytest.raises(VLLMValidationError, match="min_tokens must be greater than or equal to 0, got -1"):
        _SP(min_tokens=-1, max_tokens=10)
    with pytest.raises(VLLMValidationError, match="min_tokens must be less than or equal to max_tokens=10, got 15"):
        _SP(min_tokens=15, max_tokens=10)
    _SP(min_tokens=10, max_tokens=10)


def test_logprobs_true_is_one() -> None:
    """vLLM's: `logprobs=True` / `prompt_logprobs=True` ask for one (a bool reached torch's topk: the step failed)."""
    from tokenloom.sampling_params import SamplingParams as _SP

    params = _SP(logprobs=True, prompt_logprobs=True)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    assert type(params.logprobs) is int and type(params.prompt_logprobs) is int
    assert _SP(logprobs=False).logprobs == 0 and type(_SP(logprobs=False).logprobs) is int


def test_top_k_true_is_refused_not_a_failed_step() -> None:
    """A bool top_k passed the integer check and failed the engine step in torch's topk; it is refused."""
    from tokenloom.sampling_params import SamplingParams as _SP

    with pytest.raises(ValueError, match="top_k must be"):
        _SP(top_k=True)


def test_children_of_the_largest_seed_keep_64_bit_seeds() -> None:
    """n > 1: each child samples with seed + index (vLLM's), wrapped into the 64-bit range SamplingParams holds
    seeds to, so a parent seeded at either end of it is no ValueError."""
    from tokenloom.engine.parallel_sampling import ParentRequest

    low = -(2**63)
    for seed, want in ((2**63 - 1, [2**63 - 1, low, low + 1]), (5, [5, 6, 7]), (low, [low, low + 1, low + 2])):
        parent = ParentRequest("r", SamplingParams(n=3, seed=seed))
        assert [parent.get_child_info(i)[1].seed for i in range(3)] == want
