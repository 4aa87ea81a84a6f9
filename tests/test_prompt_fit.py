"""The "this request can never fit the KV pool" check counts every KV cache group as vLLM counts a
request's share of the pool (tokenloom/core/prompt_fit.py): a full group cdiv(tokens, block_size), a
sliding group at most cdiv(min(W - 1 + in flight, max_model_len), block_size) + 1, all drawn from one
pool. The rule itself, then the same boundary through the engine (scheduler) and the server (HTTP 400)
with a tiny Gemma 3 of hybrid groups."""

from __future__ import annotations

import httpx
import pytest

from tokenloom.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec, make_kv_cache_groups, max_in_flight_tokens
from tokenloom.core.prompt_fit import max_model_len_that_fits, prompt_fit, resolve_max_model_len, sched_max_len_default
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.sampling_params import SamplingParams

S, F = "sliding_attention", "full_attention"
BS, W, CHUNK, POOL = 4, 8, 8, 20
LAYER_TYPES = [S, S, F, S, S, F]  # groups of 2 layers: sliding (0, 3), (1, 4); full (2, 5)
HYBRID = make_kv_cache_groups([W, W, None, W, W, None])
# In a 20-block pool: a sliding group holds at most cdiv(7 + 8, 4) + 1 = 5 blocks, so 40 KV tokens
# need 10 + 5 + 5 = 20 blocks (fits) and 41 need 11 + 5 + 5 = 21 (never fits). Counting only the full
# group (the server before) admits up to 80; counting every group as full rejects from 28.
FITS = dict(prompt=20, max_tokens=21)  # 40 tokens of KV
NEVER = dict(prompt=20, max_tokens=22)  # 41


def test_every_group_counts_and_sliding_groups_only_their_window() -> None:
    fit = prompt_fit(20, 21, 128, BS, POOL, HYBRID, CHUNK)
    assert fit.blocks_per_group == (5, 5, 10) and fit.blocks_needed == 20 and not fit.exceeds_pool
    assert fit.per_group == "10 in the full-attention group, 5 in each of 2 sliding-window groups (window 8)"
    fit = prompt_fit(20, 22, 128, BS, POOL, HYBRID, CHUNK)
    assert fit.blocks_per_group == (5, 5, 11) and fit.exceeds_pool
    # Short requests need no more than their length in a sliding group.
    assert prompt_fit(5, 3, 128, BS, POOL, HYBRID, CHUNK).blocks_per_group == (2, 2, 2)
    # One full-attention group: cdiv(tokens, block_size), as before groups; nothing to add to messages.
    plain = prompt_fit(20, 22, 128, BS, POOL)
    assert plain.blocks_needed == 11 and plain.per_group == ""
    # One sliding group (Mistral): bounded by its window whatever the length.
    assert prompt_fit(20, 500, 1024, BS, POOL, [KVCacheGroupSpec((0,), W)], CHUNK).blocks_needed == 5
    # The cap never exceeds max_model_len's blocks (+1), as vLLM's min(W - 1 + in flight, max_model_len).
    assert prompt_fit(5, 20, 12, BS, POOL, [KVCacheGroupSpec((0,), 64)], CHUNK).blocks_needed == 3
    with pytest.raises(ValueError, match="max_in_flight_tokens"):
        prompt_fit(20, 22, 128, BS, POOL, HYBRID)


def test_async_scheduling_keeps_two_batches_in_flight() -> None:
    """vLLM's max_in_flight_tokens: two step budgets under async scheduling, so a sliding group's cap is
    cdiv(7 + 16, 4) + 1 = 7; the scheduler's KV manager uses the same number."""
    assert max_in_flight_tokens(8, async_scheduling=True) == 16 and max_in_flight_tokens(8) == 8
    assert prompt_fit(20, 21, 128, BS, POOL, HYBRID, 16).blocks_per_group == (7, 7, 10)
    for async_ in (False, True):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=128,
                                          async_scheduling=async_),
                          CacheConfig(block_size=BS, num_blocks=POOL, layer_windows=(W, None)), clock=lambda: 0.0)
        kv = sched.kv_cache_manager
        assert kv.max_in_flight_tokens == (16 if async_ else 8)
        assert [m.admission_cap_blocks for m in kv.managers] == [7 if async_ else 5, None]


