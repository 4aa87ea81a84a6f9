"""Server behaviours that had no test: int8 layers through the server, a request that can never fit the
KV pool (400 before anything runs), and /tokenize and /detokenize given bad input (400, naming it)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.test_server_harness import ServerProcess
from tests.tiny_models import make_tiny_hf_model
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
# 8 blocks of 4 tokens: 32 tokens of KV for a 128-token context, so some requests can never fit.
ENGINE = {"dtype": "float32", "num_blocks": 8, "block_size": 4, "max_model_len": 128, "quantization": "int8"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    args = [str(tiny_dir)] + [a for k, v in ENGINE.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    args += ["--uvicorn-log-level", "info"]  # the engine's start-up line (it names the int8 layers) is INFO
    with ServerProcess(*args, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_int8_through_the_server_gives_the_offline_int8_tokens(server, http, tiny_dir) -> None:
    assert "int8" in server.log()  # the start-up line names the int8 layers
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44]]
    got = []
    for p in prompts:
        r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "temperature": 0.0,
                                               "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    llm = LLM(str(tiny_dir), **ENGINE)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                         SamplingParams(temperature=0.0, max_tokens=10,
                                                                        ignore_eos=True), use_tqdm=False)]
    assert got == want and all(len(g) == 10 for g in got)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_can_never_fit_the_pool_is_a_400(http, stream) -> None:
    body = {"prompt": list(range(5, 25)), "max_tokens": 60, "stream": stream}  # 79 tokens of KV > 32
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "KV-cache blocks" in err["message"], err
    ok = http.post("/v1/completions", json={**body, "max_tokens": 8, "ignore_eos": True})
    assert ok.status_code == 200  # the same prompt with room to finish is served
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 30}],
                                                   "max_tokens": 60})
    assert chat.status_code == 400, chat.text


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": "hello"}, "messages"),
    ("/tokenize", {"prompt": "x", "model": "no-such-model"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [5], "model": "no-such-model"}, "model"),
])
def test_tokenize_and_detokenize_reject_bad_input_naming_it(http, path, body, field) -> None:
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert field in f"{err.get('param')} {err['message']}", err
    bad_json = http.post(path, content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert http.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200  # still serving


def test_a_client_that_leaves_while_sending_its_body_is_not_a_server_error(server, http) -> None:
    """The soak's clients that walk away sometimes close mid-body: that was an unhandled
    ClientDisconnect (a 500 logged with a traceback); it is a quiet 499 nobody reads."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4000\r\n\r\n{\"prompt\": [5, 6, ")
        time.sleep(0.3)  # the handler is reading the body when the connection closes
    time.sleep(0.5)
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200, r.text
    log = server.log_path.read_text(errors="replace")
    assert "unhandled error" not in log and "Exception in ASGI application" not in log, log[-3000:]
