"""Tensor and pipeline parallelism (issue 37): worker processes that each hold a cut of the model give
the one-rank greedy tokens and logits, run exactly two all-reduces per decoder layer per step, cut
int8 and GGUF weights correctly, refuse what they cannot run with a clear error, and a killed rank
ends the engine instead of hanging it.

The engines are real worker processes (2-4 ranks, forked from the ranks' forkserver) on a tiny random model
(4 heads, 2 KV heads, float32 so that a different summation order cannot flip a greedy choice); each test
starts its engines once. The shared-memory all-reduce is checked on its own between threads (no process start-up).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TINY_LAYERS, make_tiny_hf_model, write_gguf_from_hf
from tokenloom import LLM, SamplingParams
from tokenloom.config import ConfigError
from tokenloom.distributed.shm_communicator import ShmCommunicator
from tokenloom.engine.executor import ExecutorDeadError
from tokenloom.engine.multiproc_executor import rank_cpus
from tokenloom.model.tp_shard import pp_layer_range, shard_model

pytestmark = pytest.mark.timeout(600)  # worker start-up on a loaded 2-core machine

PROMPTS = [[1 + (7 * i + 3 * j) % 300 for j in range(5 + 3 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", num_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _first_step_logits_one_rank(tiny_dir, **kw) -> torch.Tensor:
    """Logits of the prefill step of PROMPTS[3] on one rank (the runner keeps them on request)."""
    llm = LLM(str(tiny_dir), **{**KW, **kw})
    runner = llm.llm_engine.runner
    run = runner.execute_model
    runner.execute_model = lambda so: run(so, return_logits=True)
    _tokens(llm, PROMPTS[3:], SamplingParams(temperature=0.0, max_tokens=1))
    llm.llm_engine.close()
    return runner.last_logits.clone()


@pytest.fixture(scope="module")
def one_rank(tiny_dir):
    llm = LLM(str(tiny_dir), **KW)
    tokens = _tokens(llm)
    llm.llm_engine.close()
    return tokens, _first_step_logits_one_rank(tiny_dir)


def _check_against_one_rank(llm: LLM, one_rank) -> dict[str, int]:
    """Greedy tokens and first-step logits equal to one rank's; returns the output rank's collective
    counts over the greedy run and the number of steps it took."""
    tokens, logits = one_rank
    executor = llm.llm_engine.executor
    executor.collective_rpc("set_return_logits", True)
    _tokens(llm, PROMPTS[3:], SamplingParams(temperature=0.0, max_tokens=1))
    got = executor.collective_rpc("last_logits")[executor.output_rank]
    assert got.shape == logits.shape
    assert torch.allclose(got, logits, atol=1e-4, rtol=0), (got - logits).abs().max()
    executor.collective_rpc("set_return_logits", False)
    before = executor.collective_rpc("comm_stats")
    steps = 0
    step = executor.execute_model

    def counted(so, non_block=False):
        nonlocal steps
        steps += so.total_num_scheduled_tokens > 0  # PP's batch queue also runs empty steps: no forward
        return step(so, non_block)

    executor.execute_model = counted
    assert _tokens(llm) == tokens
    after = executor.collective_rpc("comm_stats")
    return {"steps": steps, **{k: [a[k] - b[k] for a, b in zip(after, before)] for k in after[0]}}


def test_tp2_gives_one_rank_tokens_and_logits_with_two_all_reduces_per_layer(tiny_dir, one_rank):
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **KW)
    try:
        info = llm.llm_engine.executor.worker_info
        assert [i["num_kv_heads"] for i in info] == [1, 1]  # each rank's KV cache holds its own KV head
        counts = _check_against_one_rank(llm, one_rank)
    finally:
        llm.llm_engine.close()
    # Per step on every rank: o_proj and down_proj of each layer, plus the vocab-parallel embedding's one.
    assert counts["all_reduce"] == [counts["steps"] * (2 * TINY_LAYERS + 1)] * 2, counts
    assert counts["all_gather"] == [counts["steps"]] * 2  # the logits of the vocab-parallel head


def test_pp2_gives_one_rank_tokens_and_logits(tiny_dir, one_rank):
    llm = LLM(str(tiny_dir), pipeline_parallel_size=2, **KW)
    try:
        assert [i["num_layers"] for i in llm.llm_engine.executor.worker_info] == [1, 1]
        counts = _check_against_one_rank(llm, one_rank)
    finally:
        llm.llm_engine.close()
    assert counts["pp_send"] == [counts["steps"], 0] and counts["pp_recv"] == [0, counts["steps"]]
    assert counts["all_reduce"] == [0, 0]


def test_pp2_keeps_two_batches_in_flight_with_one_rank_tokens(tiny_dir):
    """vLLM's batch queue with max_concurrent_batches = 2 stages: a small token budget splits six
    requests into micro-batches; the last stage is slowed so that the first stage finishing the next
    batch before the last finished this one is counted, not timed. Tokens equal one rank's with the
    same budget, and every KV block comes back."""
    kw = {**KW, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    prompts = PROMPTS + [[5 + j for j in range(9)], [300 - j for j in range(6)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_dir), **kw)
    reference = _tokens(llm, prompts, params)
    llm.llm_engine.close()
    llm = LLM(str(tiny_dir), pipeline_parallel_size=2, **kw)
    try:
        executor = llm.llm_engine.executor
        llm.llm_engine.reset_scheduler()  # keeps the workers and their batch queue (benchmarks reset it)
        assert llm.llm_engine.executor is executor
        assert executor.max_concurrent_batches == 2 and llm.llm_engine.engine_core.batch_queue_size == 2
        executor.collective_rpc("set_step_delay", {executor.output_rank: 0.1})
        assert _tokens(llm, prompts, params) == reference
        assert executor.max_steps_in_flight == 2
        assert executor.pipeline_overlaps >= 2, executor.pipeline_overlaps
        pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks
    finally:
        llm.llm_engine.close()


def test_tp4_replicates_kv_heads_and_gloo_gives_the_same_tokens(tiny_dir, one_rank, monkeypatch):
    """TP=4 > 2 KV heads: each KV head on two ranks (vLLM's rule), over gloo instead of shared memory."""
    monkeypatch.setenv("TOKENLOOM_CPU_ALLREDUCE", "gloo")
    llm = LLM(str(tiny_dir), tensor_parallel_size=4, **KW)
    try:
        assert [i["num_kv_heads"] for i in llm.llm_engine.executor.worker_info] == [1, 1, 1, 1]
        assert _tokens(llm) == one_rank[0]
    finally:
        llm.llm_engine.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ranks_fork_from_one_forkserver_with_the_executors_environment_of_now(tiny_dir, monkeypatch):
    """Successive engines' ranks fork from one forkserver (torch imported once per process, not once per rank),
    each rank with the environment its executor has when it starts it (TOKENLOOM_CPU_ALLREDUCE, set after the
    forkserver started, reaches the ranks); a variable libraries read when they load (MALLOC_*) changed means a
    new forkserver, and the old one exits once its ranks have."""
    from tokenloom.engine.worker_forkserver import forkserver

    server = forkserver()
    monkeypatch.delenv("TOKENLOOM_CPU_ALLREDUCE", raising=False)
    for all_reduce in ("shared memory", "gloo"):
        if all_reduce == "gloo":
            monkeypatch.setenv("TOKENLOOM_CPU_ALLREDUCE", "gloo")
        llm = LLM(str(tiny_dir), tensor_parallel_size=2, **KW)
        try:
            info = llm.llm_engine.executor.worker_info
            assert [_parent(i["pid"]) for i in info] == [server.proc.pid] * 2
            assert [i["all_reduce"] for i in info] == [all_reduce] * 2
        finally:
            llm.llm_engine.close()
    assert forkserver() is server
    monkeypatch.setenv("MALLOC_TOKENLOOM_TEST", "1")
    assert forkserver() is not server
    assert server.proc.wait(timeout=60) == 0


def test_a_forkserver_gone_before_forking_is_a_clear_error():
    from tokenloom.engine.process_start import what_a_child_inherits
    from tokenloom.engine.worker_forkserver import WorkerForkserver

    server = WorkerForkserver(what_a_child_inherits())
    server.proc.kill()
    with pytest.raises(RuntimeError, match="forkserver exited with code -9 before starting every rank"):
        server.fork_ranks([{"address": "127.0.0.1:1", "authkey": "00", "rank": 0, "omp_threads": None}])


def test_shard_cuts_heads_kv_replicas_vocab_and_layers(tiny_dir):
    from tokenloom.model.loader import load_model

    loaded = load_model(tiny_dir)
    w = loaded.weights
    d = loaded.config.head_dim
    r1 = shard_model(loaded, 1, 2)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(r1.weights[q], w[q][2 * d:])
    assert torch.equal(r1.weights["model.layers.0.self_attn.o_proj.weight"],
                       w["model.layers.0.self_attn.o_proj.weight"][:, 2 * d:])
    r3 = shard_model(loaded, 3, 4)  # TP=4 over 2 KV heads: rank 3 reads KV head 1
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(r3.weights[k], w[k][d:])
    assert r3.config.num_attention_heads == 1 and r3.config.num_key_value_heads == 1
    embed = r3.weights["model.embed_tokens.weight"]  # 320 rows over 4 ranks: 80 each
    assert torch.equal(embed, w["model.embed_tokens.weight"][240:])
    stage = shard_model(loaded, 0, 1, 1, 2)
    assert stage.config.num_hidden_layers == 1 and "model.layers.0.input_layernorm.weight" in stage.weights
    assert torch.equal(stage.weights["model.layers.0.mlp.up_proj.weight"], w["model.layers.1.mlp.up_proj.weight"])
    assert [pp_layer_range(30, s, 4) for s in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]  # vLLM's


def test_gguf_cuts_whole_blocks_or_refuses(tiny_dir, tmp_path):
    from gguf import GGMLQuantizationType

    from tokenloom.model.gguf_weights import GGUFWeight
    from tokenloom.model.tp_shard import _cols

    q4k = GGUFWeight(torch.zeros((8, 2 * 144), dtype=torch.uint8), int(GGMLQuantizationType.Q4_K), (8, 512))
    assert _cols(q4k, 256, 512, "down_proj").shape == (8, 256)  # whole 256-element blocks
    with pytest.raises(ValueError, match="whole 256-element quant blocks"):
        _cols(q4k, 0, 128, "model.layers.0.mlp.down_proj.weight")


def test_gguf_and_int8_sharded(tiny_dir, tmp_path):
    """GGUF (Q8_0 blocks cut along whole 32-element blocks, kept quantized) and int8 W8A8 under TP=2:
    the GGUF cut is exact (the same blocks), so its tokens are one rank's; int8's per-channel scales of
    the row-parallel linears are taken over each rank's slice, so its logits are checked close instead."""
    gguf_path = write_gguf_from_hf(tiny_dir, tmp_path / "q8.gguf", qtype="Q8_0")
    prompts = PROMPTS[:2]
    one = LLM(str(gguf_path), dtype="float32", num_blocks=256, block_size=4)
    assert one.llm_engine.config.quantization == "gguf"
    want = _tokens(one, prompts)
    one.llm_engine.close()
    two = LLM(str(gguf_path), dtype="float32", num_blocks=256, block_size=4, tensor_parallel_size=2)
    try:
        assert _tokens(two, prompts) == want
    finally:
        two.llm_engine.close()
    ref = _first_step_logits_one_rank(tiny_dir, quantization="int8")
    llm = LLM(str(tiny_dir), quantization="int8", tensor_parallel_size=2, **KW)
    try:
        executor = llm.llm_engine.executor
        executor.collective_rpc("set_return_logits", True)
        _tokens(llm, PROMPTS[3:], SamplingParams(temperature=0.0, max_tokens=1))
        got = executor.collective_rpc("last_logits")[0]
    finally:
        llm.llm_engine.close()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max(), (got - ref).abs().max()
    assert got.argmax() == ref.argmax()


def test_tp2_combines_with_async_scheduling_speculation_and_structured_outputs(tiny_dir):
    from tokenloom.sampling_params import StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = PROMPTS[:3]
    choice = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta"]))
    runs = []
    for tp in (1, 2):
        llm = LLM(str(tiny_dir), tensor_parallel_size=tp, async_scheduling=True, speculative_config=spec, **KW)
        try:
            runs.append((_tokens(llm, prompts), llm.generate(["pick"], choice, use_tqdm=False)[0].outputs[0].text))
        finally:
            llm.llm_engine.close()
    assert runs[1] == runs[0]
    assert runs[0][1] in ("alpha", "beta")


@pytest.mark.allow_leaks  # the dead engine keeps the request it could not run
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2, "max_num_batched_tokens": 16, "max_num_seqs": 4}],
                         ids=["tp2", "pp2-two-batches-in-flight"])
