"""ModelRunner against Hugging Face transformers on tiny random Llama / Qwen2 models.

SchedulerOutputs are built by hand so each step mixes exactly the cases under test: a chunked
prefill continuing from an earlier step, prefix-cache hits that share already-written blocks,
decodes, and a one-token "prefill" that rides the decode path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import TINY_VOCAB, make_tiny_hf_model
from tokenloom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.model.attention import kv_cache_bytes_per_block
from tokenloom.model.loader import LoadedModel, load_model
from tokenloom.model.platform import cpu_supports_bf16, resolve_device, resolve_dtype
from tokenloom.model.runner import ModelRunner
from tokenloom.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 96
ATOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@dataclass
class Tiny:
    hf: torch.nn.Module
    loaded: LoadedModel

    def runner(self, dtype: str = "float32", num_blocks: int = NUM_BLOCKS, path: str | None = None,
               kv_cache_groups: list | None = None) -> ModelRunner:
        """`path`: None (the default choice), "torch" (the pure-torch path, also the CUDA one) or "kernels"
        (the compiled CPU kernels; the test is skipped when they do not build). `kv_cache_groups`: the
        scheduler's (None: one group of every layer)."""
        kernels = {None: None, "torch": False, "kernels": True}[path]
        if path == "kernels":
            from tokenloom.model.kernels import cpu_kernels

            if cpu_kernels() is None:
                pytest.skip("the compiled CPU kernels are unavailable (no C++ compiler?)")
        runner = ModelRunner(self.loaded, block_size=BLOCK, num_blocks=num_blocks, dtype=dtype, device="cpu",
                             cpu_kernels=kernels, kv_cache_groups=kv_cache_groups)
        if path is not None:
            assert runner.use_kernels == (path == "kernels")  # the path under test is the one that runs
        return runner

    def last_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0, -1].float()


_CASES = {
    "llama": dict(arch="llama", tie=False),
    "llama3-rope": dict(arch="llama", tie=False, rope_parameters=LLAMA3_ROPE),
    "qwen2-tied": dict(arch="qwen2", tie=True),
}


@pytest.fixture(scope="module", params=list(_CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), seed=1, **_CASES[request.param])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return Tiny(hf=hf, loaded=load_model(path, torch.float32))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return Tiny(hf=hf, loaded=load_model(path, torch.float32))


# --------------------------------------------------------------------------- building steps by hand

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def new_req(
    rid: str, tokens: list[int], blocks: list[int] | tuple[list[int], ...], computed: int = 0,
    prompt: list[int] | None = None,
) -> NewRequestData:
    """`blocks`: the block table (one KV cache group), or a tuple of tables (one per group)."""
    tables = tuple(list(b) for b in blocks) if isinstance(blocks, tuple) else (list(blocks),)
    return NewRequestData(rid, list(prompt or tokens), list(tokens), GREEDY, tables, computed)


