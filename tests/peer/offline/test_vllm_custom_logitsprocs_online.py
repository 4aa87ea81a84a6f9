# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/logits_processors/test_custom_online.py, the test bodies unchanged, against
# `tokenloom serve` with a custom logits processor given by --logits-processors (a fully-qualified class name) or
# installed under the `vllm.logits_processors` entry-point group. Plumbing: the imports; vLLM's
# RemoteOpenAIServerCustom (which forks the given function to run `vllm serve` in-process) is the HTTP harness's
# RemoteOpenAIServer (benchmarks/vllm_peer/remote_server.py: `tokenloom serve` in its own process, serving the
# default model under the test's model name); since that process and its engine process are spawned, the entry
# point is installed as vLLM installs it for spawned processes (vllm_logitsprocs_utils.register_fake_entrypoint: a
# dist-info directory on PYTHONPATH); the server fixture is module-scoped (one server per configuration, not one per
# test), with a module-scoped monkeypatch; pytest-asyncio's marker and fixture are anyio's (the plugin this
# repository runs). Both configurations take about 40 s together on 2 cores: `make test-peer` runs them
# (TOKENLOOM_PEER_FULL=1), `make test` skips them (tests/test_logits_processors.py serves --logits-processors once).

import os
import random
import sys
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from benchmarks.vllm_peer.remote_server import RemoteOpenAIServer
from tests.peer.offline.vllm_logitsprocs_utils import (
    DUMMY_LOGITPROC_ARG,
    DUMMY_LOGITPROC_FQCN,
    MAX_TOKENS,
    TEMP_GREEDY,
    prompts,
)
from tests.peer.offline.vllm_logitsprocs_utils import (
    register_fake_entrypoint as setup_fake_entrypoint,
)

# vLLM's model name: the harness serves the default model (or $TOKENLOOM_PEER_MODEL) under it.
MODEL_NAME = "facebook/opt-125m"
pytest_asyncio = SimpleNamespace(fixture=pytest.fixture)


class RemoteOpenAIServerCustom(RemoteOpenAIServer):
    """vLLM's: `child_process_fxn` starts the server in a forked process; tokenloom serve starts on its own."""

    def __init__(self, model: str, vllm_serve_args: list[str], child_process_fxn: Any, **kwargs: Any) -> None:
        super().__init__(model, vllm_serve_args, **kwargs)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def monkeypatch():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _server_with_logitproc_entrypoint(
    env_dict: dict[str, str] | None,
    model: str,
    vllm_serve_args: list[str],
) -> None:
    """Start vLLM server with dummy logitproc entrypoint."""
    from vllm.entrypoints.cli import main

    if env_dict is not None:
        os.environ.update(env_dict)

    # Emulate `vllm serve <model> <CLI args>`
    sys.argv = ["vllm", "serve", model] + vllm_serve_args
    main.main()


def _server_with_logitproc_fqcn(
    env_dict: dict[str, str] | None,
    model: str,
    vllm_serve_args: list[str],
) -> None:
    """Start vLLM server with dummy logitproc specified by FQCN."""
    from vllm.entrypoints.cli import main

    if env_dict is not None:
        os.environ.update(env_dict)

    # Emulate `vllm serve <model> <CLI args>`
    sys.argv = ["vllm", "serve", model] + vllm_serve_args
    main.main()


@pytest.fixture(scope="module")
def default_server_args():
    return [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "128",
    ]


@pytest.fixture(
    scope="module", params=[[], ["--logits-processors", DUMMY_LOGITPROC_FQCN]]
)
def server(default_server_args, request, monkeypatch):
    """Consider two server configurations:
    (1) --logits-processors cli arg specifies dummy logits processor via fully-
    qualified class name (FQCN)
    (2) No --logits-processors cli arg; inject a dummy logits processor
    entrypoint
    """
    # Test that logitproc info is passed to workers
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # These tests exercise the V1-interface logits processor; Model Runner V2
    # rejects V1-interface processors at load time by design.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")

    if request.param:
        # Launch server, append FQCN argument, inject dummy logitproc module
        args = default_server_args + request.param
        _server_fxn = _server_with_logitproc_fqcn
    else:
        # Launch server, inject dummy logitproc entrypoint
        setup_fake_entrypoint(monkeypatch)
        args = default_server_args
        _server_fxn = _server_with_logitproc_entrypoint

    with RemoteOpenAIServerCustom(MODEL_NAME, args, _server_fxn) as remote_server:
        yield remote_server


@pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client


# General request argument values for these tests
api_keyword_args = {
    # Greedy sampling ensures that requests which receive the `target_token`
    # arg will decode it in every step
    "temperature": TEMP_GREEDY,
    # Since EOS will never be decoded (unless `target_token` is EOS)
    "max_tokens": MAX_TOKENS,
    # Return decoded token logprobs (as a way of getting token id)
    "logprobs": 0,
}


@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
def test_custom_logitsprocs(server, model_name: str):
    """Test custom logitsprocs when starting OpenAI server from CLI.

    Launch vLLM OpenAI-compatible server, configured to load a custom logitproc
    that has a well-defined behavior (mask out all tokens except one
    `target_token`).

    Pass in requests, 50% of which pass a `target_token` value
    in through `extra_body["vllm_xargs"]`, 50% of which do not.

    Validate that requests which activate the custom logitproc, repeat the same
    token
    """
    import asyncio

    async def _async_main(srv, mn):
        async with srv.get_async_client() as client:
            await _run(client)

    async def _run(client):
        use_dummy_logitproc = True
        for prompt in prompts:
            # Build request arguments
            request_keyword_args: dict[str, Any] = {
                **api_keyword_args,
            }
            if use_dummy_logitproc:
                # 50% of requests pass target_token custom arg
                target_token = random.choice([128, 67])
                # For requests which activate the dummy logitproc, choose one of
                # two `target_token` values which are known not to be EOS tokens
                request_keyword_args["extra_body"] = {
                    "vllm_xargs": {DUMMY_LOGITPROC_ARG: target_token}
                }
            batch = await client.completions.create(
                model=model_name,
                prompt=prompt,
                **request_keyword_args,
            )

            if use_dummy_logitproc:
                # Only for requests which activate dummy logitproc - validate that
                # output token is repeated
                choices: openai.types.CompletionChoice = batch.choices
                toks = choices[0].logprobs.tokens
                if not all([x == toks[0] for x in toks]):
                    raise AssertionError(f"Generated {toks} should all be {toks[0]}")

            # Alternate whether to activate dummy logitproc for each request
            use_dummy_logitproc = not use_dummy_logitproc

    asyncio.run(_async_main(server, model_name))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_custom_logitsproc_arg(
    client: openai.AsyncOpenAI, model_name: str
):
    """Test that request with invalid custom logitsproc is rejected."""
    prompt = "Hello, my name is"
    # Pass invalid (non-int) target_token value to dummy logits processor
    request_keyword_args: dict[str, Any] = {
        **api_keyword_args,
        "extra_body": {
            "vllm_xargs": {DUMMY_LOGITPROC_ARG: "invalid_target_token_value"}
        },
    }

    with pytest.raises(openai.OpenAIError) as exc_info:
        await client.completions.create(
            model=model_name,
            prompt=prompt,
            **request_keyword_args,
        )

    assert "is not int" in str(exc_info.value)
