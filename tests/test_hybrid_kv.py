"""Hybrid KV cache groups (vLLM's HybridKVCacheCoordinator) for models mixing sliding-window and
full-attention layers (Gemma 2/3).

* grouping as vLLM's `_get_kv_cache_groups_uniform_page_size` (group size, layers[i::n], order);
* the KV manager: a sliding group's blocks stay bounded by the window while the full group keeps the
  sequence; a prefix hit is the length every group agrees on; allocation is all-or-nothing across
  groups; preemption and finishing return every block (leak check), and a planted bug (the sliding
  group keeping its blocks) fails the bound;
* a tiny Gemma 3 of 6 layers (3 groups of 2: two sliding, one full, so layers share block slots)
  driven by the real scheduler past the window: logits equal to transformers' at every step, greedy
  tokens equal to generate, a prefix hit through the groups; the engine wires it up (and
  --disable-hybrid-kv-cache-manager gives the same tokens with one group).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.block_pool import NULL_BLOCK
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec, layers_per_block, make_kv_cache_groups
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.single_type_kv_cache_manager import SlidingWindowManager
from tokenloom.sampling_params import SamplingParams

S, F = "sliding_attention", "full_attention"
BS, W = 4, 8


def _req(rid: str, tokens: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_size=BS)


def _hybrid_kv(num_blocks: int, chunk: int = 8, caching: bool = True) -> KVCacheManager:
    """Gemma-2-like: layers sliding, full, sliding, full → one sliding and one full group of 2."""
    groups = make_kv_cache_groups([W, None, W, None])
    return KVCacheManager(num_blocks, BS, 512, enable_caching=caching, kv_cache_groups=groups,
                          max_num_batched_tokens=chunk)


def _assert_no_leak(kv: KVCacheManager) -> None:
    assert all(not m.req_to_blocks and not m.num_cached_block for m in kv.managers)
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


# Grouping ---------------------------------------------------------------------------------------

def test_groups_follow_vllm() -> None:
    gemma3 = [W if (i + 1) % 6 else None for i in range(26)]  # 22 sliding, 4 global (Gemma 3 1B/270M)
    groups = make_kv_cache_groups(gemma3)
    assert len(groups) == 7 and layers_per_block(groups) == 4
    assert [g.sliding_window for g in groups] == [W] * 6 + [None]  # in order of the first layer's type
    assert groups[-1].layer_ids == (5, 11, 17, 23)
    sliding = [i for i, w in enumerate(gemma3) if w]
    assert groups[0].layer_ids == tuple(sliding[0::6])
    assert [len(g.layer_ids) for g in groups[:6]] == [4, 4, 4, 4, 3, 3]  # 22 = 6 * 4 - 2 padding slots
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(26))
    # Gemma 2: alternating → two groups of half the layers each.
    assert make_kv_cache_groups([W, None] * 3) == [KVCacheGroupSpec((0, 2, 4), W), KVCacheGroupSpec((1, 3, 5))]
    # 12 sliding + 13 full: under 1.5x, so one group of each, padded to 13 (gpt-oss's case).
    assert [len(g.layer_ids) for g in make_kv_cache_groups([W] * 12 + [None] * 13)] == [12, 13]
    # One type: one group (Llama; Mistral); hybrid off: one full group (every block kept).
    assert make_kv_cache_groups(None, 4) == [KVCacheGroupSpec((0, 1, 2, 3))]
    assert make_kv_cache_groups([W] * 3) == [KVCacheGroupSpec((0, 1, 2), W)]
    assert make_kv_cache_groups(gemma3, hybrid=False) == [KVCacheGroupSpec(tuple(range(26)))]


# The KV manager ---------------------------------------------------------------------------------

def _prefill(kv: KVCacheManager, req: Request, chunk: int) -> Iterator[list[int]]:
    """Allocate and compute the prompt chunk by chunk; yields blocks held per group after each."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        yield kv.num_blocks_held_per_group(req.request_id)


