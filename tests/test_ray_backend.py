"""--distributed-executor-backend ray: engine cores as Ray actors in a placement group serve the same
greedy tokens as the engine run in-process (the code the mp backend's processes run).

A local Ray cluster (ray.init(num_cpus=2)) is started and stopped here; skipped without Ray
(`pip install 'tokenloom[ray]'`).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'tokenloom[ray]'")

from tests.test_data_parallel import PROMPTS, _config, _generate  # noqa: E402
from tests.tiny_models import make_tiny_hf_model  # noqa: E402
from tokenloom.engine.async_llm import AsyncLLM  # noqa: E402
from tokenloom.engine.clients import make_client  # noqa: E402
from tokenloom.engine.dp_client import DPEngineCoreClient  # noqa: E402
from tokenloom.sampling_params import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Deeper and with a longer context than the other tests' tiny model: a 480-token request runs long
    # enough on a quiet machine for ray.kill to land while it runs.
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5, hidden_size=256,
                              intermediate_size=1024, num_hidden_layers=6, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def local_ray():
    # address="local": a cluster of its own even where one already runs on this machine (ray.init() would join it,
    # and refuse num_cpus there).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_backend_serves_the_same_tokens_and_survives_a_killed_actor(tiny_dir, local_ray):
    """Two engine actors serve the in-process engine's greedy tokens; then ray.kill on one actor mid-run:
    its requests end with EngineDeadError naming the engine, the other actor's finish, the health view
    names the dead one, new requests go to the live one; the placement group is gone after shutdown.
    One deployment for both halves (a Ray start-up costs more than either)."""
    from ray.util import placement_group_table

    from tokenloom import LLM
    from tokenloom.engine.async_llm import EngineDeadError

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", num_blocks=256, block_size=4)
    reference = {f"r{i}": list(o.outputs[0].token_ids)
                 for i, o in enumerate(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                    use_tqdm=False))}
    config = _config(tiny_dir, data_parallel_size=2, distributed_executor_backend="ray", routing_policy="round_robin")
    client = make_client(config, "warning")
    assert isinstance(client, DPEngineCoreClient)
    engine = AsyncLLM.from_client(client, str(tiny_dir), ready_timeout_s=180)
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # two per engine fit its 256 blocks

    async def kill_mid_run() -> tuple[dict, dict]:
        engine.attach()
        outcomes: dict[str, object] = {}

        async def one(rid: str) -> None:
            stream = engine.open_stream()
            engine.add_request(rid, PROMPTS[1], long, stream)
            try:
                async for out in stream:
                    outcomes[rid] = out
            except EngineDeadError as exc:
                outcomes[rid] = exc

        tasks = [asyncio.ensure_future(one(f"k{i}")) for i in range(4)]
        await asyncio.sleep(0)
        owner = dict(client.router.owner)
        while not all(rid in outcomes for rid in owner):  # every request has produced a token
            await asyncio.sleep(0.01)
        ray.kill(client.clients[0].process.actor)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return owner, outcomes

    try:
        got = asyncio.run(_generate(engine, PROMPTS, params))
        assert client.router.num_routed == [4, 4]  # both actors served
        assert got == reference

        owner, outcomes = asyncio.run(kill_mid_run())
        assert sorted(owner.values()) == [0, 0, 1, 1]
        for rid, e in owner.items():
            if e == 0:
                assert isinstance(outcomes[rid], EngineDeadError) and "engine 0" in str(outcomes[rid]), rid
            else:
                assert outcomes[rid].finished and len(outcomes[rid].outputs[0].token_ids) == 480, rid
        assert [h["alive"] for h in engine.engine_health()] == [False, True]
        assert engine.dead_reason is None and engine.accepting
        before = client.router.num_routed[1]
        after = asyncio.run(_generate(engine, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=3)))
        assert all(len(t) == 3 for t in after.values()) and client.router.num_routed[1] == before + 2
    finally:
        engine.shutdown()
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_ray_placement_timeout_and_actor_start_failure_are_clear_errors(tiny_dir, local_ray):
    """More CPUs per engine than the cluster has: EngineStartError naming the placement and the cluster,
    after the start timeout, the placement group removed. An actor whose engine cannot load its model:
    EngineStartError carrying the actor's own error."""
    from ray.util import placement_group_table

    from tokenloom.engine.exceptions import EngineStartError
    from tokenloom.engine.ray_engine import start_ray_engines

    config = _config(tiny_dir, data_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(EngineStartError, match="could not place 2 engines with 64 CPUs each"):
        start_ray_engines(config, 2, "warning", cpus_per_engine=64, start_timeout_s=2.0)
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())

    broken = _config(tiny_dir, data_parallel_size=1, distributed_executor_backend="ray")
    broken = dataclasses.replace(broken, model=str(tiny_dir / "no-such-model"))
    with pytest.raises(EngineStartError,
                       match="engine 0: Engine core initialization failed: FileNotFoundError: model"):
        client = make_client(broken, "warning")
        AsyncLLM.from_client(client, str(tiny_dir), ready_timeout_s=120).shutdown()
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
