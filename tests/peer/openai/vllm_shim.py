"""Plumbing that lets vLLM 0.32.0's OpenAI-server tests (tests/entrypoints/openai) run against `tokenloom serve`:
vLLM's test helpers' names and constructor shapes over tokenloom's, never behaviour. Anything a test asserts is
tokenloom's own answer.

    RemoteOpenAIServer    vLLM's tests/utils.py server: `tokenloom serve` of the default model
                          (SmolLM2-135M-Instruct) under every model name the vendored files use (the Hub is out
                          of reach), with vLLM's flags as tokenloom's. Servers whose flags agree once vLLM's GPU
                          knobs are dropped are one server, started on first use and stopped after the directory's tests
                          (conftest.py), so that the files share it
    get_tokenizer         the default model's tokenizer (transformers')
    ModelConfig           vLLM's ModelConfig as the tests read it (get_vocab_size): the default model's config
    hf_api                vLLM's Hub client for the LoRA fixtures: no download; the adapters' flags are dropped and
                          the cases naming an adapter skipped (conftest.py)
    download_weights_from_hf   the model's name (every name is the default model here)
    ChatCompletionRequest, BatchChatCompletionRequest, CompletionRequest, SamplingParams, VLLMValidationError:
                          tokenloom's request models, SamplingParams and APIError (a 400 in vLLM's words), for the
                          files' module-level imports; the cases that drive vLLM's request internals
                          (to_sampling_params, build_chat_params) are skipped in conftest.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import openai

from tests.peer.remote_openai import RemoteOpenAIClients
from tests.test_server_harness import ServerProcess
from tokenloom.sampling_params import SamplingParams  # noqa: F401  (vLLM's name)
from tokenloom.server.errors import APIError as VLLMValidationError  # noqa: F401  (a 400 in vLLM's words)
from tokenloom.server.protocol import (  # noqa: F401
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,  # noqa: F401
)

LOG_DIR: Path | None = None  # where the servers' logs go (conftest.py)

# Every model name the vendored files serve or ask for: one server answers to all of them (vLLM's
# --served-model-name takes several; a response names the model the request asked for).
MODEL_NAMES = (
    "HuggingFaceH4/zephyr-7b-beta",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2-1.5B-Instruct",
    "Qwen/Qwen3-0.6B",
    "facebook/opt-125m",
    "openai-community/gpt2",
)

# vLLM's flags with nothing to do on tokenloom's CPU server or its default model: dtype and the model length
# (the model's own), eager mode, the batch width, GPU memory, the port (the harness picks one), the LoRA
# adapters downloaded from the Hub (skipped, see hf_api), and --load-format dummy (random weights; tokenloom
# loads the model's own, which the token-in-token-out case never reads the text of).
_DROPPED_WITH_VALUE = {"--dtype", "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization", "--port",
                       "--lora-modules", "--max-lora-rank", "--max-cpu-loras", "--load-format"}
_DROPPED = {"--enforce-eager", "--enable-lora"}

# Flags that change nothing for a request not asking for what they enable: a server started with all of them
# stands in for any whose flags are a subset (one server for most of the directory).
SHARED_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--root-path", "/llm",
                "--enable-prompt-tokens-details", "--no-enable-prefix-caching")

_servers: dict[tuple[str, ...], ServerProcess] = {}
_clients: list[openai.AsyncOpenAI] = []


def translate_args(vllm_serve_args: list[str]) -> list[str]:
    """vLLM's `vllm serve` flags as tokenloom's, the dropped ones left out."""
    out: list[str] = []
    args = [str(a) for a in vllm_serve_args]
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in _DROPPED_WITH_VALUE:
            i += 1 if "=" in arg else 2
            continue
        if name not in _DROPPED:
            out.append(arg)
        i += 1
    return out


def _key(args: list[str]) -> tuple[str, ...]:
    if set(args) <= set(SHARED_FLAGS):
        return SHARED_FLAGS
    return tuple(args)


def stop_all() -> None:
    while _servers:
        _, server = _servers.popitem()
        server.stop()


class RemoteOpenAIServer(RemoteOpenAIClients):
    """vLLM's tests/utils.py RemoteOpenAIServer over `tokenloom serve` of the default model, shared between the
    files whose flags agree (see SHARED_FLAGS): leaving the `with` block leaves it running for the next file."""

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 **unused: Any) -> None:
        del model  # every name is the default model (MODEL_NAMES)
        flags = _key(translate_args(vllm_serve_args))
        # a server with its own environment (what the test sets beyond this process's) is its own
        env = {k: v for k, v in (env_dict or {}).items() if os.environ.get(k) != v}
        key = (*flags, *sorted(f"{k}={v}" for k, v in env.items()))
        server = _servers.get(key)
        if server is None:
            log = Path(LOG_DIR or ".") / f"server-{len(_servers)}.log"
            server = ServerProcess("--served-model-name", *MODEL_NAMES, *flags, log_path=log,
                                   env=env or None)
            server.start()
            _servers[key] = server
        self.server = server

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        client = super().get_async_client(**kwargs)
        # Held to the session's end: a client a test never closes (test_vllm_prompt_validation.py's) would else
        # be collected, and close its connections, in a later test's event loop ("Event loop is closed" there).
        _clients.append(client)
        return client

    def __exit__(self, *exc: object) -> None:
        pass  # stopped by stop_all after the directory's tests (conftest.py's package fixture)


def _default_model_path() -> Path:
    from tokenloom.model.paths import resolve_model_path

    return resolve_model_path(None)


def get_tokenizer(tokenizer_name: str = "", **kwargs: Any) -> Any:
    """The default model's tokenizer, whatever name a test gives (transformers', as vLLM's get_tokenizer)."""
    del tokenizer_name
    from transformers import AutoTokenizer

    from tokenloom.model.paths import default_cache_dir
    from tokenloom.model.tokenizer import _gguf_cache_entry, load_tokenizer

    path = _default_model_path()
    if path.is_file():  # a GGUF: its tokenizer as tokenloom converted and cached it (done here if not yet)
        load_tokenizer(path)
        path = _gguf_cache_entry(path, default_cache_dir())
    kwargs.pop("tokenizer_mode", None)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)


class ModelConfig:
    """vLLM's ModelConfig as test_chat_echo.py and test_chat_logit_bias_validation.py read it: the default
    model's vocabulary size."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        del model, kwargs
        from tokenloom.model.loader import load_model_config

        self._vocab_size = load_model_config(_default_model_path()).vocab_size

    def get_vocab_size(self) -> int:
        return self._vocab_size


class _NoHub:
    def snapshot_download(self, repo_id: str, **kwargs: Any) -> str:
        del kwargs
        return f"<{repo_id}: not downloaded>"  # the adapter's flags are dropped (translate_args)


def hf_api() -> _NoHub:
    return _NoHub()


def download_weights_from_hf(model_name: str, **kwargs: Any) -> str:
    del kwargs
    return model_name
