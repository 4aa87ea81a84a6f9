"""Prefill/decode hand-off (issue 36 item 4): a prefill `tokenloom serve` and a decode one, KV handed over
through a shared directory by the SharedStorageConnector or over TCP by the SocketConnector, vLLM's
kv_transfer_params flow through the proxy (tokenloom/server/pd_proxy.py). Greedy tokens equal one
engine's; the decode engine computes only the last prompt token (cached_tokens); a killed decode engine
fails only its request, with 502, and the prefill engine holds nothing afterwards (the harness checks
every live server for leaks)."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from tests.test_kv_offload import BS, EXPECTED_HIT, PROMPT
from tests.test_kv_socket import free_port
from tests.test_server_harness import ServerProcess, metric
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams
from tokenloom.server.pd_proxy import make_pd_proxy_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def _engine(tiny_dir, shared, role: str, log, connector: str = "shared", kv_port: int = 0) -> ServerProcess:
    if connector == "socket":  # the decode engine fetches from the prefill engine's kv_port
        config = {"kv_connector": "SocketConnector", "kv_role": role, "kv_port": kv_port}
    else:
        config = {"kv_connector": "SharedStorageConnector", "kv_role": role,
                  "kv_connector_extra_config": {"shared_storage_path": str(shared)}}
    return ServerProcess(str(tiny_dir), "--dtype", "float32", "--num-blocks", "64", "--block-size", str(BS),
                         "--kv-transfer-config", json.dumps(config), "--enable-prompt-tokens-details", log_path=log)


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy",
                                 timeout=120) as client:
        return await client.post(path, json=body)


async def _stream_text(app, body: dict) -> str:
    text = ""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=120)
    async with client, client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.parametrize("connector", ["shared", "socket"])
def test_prefill_then_decode_equals_one_engine(tiny_dir, tmp_path, connector):
    ref = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=BS)
    want = list(ref.generate([{"prompt_token_ids": PROMPT}],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids)
    shared = tmp_path / "shared"
    port = free_port()
    with _engine(tiny_dir, shared, "kv_producer", tmp_path / "p.log", connector, port) as prefill, \
            _engine(tiny_dir, shared, "kv_consumer", tmp_path / "d.log", connector, port) as decode:
        model = httpx.get(decode.url + "/v1/models").json()["data"][0]["id"]
        app = make_pd_proxy_app(prefill.url, decode.url)
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = asyncio.run(_post(app, "/v1/completions", body))
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["token_ids"] == want
        # The decode engine loaded the prompt's full blocks and computed only the last token; as vLLM 0.32's, it
        # reports the prefill engine's own prefix-cache hit as the cached tokens (none: the prompt was new there,
        # kv_transfer_params' remote_prefill_cached_tokens), not its near-total hit on the KV it pulled.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(decode.metrics(), "tokenloom:external_prefix_cache_hits_total") == EXPECTED_HIT
        # The prefill engine sampled one token; its response named the shared directory.
        assert metric(prefill.metrics(), "tokenloom:generation_tokens_total") == 1
        assert asyncio.run(_stream_text(app, body)) == out["choices"][0]["text"]
        # Chat through the proxy: the decode engine loads the rendered prompt's blocks too.
        chat = {"model": model, "messages": [{"role": "user", "content": "tell me about the sea " * 6}],
                "max_tokens": 6, "temperature": 0}
        r = asyncio.run(_post(app, "/v1/chat/completions", chat))
        assert r.status_code == 200, r.text
        direct = httpx.post(decode.url + "/v1/chat/completions", json=chat, timeout=60).json()
        assert r.json()["choices"][0]["message"] == direct["choices"][0]["message"]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prefill engine's hit
        assert metric(decode.metrics(), "tokenloom:external_prefix_cache_hits_total") > EXPECTED_HIT
        # The same prompt again: now the prefill engine finds its blocks in its own prefix cache, and says so.
        r = asyncio.run(_post(app, "/v1/completions", body))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == EXPECTED_HIT

        decode.stop(signal.SIGKILL)
        r = asyncio.run(_post(app, "/v1/completions", dict(body, prompt=PROMPT[::-1])))
        assert r.status_code == 502 and "decode engine" in r.json()["error"]["message"]
        assert prefill.health_status() == 200
        values = prefill.metrics()
        assert metric(values, "tokenloom:num_requests_running") == 0
        assert metric(values, "tokenloom:kv_cache_usage_perc") == 0.0


def test_the_data_parallel_router_as_the_proxy(tiny_dir, tmp_path):
    """`--data-parallel-size 2 --data-parallel-prefill-engines 1`: engine 0 prefills, engine 1 decodes, the
    SocketConnector between them, the DP client doing the proxy's two requests (docs/kv_offload.md)."""
    ref = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=BS)
    want = list(ref.generate([{"prompt_token_ids": PROMPT}],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids)
    config = {"kv_connector": "SocketConnector", "kv_role": "kv_both", "kv_port": free_port()}
    with ServerProcess(str(tiny_dir), "--dtype", "float32", "--num-blocks", "64", "--block-size", str(BS),
                       "--data-parallel-size", "2", "--data-parallel-prefill-engines", "1",
                       "--kv-transfer-config", json.dumps(config), "--enable-prompt-tokens-details",
                       log_path=tmp_path / "dp.log") as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert out["choices"][0]["token_ids"] == want
        # The decode engine loaded the prompt's full blocks from the prefill engine.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == EXPECTED_HIT
        values = server.metrics()
        assert metric(values, "tokenloom:external_prefix_cache_hits_total") == EXPECTED_HIT
        # Streaming goes the same way; the output the client sees is the decode engine's.
        text = ""
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == out["choices"][0]["text"]
