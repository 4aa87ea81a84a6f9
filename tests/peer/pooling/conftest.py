"""tests/peer/pooling: vLLM 0.32.0's pooling tests (embeddings, classification, scores, reranking, PoolingParams)
on tokenloom; vllm_shim.py is the plumbing, standins.py the local models standing in for the Hub ones. What is
vendored, what is not and why: docs/vllm_peer.md, "Pooling".

The online files each start a `tokenloom serve` (5-10 s on the shared 2-core machine before any case runs):
`make test` skips them and `make test-peer` (TOKENLOOM_PEER_FULL=1) runs them; what they check that tokenloom
fixed is also in tests/test_server_pooling.py, on its one server."""

from __future__ import annotations

import os

import pytest

from tests.peer.pooling import vllm_shim

# Each of these modules starts its own server: full run only.
_FULL_RUN_ONLY_FILES = {
    "test_vllm_embed_online.py", "test_vllm_embed_online_dimensions.py", "test_vllm_embed_online_long_text.py",
    "test_vllm_truncation.py", "test_vllm_cross_encoder_online.py", "test_vllm_bi_encoder_online.py",
    "test_vllm_classify_online.py", "test_vllm_token_embed_online.py", "test_vllm_token_classify_online.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TOKENLOOM_PEER_FULL"):
        return
    skip = pytest.mark.skip(reason="starts a server: run by `make test-peer` (TOKENLOOM_PEER_FULL=1)")
    for item in items:
        if item.path.name in _FULL_RUN_ONLY_FILES:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's (no global clean-up after the test)")


@pytest.fixture(scope="session", autouse=True)
def _standins(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where this session builds the stand-in models (each on first use)."""
    vllm_shim.ROOT = tmp_path_factory.mktemp("pooling-standins")


@pytest.fixture(scope="session")
def vllm_runner() -> type[vllm_shim.VllmRunner]:
    return vllm_shim.VllmRunner


@pytest.fixture(scope="session")
def hf_runner() -> type[vllm_shim.HfRunner]:
    return vllm_shim.HfRunner


@pytest.fixture
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:  # vLLM's: its logger's records
    return caplog


@pytest.fixture
def anyio_backend() -> str:  # vLLM's async cases run on anyio's plugin (pytest-asyncio's marker is anyio's here)
    return "asyncio"
