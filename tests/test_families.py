"""Qwen3, Qwen3-MoE, Gemma 2/3, Phi-3 and Mistral against transformers, on tiny random models built
from transformers' own config classes (tests/tiny_models.py; 2 layers, hidden 64, sliding window 8
= two blocks of 4 where the family has one).

* one batch mixing a chunked prefill, prefix-cache hits and decodes (test_model_runner's steps);
* greedy tokens identical to transformers' generate, the real scheduler driving the runner, with a
  prompt longer than the window; for Mistral (every layer windowed) the KV blocks a request holds
  stay bounded by the window while it runs;
* MoE routing: ties go to the lower expert (torch.topk), an expert with no token costs nothing.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import tests.test_model_runner as tmr
from tests.test_model_runner import BLOCK, Tiny, prompt
from tests.tiny_models import make_tiny_hf_model
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sliding_window import SlidingWindowKVCacheManager
from tokenloom.model.loader import load_model
from tokenloom.model.models.qwen3_moe import grouped_experts, route
from tokenloom.sampling_params import SamplingParams

FAMILIES = ["qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return Tiny(hf=hf, loaded=load_model(path, torch.float32))


def test_mixed_step_matches_transformers(family: Tiny) -> None:
    tmr.test_mixed_step_matches_transformers(family)


def test_greedy_32_tokens_match_generate(family: Tiny) -> None:
    """Scheduler + runner (chunked prefill of 8-token chunks, prefix caching) generate exactly what
    transformers generates greedily, past the window; a uniformly windowed model's requests hold a
    bounded number of blocks."""
    window = family.loaded.config.sliding_windows
    uniform = window[0] if all(w is not None for w in window) else None
    num_blocks = 40
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=True, sliding_window=uniform),
        clock=lambda: 0.0,
    )
    assert isinstance(sched.kv_cache_manager, SlidingWindowKVCacheManager) == (uniform is not None)
    runner = family.runner(num_blocks=num_blocks)
    shared = prompt(40, 12)
    prompts = {"a": shared + prompt(41, 7), "b": shared + prompt(42, 3)}
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)))
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    most_held = 0
    for _ in range(300):
        if not sched.has_requests():
            break
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute_model(so)):
            assert out.error is None
            generated[out.request_id] += out.new_token_ids
        if uniform is not None:
            kv = sched.kv_cache_manager
            most_held = max([most_held] + [kv.num_blocks_held(r) for r in kv.req_to_blocks])
    if uniform is not None:  # 19 + 32 tokens = 13 blocks without freeing; the window keeps <= 5
        assert 0 < most_held <= -(-(uniform - 1 + 8) // BLOCK) + 1, most_held
    for rid, p in prompts.items():
        expected = family.hf.generate(
            torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p):].tolist()
        assert generated[rid] == expected, rid


def test_moe_routing_ties_and_idle_expert() -> None:
    # Token 0: experts 1 and 2 tie for the top: topk keeps the lower index first (as transformers).
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [3.0, -5.0, 1.0, -5.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2], [0, 2]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    # Expert 3 receives no token: it is skipped, and the result equals the per-token reference.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g)
    w_gate_up, w_down = torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 3, generator=g)
    w_down[3] = float("nan")  # would poison the output if expert 3 ran on anything
    out = grouped_experts(x, weights, experts, w_gate_up, w_down)
    ref = torch.zeros_like(x)
    for t in range(2):
        for k in range(2):
            e = int(experts[t, k])
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            ref[t] += weights[t, k] * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, ref)