def test_sliding_group_bounded_full_group_keeps_sequence() -> None:
    kv = _hybrid_kv(128)
    req = _req("long", list(range(200)))
    cap = -(-(W - 1 + 8) // BS) + 1
    for held in _prefill(kv, req, 8):
        sliding, full = held
        assert sliding <= cap
        assert full == -(-req.num_computed_tokens // BS)
    # Freed at the last chunk's allocation (192 computed): the 46 blocks before 192 - W + 1.
    assert kv.num_blocks_held_per_group("long") == [4, 50]  # vs 50 + 50 with every block kept
    sliding_table = kv.get_blocks("long")[0]
    assert sliding_table[:46] == [NULL_BLOCK] * 46 and NULL_BLOCK not in sliding_table[46:]
    kv.free(req)
    _assert_no_leak(kv)


def test_planted_bug_sliding_group_keeping_blocks_fails_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SlidingWindowManager, "num_skipped_tokens", lambda self, n: 0)
    with pytest.raises(AssertionError):
        test_sliding_group_bounded_full_group_keeps_sequence()


def test_prefix_hit_is_the_length_all_groups_agree_on() -> None:
    kv = _hybrid_kv(128, chunk=64)
    tokens = list(range(40))
    first = _req("a", tokens + [100, 101])
    list(_prefill(kv, first, 64))
    second = _req("b", tokens + [200, 201])
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 40 and [len(g) for g in blocks.blocks] == [10, 10]
    # The full group's hit is its blocks; the sliding group's too (freed early blocks keep their hash).
    assert blocks.get_block_ids()[1] == kv.get_block_ids("a")[1][:10]
    pool = kv.block_pool
    # A hole in the sliding group inside the window of block 9: the sliding hit ends at the run of
    # two cached blocks before it (blocks 6, 7 → 32 tokens), and the full group is cut to agree.
    pool.cached_block_hash_to_block.pop(first.block_hashes[8])  # group 0: the plain hash
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 32 and [len(g) for g in blocks.blocks] == [8, 8]
    assert blocks.blocks[0][:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in blocks.blocks[1]
    # A hole early in the full group: the hit stops before it, whatever the sliding group has.
    pool.cached_block_hash_to_block.pop((first.block_hashes[3], 1))
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 12 and [len(g) for g in blocks.blocks] == [3, 3]
    # Adopting the hit: both groups' blocks are taken; the run continues from 12 tokens.
    assert kv.allocate_slots(second, 30, hit, blocks) is not None
    assert kv.get_block_ids("b")[1][:3] == kv.get_block_ids("a")[1][:3]
    kv.free(first)
    kv.free(second)
    _assert_no_leak(kv)


def test_allocation_is_all_or_nothing_across_groups() -> None:
    kv = _hybrid_kv(14)
    a = _req("a", list(range(24)))
    assert kv.allocate_slots(a, 24) is not None  # 6 blocks in each group (one step: nothing left the window)
    b = _req("b", list(range(100, 108)))
    # b needs 2 + 2 blocks; 2 are free: the first group alone would fit, so it must not take them.
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_pool.get_num_free_blocks() == 2 and "b" not in kv.req_to_blocks
    assert all("b" not in m.req_to_blocks for m in kv.managers)
    kv.free(a)
    _assert_no_leak(kv)


def test_preemption_and_finish_return_every_block() -> None:
    """Several long requests on a pool too small for all of them: preemptions happen, each victim's
    blocks (both groups) return at once, everyone finishes, and nothing is left held."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256),
        CacheConfig(block_size=BS, num_blocks=40, enable_prefix_caching=True, layer_windows=(W, None, W, None)),
        clock=lambda: 0.0,
    )
    kv = sched.kv_cache_manager
    assert len(kv.managers) == 2
    for i in range(4):
        sched.add_request(_req(f"r{i}", [i + 1] * 5 + list(range(40)), max_tokens=40))
    preempted = 0
    for _ in range(500):
        if not sched.has_requests():
            break
        so = sched.schedule()
        preempted += len(so.preempted_req_ids)
        # Every scheduled request has a table per group long enough for this step's tokens (the
        # scheduler has already advanced num_computed_tokens past them).
        for rid in so.num_scheduled_tokens:
            end = sched.requests[rid].num_computed_tokens
            assert all(len(t) >= -(-end // BS) for t in kv.get_block_ids(rid))
        samples = [rid for rid in so.num_scheduled_tokens
                   if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens]
        out = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                                req_id_to_index={r: i for i, r in enumerate(so.num_scheduled_tokens)},
                                sampled_token_ids=[[7] if r in samples else [] for r in so.num_scheduled_tokens])
        sched.update_from_output(so, out)
    assert not sched.has_requests() and preempted > 0
    _assert_no_leak(kv)


def test_a_request_that_cannot_fit_every_group_is_rejected() -> None:
    """The never-fits check counts every group: 100 tokens need 25 full blocks plus at most
    cdiv(7 + 8, 4) + 1 = 5 sliding ones; 25 fit a 29-block pool alone, 30 do not."""
    from tokenloom.core.scheduler import RequestRejected

    def sched(num_blocks: int) -> Scheduler:
        return Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256),
                         CacheConfig(block_size=BS, num_blocks=num_blocks, layer_windows=(W, None)), clock=lambda: 0.0)

    with pytest.raises(RequestRejected, match="30 KV-cache blocks are needed"):
        sched(29).add_request(_req("big", list(range(60)), max_tokens=41))
    sched(30).add_request(_req("big", list(range(60)), max_tokens=41))


# A tiny Gemma 3 against transformers --------------------------------------------------------------

LAYER_TYPES = [S, S, F, S, S, F]  # 4 sliding + 2 full → group size 2: sliding (0, 3), (1, 4); full (2, 5)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from tests.test_model_runner import Tiny
    from tests.tiny_models import make_tiny_hf_model
    from tokenloom.model.loader import load_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("gemma3_hybrid"), arch="gemma3", seed=11,
                              num_hidden_layers=6, layer_types=LAYER_TYPES)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, Tiny(hf=hf, loaded=load_model(path, torch.float32))


def test_gemma3_hybrid_groups_match_transformers_past_the_window(gemma3) -> None:  # noqa: ANN001
    from tests.test_model_runner import prompt

    _, tiny = gemma3
    windows = tuple(tiny.loaded.config.sliding_windows)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=BS, num_blocks=60, enable_prefix_caching=True, layer_windows=windows),
        clock=lambda: 0.0,
    )
    kv = sched.kv_cache_manager
    assert [g.layer_ids for g in kv.kv_cache_groups] == [(0, 3), (1, 4), (2, 5)]
    runner = tiny.runner(num_blocks=60, path="torch", kv_cache_groups=kv.kv_cache_groups)
    shared = prompt(50, 21)
    prompts = {"a": shared + prompt(51, 9), "b": shared + prompt(52, 5)}
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
    seqs = {rid: list(p) for rid, p in prompts.items()}
    hits, most_held, checked = {}, [0, 0, 0], 0
    for _ in range(200):
        if not sched.has_requests():
            break
        so = sched.schedule()
        hits.update({n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs})
        for rid in so.num_scheduled_tokens:
            most_held = [max(m, h) for m, h in zip(most_held, kv.num_blocks_held_per_group(rid))]
        runner.last_logits_index = {}  # a step that samples nothing leaves the last one's
        out = runner.execute_model(so, return_logits=True)
        for rid in runner.last_logits_index:  # every sampling row, prefill end or decode
            ours = runner.last_logits[runner.last_logits_index[rid]]
            torch.testing.assert_close(ours, tiny.last_logits(seqs[rid]), atol=1e-4, rtol=0, msg=rid)
            checked += 1
        for o in sched.update_from_output(so, out):
            assert o.error is None
            seqs[o.request_id] += o.new_token_ids
    assert checked == 2 * 24
    # "b" hits "a"'s 20 shared tokens (5 blocks) in every group; its hit starts its first step.
    assert hits == {"a": 0, "b": 20}
    # 30 + 24 tokens: the full group holds all 14 blocks; the sliding groups cdiv(7 + 8, 4) + 1 = 5 at most.
    assert most_held[2] == 14 and max(most_held[:2]) <= 5, most_held
    for rid, p in prompts.items():
        expected = tiny.hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist()
        assert seqs[rid][len(p):] == expected, rid
    _assert_no_leak(kv)


@pytest.mark.parametrize("disable", [False, True])
def test_engine_builds_hybrid_groups(gemma3, disable: bool) -> None:  # noqa: ANN001
    """The engine derives the groups from the model and hands them to scheduler and runner; with
    --disable-hybrid-kv-cache-manager one full group keeps every block, and the tokens are the same."""
    from tests.test_model_runner import prompt
    from tokenloom.engine.llm_engine import LLMEngine

    path, tiny = gemma3
    engine = LLMEngine.from_args(str(path), dtype="float32", num_blocks=64, block_size=BS, max_model_len=96,
                                 max_num_batched_tokens=16, max_num_seqs=4,
                                 disable_hybrid_kv_cache_manager=disable)
    groups = engine.scheduler.kv_cache_manager.kv_cache_groups
    assert len(groups) == (1 if disable else 3) and engine.runner.kv_cache_groups == groups
    p = prompt(60, 30)
    engine.add_request("x", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    expected = tiny.hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
    assert tokens == expected


def test_kv_cache_layout_shares_block_slots(gemma3) -> None:  # noqa: ANN001
    """A block holds one group's layers: 2 slots here, not 6; layer 0 and layer 1 (different groups,
    same slot) share memory, layers 0 and 3 (same group) do not."""
    _, tiny = gemma3
    runner = tiny.runner(num_blocks=8, path="torch", kv_cache_groups=make_kv_cache_groups(
        tuple(tiny.loaded.config.sliding_windows)))
    k = [kv[0] for kv in runner.kv_caches]
    base = k[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in k)
    assert k[0].data_ptr() == k[1].data_ptr() == k[2].data_ptr()
    assert k[3].data_ptr() == k[4].data_ptr() == k[5].data_ptr() != k[0].data_ptr()
    assert k[0].untyped_storage().nbytes() == 2 * 2 * k[0].numel() * k[0].element_size()