def test_the_scheduler_and_the_front_ends_refuse_with_one_rules_words(tmp_path) -> None:  # noqa: ANN001
    """prompt_refusal is the one rule: the scheduler (no front end: simulator, replay) and the InputProcessor
    (every front end) refuse the same requests with the same words, the scheduler naming the request."""
    from tokenloom.core.request import Request
    from tokenloom.engine.core_messages import EngineReady
    from tokenloom.engine.input_processor import InputProcessor, InvalidRequestError

    max_len = 64
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=max_len),
                      CacheConfig(block_size=BS, num_blocks=POOL, layer_windows=(W, W, None)), clock=lambda: 0.0)
    kv = sched.kv_cache_manager
    ready = EngineReady(model_name="m", max_model_len=max_len, num_blocks=POOL, block_size=BS, eos_token_id=None,
                        vocab_size=1000, dtype="float32", device="cpu", load_time_s=0.0,
                        kv_cache_group_windows=[g.sliding_window for g in kv.kv_cache_groups],
                        max_in_flight_tokens=kv.max_in_flight_tokens or 0)
    front = InputProcessor(None, ready)  # type: ignore[arg-type]
    cases = [([], 8, "The decoder prompt cannot be empty"), ([5] * max_len, 8, "leaves no room to generate"),
             ([5] * (max_len + 1), 8, f"your prompt contains {max_len + 1} input tokens, which exceeds this limit "
              "even without any output tokens"),  # vLLM 0.32's renderer's words for a longer prompt
             ([5] * 20, 22, "21 KV-cache blocks are needed (11 in the full-attention group")]
    for i, (ids, max_tokens, words) in enumerate(cases):
        params = SamplingParams(max_tokens=max_tokens)
        with pytest.raises(InvalidRequestError) as said:
            front.check_prompt(ids, params, max_tokens_in_context=False)
        with pytest.raises(RequestRejected) as refused:
            sched.add_request(Request(f"r{i}", ids, params))
        assert words in str(said.value), said.value
        assert str(refused.value) == f"request 'r{i}': {said.value}"
    sched.add_request(Request("fits", [5] * 20, SamplingParams(max_tokens=21)))  # the boundary: both take it
    front.check_prompt([5] * 20, SamplingParams(max_tokens=21), max_tokens_in_context=False)


def test_the_simulator_resolves_max_model_len_as_the_engine_does() -> None:
    """--max-model-len past the model's context is refused by the simulator as by the engine; without it both
    take the engine's default."""
    from types import SimpleNamespace

    from tokenloom.config import ConfigError
    from tokenloom.sim.simulate import engine_configs

    profile = SimpleNamespace(max_model_len=1024)  # (a profile's context length; the pool is given)
    with pytest.raises(ConfigError, match="larger than the model's context length"):
        engine_configs(profile, {"max_model_len": 4096, "num_blocks": 512})
    sched, cache = engine_configs(profile, {"num_blocks": 512})
    config = EngineConfig(cache=cache)
    assert sched.max_model_len == resolve_max_model_len(
        config, 1024, sched_max_len_default(config, 1024, cache.num_blocks * cache.block_size)) == 1024