def step(
    scheduled: dict[str, int],
    new: list[NewRequestData] = (),
    cached: list[tuple[str, list[int], int]] = (),
    finished: set[str] = frozenset(),
    preempted: set[str] = frozenset(),
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[c[0] for c in cached],
            new_block_ids=[c[1] if isinstance(c[1], tuple) else (c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist()


def assert_logits_match(runner: ModelRunner, tiny: Tiny, seqs: dict[str, list[int]], atol: float = ATOL) -> None:
    assert runner.last_logits is not None
    for rid, tokens in seqs.items():
        ours = runner.last_logits[runner.last_logits_index[rid]]
        torch.testing.assert_close(ours, tiny.last_logits(tokens), atol=atol, rtol=0, msg=rid)


# --------------------------------------------------------------------------- tests


# Both forward paths against transformers: the fused kernels run by default on CPU, so without this the
# torch path (the CUDA path and the fallback) would never be compared when the kernels build.
PATHS = pytest.mark.parametrize("path", ["torch", "kernels"])


@PATHS
def test_mixed_step_matches_transformers(tiny: Tiny, path: str) -> None:
    runner = tiny.runner(path=path)
    pa, pb, pc, pe = prompt(1, 13), prompt(2, 10), prompt(3, 6), prompt(4, 1)
    # Step 1: A's first chunk (no sample), full prefills of B and C, E's one-token prompt.
    out1 = runner.execute_model(
        step(
            {"A": 8, "B": 10, "C": 6, "E": 1},
            new=[new_req("A", pa, [10, 11]), new_req("B", pb, [20, 21, 22]), new_req("C", pc, [30, 31]),
                 new_req("E", pe, [40])],
        ),
        return_logits=True,
    )
    assert out1.sampled_token_ids[out1.req_id_to_index["A"]] == []
    assert_logits_match(runner, tiny, {"B": pb, "C": pc, "E": pe})
    b1, c1, e1 = (out1.sampled_token_ids[out1.req_id_to_index[r]][0] for r in "BCE")

    # Step 2: A's second chunk (+2 blocks), decodes of B, C, E; F hits B's first 2 blocks (8 tokens)
    # and computes only its last 5; G hits C's first block and has a single token left (decode path).
    pf = pb[:8] + prompt(5, 5)
    pg = pc[:4] + prompt(6, 1)
    out2 = runner.execute_model(
        step(
            {"A": 5, "B": 1, "C": 1, "E": 1, "F": 5, "G": 1},
            new=[new_req("F", pf, [20, 21, 50, 51], computed=8), new_req("G", pg, [30, 60], computed=4)],
            cached=[("A", [12, 13], 8), ("B", [], 10), ("C", [], 6), ("E", [], 1)],
        ),
        return_logits=True,
    )
    assert all(len(t) == 1 for t in out2.sampled_token_ids)
    assert_logits_match(
        runner, tiny, {"A": pa, "B": pb + [b1], "C": pc + [c1], "E": pe + [e1], "F": pf, "G": pg}
    )

    # Step 3: everyone decodes, with the tokens the runner appended itself.
    tok = {r: out2.sampled_token_ids[out2.req_id_to_index[r]][0] for r in "ABCEFG"}
    runner.execute_model(
        step(
            {r: 1 for r in "ABCEFG"},
            cached=[("A", [], 13), ("B", [], 11), ("C", [], 7), ("E", [], 2), ("F", [52], 13), ("G", [], 5)],
        ),
        return_logits=True,
    )
    seqs = {"A": pa, "B": pb + [b1], "C": pc + [c1], "E": pe + [e1], "F": pf, "G": pg}
    assert_logits_match(runner, tiny, {r: s + [tok[r]] for r, s in seqs.items()})


@PATHS
def test_decode_groups_match_transformers(llama: Tiny, path: str) -> None:
    """Decodes of very different context lengths: on the torch path split into several padded attention
    calls (the group bounds are its knobs); the kernels attend over each block table as it is."""
    runner = llama.runner(path=path)
    runner.decode_group_min, runner.decode_group_max = 1, 2
    lengths = [3, 30, 7, 17, 12, 25]
    prompts = {f"r{i}": prompt(40 + i, n) for i, n in enumerate(lengths)}
    new, next_block = [], 0
    for rid, p in prompts.items():
        nb = len(p) // BLOCK + 1
        new.append(new_req(rid, p, list(range(next_block, next_block + nb))))
        next_block += nb
    out = runner.execute_model(step({r: len(p) for r, p in prompts.items()}, new=new))
    seqs = {r: p + out.sampled_token_ids[out.req_id_to_index[r]] for r, p in prompts.items()}
    runner.execute_model(
        step({r: 1 for r in prompts}, cached=[(r, [], len(p)) for r, p in prompts.items()]), return_logits=True
    )
    assert_logits_match(runner, llama, seqs)


def test_dtype_and_device_resolution() -> None:
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    auto = resolve_dtype("auto", torch.device("cpu"))
    assert auto == (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8", torch.device("cpu"))


def test_prefix_hit_reads_shared_blocks(llama: Tiny) -> None:
    """The cached positions are read from the cache, not recomputed: corrupting them shows."""
    pb = prompt(7, 12)
    pf = pb[:8] + prompt(8, 3)
    logits = []
    for corrupt in (False, True):
        runner = llama.runner()
        runner.execute_model(step({"B": 12}, new=[new_req("B", pb, [5, 6, 7])]))
        if corrupt:
            for k, v in runner.kv_caches:
                k[:, 6].normal_()
                v[:, 6].normal_()
        runner.execute_model(
            step({"F": 3}, new=[new_req("F", pf, [5, 6, 9], computed=8)], finished={"B"}), return_logits=True
        )
        logits.append(runner.last_logits[0].clone())
    torch.testing.assert_close(logits[0], llama.last_logits(pf), atol=ATOL, rtol=0)
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def _run_request(runner: ModelRunner, tokens: list[int], blocks: list[int], decodes: int) -> list[torch.Tensor]:
    out = runner.execute_model(step({"R": len(tokens)}, new=[new_req("R", tokens, blocks)]), return_logits=True)
    logits = [runner.last_logits[0].clone()]
    n = len(tokens)
    for _ in range(decodes):
        assert out.sampled_token_ids[0]
        out = runner.execute_model(step({"R": 1}, cached=[("R", [], n)]), return_logits=True)
        logits.append(runner.last_logits[0].clone())
        n += 1
    return logits


def test_block_table_independence(llama: Tiny) -> None:
    tokens = prompt(9, 10)
    a = _run_request(llama.runner(), tokens, [0, 1, 2, 3], decodes=5)
    b = _run_request(llama.runner(), tokens, [77, 3, 41, 12], decodes=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bf16_close_to_fp32(llama: Tiny) -> None:
    tokens = prompt(10, 20)
    fp32 = _run_request(llama.runner("float32"), tokens, list(range(8)), decodes=3)
    runner = llama.runner("bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.kv_caches[0][0].dtype == torch.bfloat16
    bf16 = _run_request(runner, tokens, list(range(8)), decodes=3)
    for x, y in zip(fp32, bf16):
        scale = x.abs().max().item()
        assert (x - y).abs().max().item() < 0.03 * scale + 0.01  # measured: ~0.01 * scale


def test_preempted_and_resumed_request_recomputes(llama: Tiny) -> None:
    runner = llama.runner()
    p = prompt(11, 9)
    out = runner.execute_model(step({"R": 9}, new=[new_req("R", p, [1, 2, 3])]))
    t1 = out.sampled_token_ids[0][0]
    out = runner.execute_model(step({"R": 1}, cached=[("R", [], 9)]))
    t2 = out.sampled_token_ids[0][0]
    # Preempted: the runner drops it; resumed later with prompt + outputs and different blocks.
    runner.execute_model(step({}, preempted={"R"}))
    assert "R" not in runner.requests
    seq = p + [t1, t2]
    runner.execute_model(step({"R": 11}, new=[new_req("R", seq, [7, 8, 9], prompt=p)]), return_logits=True)
    assert_logits_match(runner, llama, {"R": seq})


def test_invalid_request_fails_alone(llama: Tiny) -> None:
    runner = llama.runner()
    good = prompt(12, 5)
    out = runner.execute_model(
        step(
            {"bad": 3, "good": 5, "short": 9},
            new=[new_req("bad", [1, TINY_VOCAB + 5, 2], [1]), new_req("good", good, [2, 3]),
                 new_req("short", prompt(13, 9), [4])],  # 9 tokens need 3 blocks
        ),
        return_logits=True,
    )
    assert set(out.failed) == {"bad", "short"}
    assert "token id" in out.failed["bad"] and "blocks" in out.failed["short"]
    assert out.sampled_token_ids[out.req_id_to_index["bad"]] == []
    assert len(out.sampled_token_ids[out.req_id_to_index["good"]]) == 1
    assert_logits_match(runner, llama, {"good": good})


def test_finished_state_dropped_and_empty_step(llama: Tiny) -> None:
    runner = llama.runner()
    runner.execute_model(step({"R": 4}, new=[new_req("R", prompt(14, 4), [0])]))
    out = runner.execute_model(step({}, finished={"R"}))
    assert out.req_ids == [] and runner.requests == {}


def test_greedy_generation_through_scheduler(llama: Tiny) -> None:
    """The real scheduler drives the runner (chunked prefill, prefix caching, a tight block pool);
    every request must generate exactly what transformers generates greedily."""
    from tokenloom.config import CacheConfig, SchedulerConfig
    from tokenloom.core import scheduler as scheduler_mod  # always there: an import error must fail, not skip
    from tokenloom.core.request import Request

    sched = scheduler_mod.Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=BLOCK, num_blocks=10, enable_prefix_caching=True),
        clock=lambda: 0.0,
    )
    runner = llama.runner(num_blocks=10)
    shared = prompt(15, 9)
    prompts = {f"r{i}": shared + prompt(20 + i, 3 + 2 * i) for i in range(4)}
    prompts["solo"] = prompt(30, 17)
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    seen = {"prefix_hit": 0, "preempted": 0, "chunk_continued": 0}
    for _ in range(200):
        if not sched.has_requests():
            break
        so = sched.schedule()
        seen["prefix_hit"] += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
        seen["preempted"] += len(so.preempted_req_ids)
        cached = so.scheduled_cached_reqs
        seen["chunk_continued"] += sum(so.num_scheduled_tokens[r] > 1 for r in cached.req_ids)
        for out in sched.update_from_output(so, runner.execute_model(so)):
            assert out.error is None
            generated[out.request_id] += out.new_token_ids
    assert all(seen.values()), seen  # the schedule really exercised what this test is about
    for rid, p in prompts.items():
        expected = llama.hf.generate(
            torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p):].tolist()
        assert generated[rid] == expected, rid


def test_kv_cache_bytes_per_block(llama: Tiny) -> None:
    cfg = llama.loaded.config
    per_block = kv_cache_bytes_per_block(cfg, 16, torch.bfloat16)
    assert per_block == cfg.num_hidden_layers * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 2
    runner = llama.runner()
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    assert total == kv_cache_bytes_per_block(cfg, BLOCK, torch.float32) * NUM_BLOCKS


@PATHS
def test_long_chunked_prefill_matches_one_chunk(llama: Tiny, path: str) -> None:
    """A long prompt prefilled in uneven chunks (each attending to the earlier chunks through the
    paged cache, across many query/key tiles of the kernel) gives the logits of one unchunked
    prefill and of transformers, and the same greedy tokens after it."""
    tokens = prompt(21, 230)
    blocks = [(5 * i + 3) % NUM_BLOCKS for i in range(60)]  # scattered: 60 blocks of 4 hold 240 slots
    whole = _run_request(llama.runner(path=path), tokens, blocks, decodes=4)
    runner = llama.runner(path=path)
    done = 0
    for i, size in enumerate([37, 100, 1, 92]):  # one chunk of one token: a prefill row on its own
        so = (step({"R": size}, new=[new_req("R", tokens, blocks)]) if i == 0
              else step({"R": size}, cached=[("R", [], done)]))
        out = runner.execute_model(so, return_logits=True)
        done += size
    assert done == len(tokens)
    torch.testing.assert_close(runner.last_logits[0], whole[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(runner.last_logits[0], llama.last_logits(tokens), atol=ATOL, rtol=0)
    n, chunked = done, [runner.last_logits[0].clone()]
    for _ in range(4):
        t = out.sampled_token_ids[0][0]
        out = runner.execute_model(step({"R": 1}, cached=[("R", [], n)]), return_logits=True)
        chunked.append(runner.last_logits[0].clone())
        n += 1
        assert t == int(chunked[-2].argmax())
    for x, y in zip(chunked, whole):
        assert int(x.argmax()) == int(y.argmax())
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
