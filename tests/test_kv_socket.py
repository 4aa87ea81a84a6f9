"""The SocketConnector (tokenloom/kv_transfer/socket_connector.py): prefill/decode hand-off over TCP with
vLLM's kv_transfer_params flow. Greedy tokens equal one engine's and the decode engine loads the prompt's
full blocks (cached tokens); a prefill engine that is gone, or of another fingerprint, costs only a
recompute; the prefill engine holds no pool block for a decode engine (the autouse leak check); the wire
keeps a checked prefix. The server-level flow (two `tokenloom serve`, the proxy, a killed decode engine)
is tests/test_pd_handoff.py[socket]."""

from __future__ import annotations

import logging
import socket

import pytest

from tests.test_kv_offload import BS, EXPECTED_HIT, GREEDY, OTHER, PROMPT, _run
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM
from tokenloom.config import ConfigError, engine_config_from_kwargs
from tokenloom.engine.kv_connectors import data_parallel_kv_transfer
from tokenloom.kv_transfer.socket_transport import BlockServer, BlockStore, fetch_blocks
from tokenloom.sampling_params import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def socket_config(role: str, port: int | None = None, **extra) -> dict:
    config = {"kv_connector": "SocketConnector", "kv_role": role, "kv_connector_extra_config": extra}
    if port is not None:
        config["kv_port"] = port
    return config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=BS)
    return {name: _run(llm, p)[0] for name, p in (("prompt", PROMPT), ("other", OTHER))}


def _llm(tiny_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 32)
    return LLM(str(tiny_dir), dtype="float32", block_size=BS, **kwargs)