def test_a_killed_rank_ends_the_engine_not_hangs_it(tiny_dir, layout):
    """TP: killed before the step; PP: killed mid-run, at the fourth step, with micro-batches in flight."""
    llm = LLM(str(tiny_dir), **layout, **KW)
    executor = llm.llm_engine.executor
    pids = [i["pid"] for i in executor.worker_info]
    kill_at = 4 if "pipeline_parallel_size" in layout else 1
    step, steps = executor.execute_model, 0

    def kill_rank_1(so, non_block=False):
        nonlocal steps
        steps += 1
        if steps == kill_at:
            os.kill(pids[1], signal.SIGKILL)
        return step(so, non_block)

    executor.execute_model = kill_rank_1
    t0 = time.monotonic()
    with pytest.raises(ExecutorDeadError, match="worker rank 1"):
        _tokens(llm, PROMPTS if kill_at > 1 else PROMPTS[:1])
    assert steps >= kill_at
    assert time.monotonic() - t0 < 30
    assert all(p.poll() is not None for p in executor.procs)  # the other rank is stopped too
    with pytest.raises(ExecutorDeadError):  # and the engine stays dead
        executor.execute_model(None)
    llm.llm_engine.close()


def test_refusals_are_clear_before_loading(tiny_dir):
    with pytest.raises(ConfigError, match="must divide the model's 4 attention heads"):
        LLM(str(tiny_dir), tensor_parallel_size=3, **KW)
    with pytest.raises(ConfigError, match="async-scheduling"):
        LLM(str(tiny_dir), pipeline_parallel_size=2, async_scheduling=True, **KW)
    with pytest.raises(ConfigError, match="speculative decoding"):
        LLM(str(tiny_dir), pipeline_parallel_size=2, speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 2}, **KW)
    with pytest.raises(ConfigError, match="exceeds the model's 2 layers"):
        LLM(str(tiny_dir), pipeline_parallel_size=3, **KW)
    # LoRA and KV connectors are not built into the worker processes: refused by name.
    with pytest.raises(ConfigError, match="LoRA adapters"):
        LLM(str(tiny_dir), tensor_parallel_size=2, enable_lora=True, **KW)
    with pytest.raises(ConfigError, match="KV connector"):
        LLM(str(tiny_dir), tensor_parallel_size=2, kv_offloading_size=1, **KW)
    with pytest.raises(ConfigError, match="pooling models run on one rank"):
        LLM(str(tiny_dir), tensor_parallel_size=2, runner="pooling", **KW)


