"""One construction path, one client interface, one input processor (issue 31, item 1).

- the engine-core process builds the engine core alone (EngineCoreHost): no OutputProcessor;
- every front end (LLMEngine, the data-parallel LLM, AsyncLLM) refuses a bad prompt with the same
  message, the InputProcessor's;
- make_client picks the in-process, single-process, data-parallel or Ray client (LLMEngine gets the in-process
  one unless its config needs engine processes, then SyncMPClient over them), and
  `LLM` drives, and AsyncLLM asks its client instead of probing it;
- max_model_len is resolved once, by the engine (no placeholder in the config).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom.config import ConfigError, EngineConfig, ParallelConfig, engine_config_from_kwargs
from tokenloom.core.scheduler import RequestRejected
from tokenloom.engine.core_messages import EngineReady
from tokenloom.sampling_params import SamplingParams

ENGINE = {"dtype": "float32", "num_blocks": 64, "block_size": 4, "max_model_len": 64}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def llm_engine(tiny_dir):
    from tokenloom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(str(tiny_dir), **ENGINE)
    yield engine
    engine.close()


class FakeClient:
    """An EngineCoreClient over no process: ready at once with `ready`, records what it is sent."""

    def __init__(self, ready: EngineReady) -> None:
        self.ready, self.sent = ready, []

    def wait_ready(self, timeout_s: float | None = None) -> EngineReady:
        return self.ready

    def attach(self, on_outputs: Any, on_failure: Any) -> None:
        pass

    def add_request(self, request: Any) -> None:
        self.sent.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.sent.append(request_ids)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass

    failure = None
    is_alive = True

    is_alive = True
    failure = None
    data_parallel_size = 1

    def engine_health(self) -> None:
        return None


def test_the_engine_process_builds_the_engine_core_without_an_output_processor(tiny_dir, monkeypatch) -> None:
    from tokenloom.engine.core_host import EngineCoreHost
    from tokenloom.engine.core_proc import _load
    from tokenloom.engine.output_processor import OutputProcessor

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine process built an OutputProcessor")

    monkeypatch.setattr(OutputProcessor, "__init__", refuse)
    host, ready = _load(engine_config_from_kwargs(model=str(tiny_dir), **ENGINE))
    try:
        assert type(host) is EngineCoreHost and not hasattr(host, "output_processor")
        assert host.engine_core.scheduler is host.scheduler
        assert (ready.max_model_len, ready.num_blocks, ready.block_size) == (64, 64, 4)
        assert ready.vocab_size == host.model_config.vocab_size and ready.pooling is None
    finally:
        host.close()


def _bad_prompts(max_model_len: int) -> list[tuple[list[int], str]]:
    return [([1, 10**6], "out of vocabulary"), ([], "empty"), ([5] * max_model_len, "maximum context length")]


def _message(call: Any) -> str:
    with pytest.raises(RequestRejected) as exc:  # InvalidRequestError is one: what the scheduler would refuse
        call()
    return str(exc.value)


def test_every_front_end_refuses_a_bad_prompt_with_the_input_processors_message(llm_engine, tiny_dir,
                                                                                 monkeypatch) -> None:
    import tokenloom.engine.clients as clients
    from tokenloom.engine.async_llm import AsyncLLM
    from tokenloom.engine.input_processor import InvalidRequestError
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.engine.sync_mp_client import SyncMPClient

    ready = llm_engine.engine_ready(0.0)
    monkeypatch.setattr(clients, "_mp_client", lambda config, log_level, start_method: FakeClient(ready))
    dp = LLMEngine(engine_config_from_kwargs(model=str(tiny_dir), data_parallel_size=2))  # engine processes
    assert isinstance(dp.client, SyncMPClient)
    for part in ("scheduler", "runner", "engine_core", "reset_scheduler"):  # they live in the engine processes
        with pytest.raises(RuntimeError, match=f"LLMEngine.{part} needs the engine core in this process"):
            getattr(dp, part)() if part == "reset_scheduler" else getattr(dp, part)
    server = AsyncLLM(FakeClient(ready), ready, llm_engine.tokenizer)
    params = SamplingParams(max_tokens=8)
    try:
        for ids, words in _bad_prompts(ready.max_model_len):
            offline = _message(lambda ids=ids: llm_engine.add_request(None, {"prompt_token_ids": ids}, params))
            data_parallel = _message(lambda ids=ids: dp.add_request(None, {"prompt_token_ids": ids}, params))
            with pytest.raises(InvalidRequestError) as exc:
                server.add_request("r", ids, params, server.open_stream())
            assert words in offline and offline == data_parallel == str(exc.value), ids
        assert not llm_engine.has_unfinished_requests() and not dp.has_unfinished_requests()
        assert not server.client.sent  # refused before anything reached an engine
    finally:
        dp.close()


def test_make_client_picks_the_client_the_parallel_config_asks_for(monkeypatch) -> None:
    import tokenloom.engine.clients as clients
    import tokenloom.engine.dp_client as dp_client
    import tokenloom.engine.ray_engine as ray_engine

    made: list[tuple[int, list[int] | None]] = []

    class Spawned:  # MPClient's place: records what it would spawn
        def __init__(self, config: EngineConfig, log_level: str = "info", engine_index: int = 0,
                     cpus: list[int] | None = None, **kwargs: Any) -> None:  # fmt: skip
            assert config.parallel is None or config.parallel.data_parallel_size == 1  # each core is one engine
            made.append((engine_index, cpus))

    monkeypatch.setattr(clients, "MPClient", Spawned)
    monkeypatch.setattr(dp_client, "MPClient", Spawned)
    assert isinstance(clients.make_client(EngineConfig()), Spawned) and made == [(0, None)]
    made.clear()
    two = clients.make_client(EngineConfig(parallel=ParallelConfig(data_parallel_size=2)))
    assert isinstance(two, dp_client.DPEngineCoreClient) and [i for i, _ in made] == [0, 1]
    assert all(cpus for _, cpus in made)  # data-parallel engines split the cores

    class Placement:
        closed = False

        def close(self) -> None:
            Placement.closed = True

    monkeypatch.setattr(ray_engine, "start_ray_engines", lambda config, dp, log_level: (["a", "b"], Placement()))
    ray = clients.make_client(EngineConfig(parallel=ParallelConfig(distributed_executor_backend="ray",
                                                                       data_parallel_size=2)))
    assert isinstance(ray, dp_client.DPEngineCoreClient) and ray.clients == ["a", "b"]


def test_llm_engine_steps_an_in_process_client_unless_the_config_needs_engine_processes(monkeypatch) -> None:
    """make_client's table: in process (InprocClient) for LLMEngine, SyncMPClient over the engine processes when
    it asks for them, the asynchronous clients for AsyncLLM; impossible pairs refused with a reason."""
    import tokenloom.engine.clients as clients
    import tokenloom.engine.llm_engine as llm_engine_module
    from tokenloom.engine.sync_mp_client import SyncMPClient

    monkeypatch.setattr(clients, "InprocClient", lambda config, clock: ("here", config))
    monkeypatch.setattr(clients, "_mp_client", lambda config, log_level, start_method: ("processes", config))
    dp2 = EngineConfig(parallel=ParallelConfig(data_parallel_size=2))
    assert clients.make_client(EngineConfig(), multiprocess_mode=False, asyncio_mode=False)[0] == "here"
    assert clients.make_client(dp2)[0] == "processes"  # AsyncLLM's
    sync = clients.make_client(dp2, asyncio_mode=False)
    assert isinstance(sync, SyncMPClient) and sync.client[0] == "processes"
    with pytest.raises(ValueError, match="asyncio_mode needs multiprocess_mode"):
        clients.make_client(EngineConfig(), multiprocess_mode=False)
    with pytest.raises(ValueError, match="runs engine-core processes"):
        clients.make_client(dp2, multiprocess_mode=False, asyncio_mode=False)

    asked: list[bool] = []

    def record(config: EngineConfig, log_level: str, *, multiprocess_mode: bool, **kwargs: Any) -> Any:
        asked.append(multiprocess_mode)
        raise KeyboardInterrupt  # (stop before anything loads)

    monkeypatch.setattr(llm_engine_module, "make_client", record)
    for config in (EngineConfig(), dp2, EngineConfig(parallel=ParallelConfig(distributed_executor_backend="ray")),
                   EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray"))):
        with pytest.raises(KeyboardInterrupt):
            llm_engine_module.LLMEngine(config)
    # Ray with tensor parallelism places the ranks from an engine core in this process (RayExecutor).
    assert asked == [False, True, True, False]


def test_async_llm_asks_its_client_what_it_is(llm_engine) -> None:
    from tokenloom.engine.async_llm import AsyncLLM

    ready = llm_engine.engine_ready(0.0)
    client = FakeClient(ready)
    client.data_parallel_size = 3
    client.engine_health = lambda: [{"engine": 0, "alive": True}]
    server = AsyncLLM(client, ready, llm_engine.tokenizer)
    assert server.data_parallel_size == 3 and server.engine_health() == [{"engine": 0, "alive": True}]


def test_max_model_len_is_resolved_once_by_the_engine(llm_engine) -> None:
    from tokenloom.core.prompt_fit import resolve_max_model_len

    # No placeholder: a knob checked against max_model_len waits until the engine knows it.
    config = engine_config_from_kwargs(long_prefill_token_threshold=100)
    assert config.scheduler.max_model_len is None and config.scheduler.long_prefill_token_threshold == 100
    assert resolve_max_model_len(config, model_max_len=4096, default=512) == 512
    with pytest.raises(ConfigError, match="larger than the model's context length"):
        resolve_max_model_len(replace(config, max_model_len=8192), model_max_len=4096, default=512)
    assert llm_engine.scheduler_config.max_model_len == llm_engine.input_processor.info.max_model_len == 64


def test_the_start_up_log_names_the_context_the_default_max_model_len_leaves_out(caplog) -> None:
    from tokenloom.engine.core_host import EngineCoreHost

    def resolved(model_max_len: int, pool_tokens: int, **kwargs: Any) -> tuple[int, str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="tokenloom.engine.core_host"):
            sched = EngineCoreHost._scheduler_config(engine_config_from_kwargs(**kwargs), model_max_len, pool_tokens)
        return sched.max_model_len, caplog.text

    # A 32k model on a pool that holds it: capped at 8,192, and the log says how far it can go.
    length, log = resolved(32768, 32768)
    assert length == 8192 and "the model's context is 32768" in log and "up to 32768 with this KV pool" in log
    # A pool that holds less than the cap: the pool bounds it, and the log says what raises it.
    length, log = resolved(32768, 5000)
    assert length == 5000 and "a larger --kv-cache-memory" in log
    # Nothing left out (the whole context is the default), or the user chose: no line.
    assert resolved(4096, 32768) == (4096, "")
    assert resolved(32768, 32768, max_model_len=16384) == (16384, "")
