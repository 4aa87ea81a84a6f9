"""LoRA adapters through `tokenloom serve` (issue 34): --lora-modules (both forms), the `model` field,
/v1/models with `parent`, runtime /v1/load_lora_adapter and /v1/unload_lora_adapter while requests run,
and vllm:lora_requests_info."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.test_lora import PROMPTS, make_peft_adapter
from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model
from tokenloom.engine.llm import LLM
from tokenloom.lora.request import LoRARequest
from tokenloom.sampling_params import SamplingParams
from tokenloom.server.errors import APIError
from tokenloom.server.lora_modules import LoRAModulePath, parse_lora_module
from tokenloom.server.serving_models import ServingModels

pytestmark = pytest.mark.slow
BASE = "tiny-base"
# EngineReady.lora of the tiny base model (what ServingModels checks adapters against)
TINY_LORA_INFO = {"max_loras": 1, "max_lora_rank": 8, "num_layers": 2,
                  "target_shapes": {"q_proj": [64, 64], "v_proj": [64, 32], "k_proj": [64, 32], "o_proj": [64, 64],
                                    "gate_proj": [64, 128], "up_proj": [64, 128], "down_proj": [128, 64]}}
IDS = PROMPTS[1]["prompt_token_ids"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_hf_model(root, arch="llama", seed=5)
    adapters = {"sql": make_peft_adapter(base, root / "sql", seed=21),
                "chat": make_peft_adapter(base, root / "chat", seed=22, targets=("q_proj", "v_proj", "down_proj")),
                "late": make_peft_adapter(base, root / "late", seed=23),
                "big": make_peft_adapter(base, root / "big", seed=24, r=16)}
    return base, adapters


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    base, adapters = models
    args = [str(base), "--dtype", "float32", "--num-blocks", "256", "--block-size", "4", "--served-model-name", BASE,
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"sql={adapters['sql']}",
            json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": BASE})]
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as s:
        yield s


@pytest.fixture(scope="module")
def offline(models):
    """The offline engine's greedy texts for each adapter (test_lora.py holds those against peft)."""
    base, adapters = models
    llm = LLM(str(base), dtype="float32", num_blocks=64, block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {None: llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("sql", "chat", "late"), start=1):
        req = LoRARequest(name, i, str(adapters[name]))
        [res] = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False, lora_request=req)
        out[name] = res.outputs[0].text
    return out


def complete(server, model: str, max_tokens: int = 24) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": IDS, "max_tokens": max_tokens,
                                                            "temperature": 0.0, "ignore_eos": True}, timeout=120)


def test_models_lists_adapters_with_their_parent(server, models) -> None:
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}
    assert cards[BASE]["parent"] is None
    assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == str(models[1]["sql"])
    assert cards["chat"]["parent"] == BASE
    assert httpx.get(server.url + "/v1/models/sql", timeout=30).json()["id"] == "sql"


def test_the_model_field_picks_the_adapter(server, offline) -> None:
    for model, key in ((BASE, None), ("sql", "sql"), ("chat", "chat")):
        r = complete(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == offline[key], model
    chat = httpx.post(server.url + "/v1/chat/completions", json={"model": "chat", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "chat"
    assert complete(server, "nope").status_code == 404


def test_runtime_load_and_unload_while_requests_run(server, models, offline) -> None:
    base, adapters = models
    long_result: dict = {}
    running = threading.Thread(target=lambda: long_result.update(r=complete(server, "sql")))
    running.start()
    late = {"lora_name": "late", "lora_path": str(adapters["late"])}
    load = httpx.post(server.url + "/v1/load_lora_adapter", json=late, timeout=60)
    assert load.status_code == 200 and "added successfully" in load.text
    again = httpx.post(server.url + "/v1/load_lora_adapter", json=late, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # vLLM's load_inplace: the name now serves the other adapter's weights (found by the request fuzzer's lora
    # configuration, which got a 400 where vLLM 0.32 answers 200)
    inplace = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "late", "lora_path": str(adapters["sql"]), "load_inplace": True})
    assert inplace.status_code == 200 and "added successfully" in inplace.text
    assert complete(server, "late").json()["choices"][0]["text"] == offline["sql"]
    httpx.post(server.url + "/v1/load_lora_adapter", json={**late, "load_inplace": True}, timeout=60)
    for path in ("/nonexistent", "x" * 5000):  # (a name past NAME_MAX made Path.is_dir raise: a 500)
        missing = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": path},
                             timeout=60)
        assert missing.status_code == 404, missing.text
    big = httpx.post(server.url + "/v1/load_lora_adapter",
                     json={"lora_name": "big", "lora_path": str(adapters["big"])}, timeout=60)
    assert big.status_code == 400 and "LoRA rank 16 is greater than max_lora_rank 8" in big.json()["error"]["message"]
    r = complete(server, "late")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline["late"]
    unload = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert unload.status_code == 200 and "removed successfully" in unload.text
    assert complete(server, "late").status_code == 404
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 404
    running.join(120)
    assert long_result["r"].status_code == 200 and long_result["r"].json()["choices"][0]["text"] == offline["sql"]


def test_lora_requests_info_metric(server) -> None:
    assert complete(server, "sql", max_tokens=2).status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line


def test_runtime_loads_refused_in_vllm_words(models, tmp_path) -> None:
    """/v1/load_lora_adapter's refusals as vLLM 0.32's (serving.py): no adapter at the path is its 404, a name
    loaded already its 400 naming load_inplace, which replaces the adapter (a fresh id: no stale KV blocks)."""
    sm = ServingModels([BASE], TINY_LORA_INFO)
    (tmp_path / "empty").mkdir()
    for path in ("/nonexistent", str(tmp_path / "empty"), "x" * 5000):
        with pytest.raises(APIError) as err:
            sm.load_lora_adapter("m", path)
        assert (err.value.status, err.value.message) == (404, f"Loading lora m failed: No adapter found for {path}")
    first = sm.load_lora_adapter("sql", str(models[1]["sql"]))
    with pytest.raises(APIError) as err:
        sm.load_lora_adapter("sql", str(models[1]["chat"]))
    assert err.value.status == 400 and err.value.message == (
        "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set "
        "'load_inplace' to True.")
    again = sm.load_lora_adapter("sql", str(models[1]["chat"]), load_inplace=True)
    assert sm.lora_request("sql") is again and again.lora_path == str(models[1]["chat"])
    assert again.lora_int_id != first.lora_int_id
    with pytest.raises(APIError) as err:
        sm.load_lora_adapter(BASE, str(models[1]["chat"]), load_inplace=True)
    assert err.value.message == f"The lora adapter '{BASE}' conflicts with a served base model."


def test_lora_module_parsing_and_refusals(models) -> None:
    assert parse_lora_module("a=/x") == LoRAModulePath("a", "/x")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "b"}') == LoRAModulePath("a", "/x", "b")
    for bad in ("a", "=/x", '{"name": "a"}', '{"name": "a", "path": "/x", "extra": 1}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        ServingModels([BASE], None, [LoRAModulePath("a", "/x")])
    with pytest.raises(ValueError, match="--lora-modules big: .*LoRA rank 16"):
        ServingModels([BASE], TINY_LORA_INFO, [LoRAModulePath("big", str(models[1]["big"]))])