def test_threads_bind_follows_vllm_cpu_omp_threads_bind():
    assert rank_cpus(2, "auto", [0, 1, 2, 3]) == ([[0, 1], [2, 3]], [2, 2])
    assert rank_cpus(3, "auto", [0, 1]) == ([None, None, None], [1, 1, 1])  # oversubscribed: unpinned
    assert rank_cpus(2, "0-2|5,7", [0]) == ([[0, 1, 2], [5, 7]], [3, 2])
    assert rank_cpus(2, "all", [0, 1, 2, 3]) == ([None, None], [2, 2])
    with pytest.raises(ConfigError, match="names 1 rank"):
        rank_cpus(2, "0-3", [0, 1, 2, 3])


def test_shared_memory_all_reduce_between_two_ranks(tmp_path: Path):
    """Two ranks (threads here) sum, in pieces larger than a slot, in the same bits on both ranks;
    gather in rank order; a rank that never arrives is an error after the timeout, not a hang."""
    path = str(tmp_path / "shm")
    comms = [ShmCommunicator(path, 0, 2, 1024, create=True)]
    comms.append(ShmCommunicator(path, 1, 2, 1024, create=False))
    gen = torch.Generator().manual_seed(0)
    xs = [[torch.randn(1000, generator=gen) for _ in range(3)] for _ in range(2)]  # 4,000 B: 4 pieces
    bf = [torch.randn(64, generator=gen).bfloat16() for _ in range(2)]
    out: list = [None, None]

    def rank(r: int) -> None:
        sums = [comms[r].all_reduce(x.clone()) for x in xs[r]]
        out[r] = (sums, comms[r].all_reduce(bf[r].clone()), comms[r].all_gather(torch.tensor([r, 10 + r])))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(3):
        assert torch.equal(out[0][0][i], out[1][0][i])
        assert torch.allclose(out[0][0][i], xs[0][i] + xs[1][i])
    assert torch.equal(out[0][1], (bf[0].float() + bf[1].float()).bfloat16())
    assert [t.tolist() for t in out[1][2]] == [[0, 10], [1, 11]]
    comms[0].timeout_s = 0.2
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not arrive"):
        comms[0].all_reduce(torch.ones(4))


