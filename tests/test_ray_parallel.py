"""Tensor parallelism over Ray (`--distributed-executor-backend ray`, issue 37): ranks as Ray actors in
a placement group with one bundle per rank, on a local multi-node Ray cluster (ray.cluster_utils:
simulated nodes on this machine).

- TP=2 with each rank on its own node: the all-reduce goes over gloo (shared memory is for ranks on
  one node), greedy tokens equal one rank's; a rank actor killed mid-run fails the engine (no hang),
  and its actors and placement group are gone.
- TP=2 x DP=2: two engine-core actors, each with two rank actors: the one-rank tokens; a rank killed
  fails that engine's requests with an error instead of hanging them.

One cluster for the module (a Ray start costs more than the tests). Skipped without Ray.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'tokenloom[ray]'")

from tests.tiny_models import make_tiny_hf_model  # noqa: E402
from tokenloom import LLM, SamplingParams  # noqa: E402
from tokenloom.config import engine_config_from_kwargs  # noqa: E402
from tokenloom.engine.async_llm import EngineDeadError  # noqa: E402
from tokenloom.engine.executor import ExecutorDeadError  # noqa: E402
from tokenloom.engine.llm_engine import LLMEngine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[1 + (7 * i + 3 * j) % 300 for j in range(5 + 3 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", num_blocks=256, block_size=4)
NODE_CPUS = 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def one_rank(tiny_dir):
    llm = LLM(str(tiny_dir), **KW)
    tokens = _tokens(llm)
    llm.llm_engine.close()
    return tokens


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another module's local Ray
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False})
    cluster.add_node(num_cpus=NODE_CPUS)
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _engine_tokens(engine: LLMEngine) -> list[list[int]]:
    ids = [engine.add_request(None, {"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def _wait_placement_groups_removed(timeout_s: float = 60.0) -> bool:
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(pg["state"] == "REMOVED" for pg in placement_group_table().values()):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.allow_leaks  # the dead engine keeps the requests it could not run
def test_tp2_across_two_ray_nodes_gives_one_rank_tokens_and_a_killed_rank_ends_it(
        tiny_dir, one_rank, two_node_cluster, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_RAY_CPUS_PER_RANK", str(NODE_CPUS))  # a whole node per rank: one on each
    config = engine_config_from_kwargs(model=str(tiny_dir), tensor_parallel_size=2,
                                       distributed_executor_backend="ray", **KW)
    engine = LLMEngine(config)
    executor = engine.executor
    try:
        assert type(executor).__name__ == "RayExecutor"
        assert [i["all_reduce"] for i in executor.worker_info] == ["gloo", "gloo"]  # not one node: no shm
        assert _engine_tokens(engine) == one_rank

        step, steps = executor.execute_model, 0

        def kill_rank_1_at_the_third_step(so, non_block=False):
            nonlocal steps
            steps += 1
            if steps == 3:
                ray.kill(executor.procs[1].actor)
            return step(so, non_block)

        executor.execute_model = kill_rank_1_at_the_third_step
        t0 = time.monotonic()
        with pytest.raises(ExecutorDeadError, match="worker rank 1"):
            _engine_tokens(engine)
        assert time.monotonic() - t0 < 60
        assert all(h.poll() is not None for h in executor.procs)  # the other rank is stopped too
    finally:
        engine.close()
    assert _wait_placement_groups_removed()


def test_tp2_x_dp2_on_a_ray_cluster_gives_one_rank_tokens_and_a_killed_rank_fails_its_requests(
        tiny_dir, one_rank, two_node_cluster):
    # Two engine-core actors (one CPU each) and four rank actors (one CPU each): the cluster's 6 CPUs.
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray",
              routing_policy="round_robin", **KW)
    try:
        assert _tokens(llm) == one_rank
        ranks = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("tokenloom-rank")]
        assert len(ranks) == 4
        ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]))
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine"):
            _tokens(llm)
        assert time.monotonic() - t0 < 120
    finally:
        llm.shutdown()
    assert _wait_placement_groups_removed()
