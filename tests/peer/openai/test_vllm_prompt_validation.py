# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's
# tests/entrypoints/openai/completion/test_prompt_validation.py (the 0.32.0 sdist from PyPI),
# unchanged but for the plumbing: vLLM's helpers (RemoteOpenAIServer, get_tokenizer, ...) come from tests/peer/openai/
# vllm_shim.py, which serves the default model (SmolLM2-135M-Instruct) under every name the file uses (the
# Hub is out of reach); pytest-asyncio's marker is anyio's (the plugin this repository runs), its fixture
# decorator pytest's. Skips and xfails, with their reasons: conftest.py.
# Not vendored: the prompt-embeds cases (test_load_prompt_embeds, test_disable_prompt_embeds), unit tests of
# vLLM's safe_load_prompt_embeds (tokenloom takes no prompt_embeds).

# imports for structured outputs tests
import openai
import pytest
import regex as re

from tests.peer.openai.vllm_shim import RemoteOpenAIServer


@pytest.mark.anyio
async def test_empty_prompt():
    model_name = "openai-community/gpt2"
    server_args = ["--enforce-eager"]
    with RemoteOpenAIServer(model_name, server_args) as remote_server:
        client = remote_server.get_async_client()

        with pytest.raises(
            openai.BadRequestError,
            match="Either prompt or prompt_embeds must be provided and non-empty.",
        ):
            await client.completions.create(
                model=model_name,
                prompt=None,
                max_tokens=5,
                temperature=0.0,
                extra_body={"prompt_embeds": []},
            )


@pytest.mark.anyio
async def test_out_of_vocab_token_ids():
    model_name = "openai-community/gpt2"
    server_args = ["--enforce-eager"]
    with RemoteOpenAIServer(model_name, server_args) as remote_server:
        client = remote_server.get_async_client()

        with pytest.raises(
            openai.BadRequestError, match=re.compile(".*out of vocabulary.*").pattern
        ):
            await client.completions.create(
                model=model_name, prompt=[999999], max_tokens=5, temperature=0.0
            )