def test_simulated_parallel_step_time_counts_the_cut_and_the_collectives():
    from tokenloom.sim.parallel import Link, parallel_step_time

    free = Link(0.0, float("inf"))
    assert parallel_step_time(0.1, 1, 30, 576, tp=2, tp_link=free).latency_s == pytest.approx(0.05)
    link = Link(latency_s=1e-5, bandwidth_bytes_s=1e9)
    step = parallel_step_time(0.1, 4, 30, 576, tp=3, tp_link=link)
    one = 2 * 2 * (1e-5 + 4 * 576 * 2 / 3 / 1e9)  # a ring all-reduce over 3 ranks: 4 messages of a third
    assert step.comm_s == pytest.approx((2 * 30 + 1) * one)  # 2 per layer + the embedding's
    assert step.latency_s == pytest.approx(0.1 / 3 + step.comm_s)
    pp = parallel_step_time(0.1, 1, 30, 576, pp=2, pp_link=free)
    assert pp.latency_s == pytest.approx(0.1) and pp.interval_s == pytest.approx(0.05)  # 2 batches in flight
    assert parallel_step_time(0.1, 1, 30, 576, pp=2, pp_link=free, batches_in_flight=1).interval_s == \
        pytest.approx(0.1)


@pytest.mark.slow
def test_tp2_times_dp2_gives_one_rank_tokens(tiny_dir, one_rank):
    """Two data-parallel engine processes, each with its own two tensor-parallel workers (6 processes)."""
    llm = LLM(str(tiny_dir), data_parallel_size=2, tensor_parallel_size=2, routing_policy="round_robin", **KW)
    try:
        assert _tokens(llm) == one_rank[0]
        assert llm.llm_engine.client.client.router.num_routed == [2, 2]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_gives_tp1_tokens():
    """The default model (9 heads, 3 KV heads: one KV head per rank), float32, dequantized: TP=3 = TP=1."""
    kw = dict(dtype="float32", quantization="none", kv_cache_memory=64 << 20, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    one = LLM(None, **kw)
    want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params, use_tqdm=False)]
    one.llm_engine.close()
    three = LLM(None, tensor_parallel_size=3, **kw)
    try:
        assert [i["num_kv_heads"] for i in three.llm_engine.executor.worker_info] == [1, 1, 1]
        assert [list(o.outputs[0].token_ids) for o in three.generate(prompts, params, use_tqdm=False)] == want
    finally:
        three.llm_engine.close()
    with pytest.raises(ConfigError, match="must divide the model's 9 attention heads"):
        LLM(None, tensor_parallel_size=2, **kw)


def test_pp2_with_batches_in_flight_runs_structured_outputs(tiny_dir):
    """Pipeline parallelism with its batch queue and grammar-constrained requests beside free ones: the
    bitmask reaches the last stage's sampler for the right rows, whatever batch is in flight."""
    from tokenloom.sampling_params import StructuredOutputsParams

    choice = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta"]))
    runs = []
    for pp in (1, 2):
        llm = LLM(str(tiny_dir), pipeline_parallel_size=pp, **KW)
        try:
            prompts = [{"prompt_token_ids": p} for p in PROMPTS] + ["pick", "choose one", "a or b"]
            outs = llm.generate(prompts, [GREEDY] * len(PROMPTS) + [choice] * 3, use_tqdm=False)  # one batch
            runs.append(([list(o.outputs[0].token_ids) for o in outs[:len(PROMPTS)]],
                         [o.outputs[0].text for o in outs[len(PROMPTS):]]))
        finally:
            llm.llm_engine.close()
    assert runs[1] == runs[0]
    assert all(text in ("alpha", "beta") for text in runs[0][1])