def test_max_model_len_that_fits_is_vllms_estimate() -> None:
    """The largest max_model_len one request of which fits, against a brute-force search of vLLM's
    per-group count (cdiv(len, bs) per full group, the capped count per sliding group)."""

    def need(length: int) -> int:
        cap = -(-min(W - 1 + CHUNK, length) // BS) + 1
        return -(-length // BS) + 2 * min(-(-length // BS), cap)

    for pool in (1, 2, 3, 7, 20, 33, 100):
        brute = max((n for n in range(0, 257) if need(n) <= pool), default=0)
        assert max_model_len_that_fits(pool, BS, 256, HYBRID, CHUNK) == brute, pool
    assert max_model_len_that_fits(POOL, BS, 256, HYBRID, CHUNK) == 40
    assert max_model_len_that_fits(POOL, BS, 256) == 80  # one full group: the pool's tokens
    assert max_model_len_that_fits(POOL, BS, 50) == 50  # capped by the model


# Through the engine and the server, with a tiny Gemma 3 -----------------------------------------------

ENGINE = dict(dtype="float32", num_blocks=POOL, block_size=BS, max_model_len=128, max_num_batched_tokens=CHUNK,
              max_num_seqs=4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from tests.tiny_models import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("gemma3_fit"), arch="gemma3", seed=5,
                              num_hidden_layers=6, layer_types=LAYER_TYPES, sliding_window=W)


def _prompt(n: int) -> list[int]:
    return [5 + i % 50 for i in range(n)]


def test_engine_rejects_at_the_hybrid_boundary_and_serves_the_request_that_fits(gemma3) -> None:  # noqa: ANN001
    from tokenloom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(str(gemma3), **ENGINE)
    assert len(engine.scheduler.kv_cache_manager.kv_cache_groups) == 3
    # The engine's input processor refuses it (tokenloom/engine/input_processor.py), in the server's words.
    with pytest.raises(RequestRejected, match=r"21 KV-cache blocks are needed \(11 in the "
                                              r"full-attention group, 5 in each of 2 sliding-window groups"):
        engine.add_request("never", {"prompt_token_ids": _prompt(NEVER["prompt"])},
                           SamplingParams(max_tokens=NEVER["max_tokens"], ignore_eos=True))
    engine.add_request("fits", {"prompt_token_ids": _prompt(FITS["prompt"])},
                       SamplingParams(temperature=0.0, max_tokens=FITS["max_tokens"], ignore_eos=True))
    tokens: list[int] = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == FITS["max_tokens"]  # the whole pool at its peak, and it finishes
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == POOL


def test_engine_default_max_model_len_counts_the_groups(gemma3) -> None:  # noqa: ANN001
    """Without --max-model-len the context is capped at the longest request the pool holds, every
    group counted (40 here; a third of the pool's tokens, 26, before)."""
    from tokenloom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(str(gemma3), **{**ENGINE, "max_model_len": None})
    assert engine.scheduler_config.max_model_len == 40


def test_disable_sliding_window_caps_max_model_len_at_the_window(gemma3) -> None:  # noqa: ANN001
    """vLLM's disable_sliding_window: one full-attention KV cache group, and max_model_len capped at the window
    (vLLM's derived max_model_len, `sliding_window` its key, named when --max-model-len asks for more)."""
    from tokenloom.config import ConfigError
    from tokenloom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(str(gemma3), **{**ENGINE, "max_model_len": None}, disable_sliding_window=True)
    try:
        assert engine.scheduler_config.max_model_len == W
        assert [g.sliding_window for g in engine.scheduler.kv_cache_manager.kv_cache_groups] == [None]
    finally:
        engine.close()
    with pytest.raises(ConfigError, match=rf"max_model_len={W + 1} is larger than the model's context length "
                                          rf"\({W}: its sliding_window, which disable_sliding_window caps"):
        resolve_max_model_len(EngineConfig(max_model_len=W + 1), W, W, key="sliding_window")


@pytest.mark.slow
def test_server_says_400_at_the_hybrid_boundary(gemma3, tmp_path) -> None:  # noqa: ANN001
    from tests.test_server_harness import ServerProcess

    args = [str(gemma3)] + [a for k, v in ENGINE.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": _prompt(NEVER["prompt"]), "max_tokens": NEVER["max_tokens"]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens", err
        assert ("41 tokens of KV: 20 prompt + 21 generated), 21 KV-cache blocks are needed (11 in the "
                "full-attention group, 5 in each of 2 sliding-window groups (window 8)), which is larger than "
                "the available KV cache (20 blocks of 4 tokens)") in err["message"], err
        ok = http.post("/v1/completions", json={"prompt": _prompt(FITS["prompt"]), "max_tokens": FITS["max_tokens"],
                                                "temperature": 0.0, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == FITS["max_tokens"]