FIRST = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def _then(params: dict, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": params})


@pytest.mark.parametrize("load_async", [False, True], ids=["fetch-at-lookup", "fetch-in-background"])
@pytest.mark.parametrize("options", [
    {},
    {"async_scheduling": True,
     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["plain", "async-ngram"])
def test_socket_handoff_between_two_engines(tiny_dir, reference, options, load_async):
    port = free_port()
    prefill = _llm(tiny_dir, kv_transfer_config=socket_config("kv_producer", port))
    decode = _llm(tiny_dir, kv_transfer_config=socket_config("kv_consumer", load_async=load_async), **options)
    out = prefill.generate([{"prompt_token_ids": PROMPT}], FIRST, use_tqdm=False)[0]
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] is True and (params["remote_host"], params["remote_port"]) == ("127.0.0.1", port)
    # vLLM's: the prefill engine's own prefix-cache hit (none: the prompt was new there), which the decode engine
    # reports as the request's cached tokens instead of its near-total hit on the KV it loads.
    assert params["remote_prefill_cached_tokens"] == 0
    got = decode.generate([{"prompt_token_ids": PROMPT}], _then(params), use_tqdm=False)[0]
    assert (list(got.outputs[0].token_ids), got.num_cached_tokens) == (reference["prompt"], 0)
    assert decode.llm_engine.kv_connector.loaded_tokens == EXPECTED_HIT
    # Without kv_transfer_params the decode engine computes the prompt itself.
    other = decode.generate([{"prompt_token_ids": OTHER}], GREEDY, use_tqdm=False)[0]
    assert (list(other.outputs[0].token_ids), other.num_cached_tokens) == (reference["other"], 0)
    # A plain request on the prefill engine sends nothing and returns no kv_transfer_params.
    stored = len(prefill.llm_engine.runner.kv_connector.store)
    plain = prefill.generate([{"prompt_token_ids": OTHER}], GREEDY, use_tqdm=False)[0]
    assert plain.kv_transfer_params is None and len(prefill.llm_engine.runner.kv_connector.store) == stored
    prefill.llm_engine.close()
    decode.llm_engine.close()


@pytest.mark.parametrize("load_async", [False, True], ids=["fetch-at-lookup", "fetch-in-background"])
def test_a_prefill_engine_gone_costs_only_a_recompute(tiny_dir, reference, caplog, load_async):
    prefill = _llm(tiny_dir, kv_transfer_config=socket_config("kv_producer", free_port()))
    params = prefill.generate([{"prompt_token_ids": PROMPT}], FIRST, use_tqdm=False)[0].kv_transfer_params
    prefill.llm_engine.close()  # its server closes with it
    decode = _llm(tiny_dir, kv_transfer_config=socket_config("kv_consumer", fetch_timeout_s=5, load_async=load_async))
    caplog.set_level(logging.WARNING, logger="tokenloom.kv_transfer.socket_connector")
    got = decode.generate([{"prompt_token_ids": PROMPT}], _then(params), use_tqdm=False)[0]
    assert (list(got.outputs[0].token_ids), got.num_cached_tokens) == (reference["prompt"], 0)
    assert "no KV from the prefill engine" in caplog.text
    assert decode.llm_engine.kv_connector.loaded_tokens == 0
    decode.llm_engine.close()


def test_a_decode_engine_of_another_fingerprint_loads_nothing(tiny_dir, caplog):
    prefill = _llm(tiny_dir, kv_transfer_config=socket_config("kv_producer", free_port()))
    params = prefill.generate([{"prompt_token_ids": PROMPT}], FIRST, use_tqdm=False)[0].kv_transfer_params
    decode = LLM(str(tiny_dir), dtype="float32", block_size=8, num_blocks=16,  # other blocks, other bytes
                 kv_transfer_config=socket_config("kv_consumer"))
    caplog.set_level(logging.WARNING, logger="tokenloom.kv_transfer.socket_connector")
    got = decode.generate([{"prompt_token_ids": PROMPT}], _then(params, 4), use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and "another model or cache options" in caplog.text
    prefill.llm_engine.close()
    decode.llm_engine.close()


def _h(n: int) -> bytes:
    """A block hash (a digest: 32 bytes for sha256, 16 for xxhash's; both travel padded to 32)."""
    return bytes([n]) * (32 if n % 2 else 16)


def test_the_wire_serves_a_checked_prefix():
    store = BlockStore(capacity_bytes=3 * 8, block_nbytes=8)
    for h in (11, 12, 13):
        store.put(_h(h), bytes([h]) * 8)
    server = BlockServer(store, b"d" * 32, "127.0.0.1", 0)
    host, port = server.address
    try:
        # The longest stored prefix, in order; a gap ends it.
        assert fetch_blocks(host, port, b"d" * 32, [_h(11), _h(12), _h(99), _h(13)], 8) == [
            bytearray([11] * 8), bytearray([12] * 8)]
        assert fetch_blocks(host, port, b"d" * 32, [_h(99), _h(11)], 8) == []
        with pytest.raises(ValueError, match="another model or cache options"):
            fetch_blocks(host, port, b"x" * 32, [_h(11)], 8)
        store.put(_h(14), bytes(8))  # over the bound: the least recently used (13) goes
        assert _h(13) not in store and _h(11) in store and _h(14) in store
    finally:
        server.close()
    with pytest.raises(OSError):
        fetch_blocks(host, port, b"d" * 32, [_h(11)], 8, timeout_s=2)


def test_socket_options_are_checked(tiny_dir):
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key"):
        _llm(tiny_dir, kv_transfer_config=socket_config("kv_consumer", bogus=1))
    with pytest.raises(ConfigError, match="kv_port"):
        _llm(tiny_dir, kv_transfer_config=socket_config("kv_producer", 0))
    port = free_port()
    first = _llm(tiny_dir, kv_transfer_config=socket_config("kv_producer", port))
    with pytest.raises(RuntimeError, match="cannot listen"):
        _llm(tiny_dir, kv_transfer_config=socket_config("kv_producer", port))
    first.llm_engine.close()
    config = engine_config_from_kwargs(model=str(tiny_dir), kv_transfer_config=socket_config("kv_producer", port))
    with pytest.raises(ConfigError, match="its own kv_port"):
        data_parallel_kv_transfer(config, 1)


def test_the_data_parallel_proxy_options(tiny_dir):
    from tokenloom.config import ParallelConfig
    from tokenloom.router import Router, RouterConfig

    with pytest.raises(ConfigError, match="leaves no decode engine"):
        ParallelConfig(data_parallel_size=2, data_parallel_prefill_engines=2)
    config = engine_config_from_kwargs(model=str(tiny_dir), kv_transfer_config=socket_config("kv_both", 15000))
    roles = [data_parallel_kv_transfer(config, rank, 2).kv_transfer_config for rank in range(3)]
    assert [(kv.kv_role, kv.kv_port) for kv in roles] == [("kv_producer", 15000), ("kv_producer", 15001),
                                                          ("kv_consumer", 15000)]
    offload = engine_config_from_kwargs(model=str(tiny_dir), kv_offloading_size=1)
    with pytest.raises(ConfigError, match="over the SocketConnector"):
        data_parallel_kv_transfer(offload, 0, 1)
    # Each phase is routed among its own engines only.
    router = Router(RouterConfig(policy="round_robin", num_prefill_engines=1), 3, BS, 64)
    assert {router.route(f"d{i}", PROMPT, engines=range(1, 3)) for i in range(6)} == {1, 2}
    assert {router.route(f"p{i}", PROMPT, engines=range(1)) for i in range(3)} == {0}
