"""`make serve`'s configuration (the default model, SmolLM2-135M-Instruct, default options, loopback)
answers the official openai client sensibly."""

from __future__ import annotations

import openai
import pytest

from tests.test_server_harness import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # As the Makefile runs it, on an ephemeral port instead of 8000.
    with ServerProcess("--host", "127.0.0.1", log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


def test_default_model_answers_a_chat_request(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct" and model.model_extra["max_model_len"] == 8192
    reply = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital city of Germany?"}],
        temperature=0.0, max_completion_tokens=40,
    )
    text = reply.choices[0].message.content
    # A question the 135M model answers on every path (it calls Paris "Le Grand Château" on some).
    assert "Berlin" in text, text
    assert reply.usage.completion_tokens <= 40 and reply.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital city of Germany?"}],
        temperature=0.0, max_completion_tokens=40, stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_the_kv_cache_keeps_the_ggufs_16bit_type(server) -> None:
    """`make serve`'s KV cache: where --dtype auto runs float32 (no AVX512-BF16 / AMX), the GGUF's float16, twice
    a float32 cache's blocks in the same 2 GiB (docs/kv_cache.md); where it runs bf16, the run's bf16. /metrics'
    vLLM cache info says which."""
    import re

    import httpx
    import torch

    from tokenloom.model.platform import resolve_dtype

    want = "float16" if resolve_dtype("auto", torch.device("cpu")) == torch.float32 else "bfloat16"
    info = re.search(r'vllm:cache_config_info\{([^}]*)\}', httpx.get(server.url + "/metrics", timeout=30).text)
    assert info and f'cache_dtype="{want}"' in info.group(1), info
    blocks = int(re.search(r'num_gpu_blocks="(\d+)"', info.group(1)).group(1))
    assert blocks == (2 << 30) // (30 * 2 * 3 * 64 * 2 * 16)  # 30 layers, K and V, 3 kv heads of 64, 2 bytes, 16 tokens
