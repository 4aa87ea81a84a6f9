"""--distributed-executor-backend ray: engine cores as Ray actors in a placement group serve the same
greedy tokens as the engine run in-process (the code the mp backend's processes run).

A local Ray cluster (ray.init(num_cpus=2)) is started and stopped here; skipped without Ray
(`pip install 'tokenloom[ray]'`).
"""

from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'tokenloom[ray]'")

from tests.test_data_parallel import PROMPTS, _config, _generate  # noqa: E402
from tests.tiny_models import make_tiny_hf_model  # noqa: E402
from tokenloom.engine.async_llm import AsyncLLM  # noqa: E402
from tokenloom.engine.dp_client import DPEngineCoreClient, make_engine_client  # noqa: E402
from tokenloom.sampling_params import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_backend_serves_the_same_tokens(tiny_dir, local_ray):
    from tokenloom import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", num_blocks=256, block_size=4)
    reference = {f"r{i}": list(o.outputs[0].token_ids)
                 for i, o in enumerate(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                    use_tqdm=False))}
    config = _config(tiny_dir, data_parallel_size=2, distributed_executor_backend="ray", routing_policy="round_robin")
    client = make_engine_client(config, "warning")
    assert isinstance(client, DPEngineCoreClient)
    engine = AsyncLLM.from_client(client, str(tiny_dir), ready_timeout_s=180)
    try:
        got = asyncio.run(_generate(engine, PROMPTS, params))
        assert client.router.num_routed == [4, 4]  # both actors served
    finally:
        engine.shutdown()
    assert got == reference
    # The placement group is gone with the engines.
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
