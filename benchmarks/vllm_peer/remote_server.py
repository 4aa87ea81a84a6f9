"""A stand-in for vLLM's `tests.utils.RemoteOpenAIServer` that launches `tokenloom serve` instead.

Plumbing only: vLLM's interface (constructor, url_root, url_for, get_client, get_async_client, context
manager), vLLM's serve flags translated to tokenloom's (flags for machinery tokenloom lacks are dropped
and listed in the server log), and the model name: tokenloom serves its own model (`TOKENLOOM_PEER_MODEL`,
default: the default model) under the name the test asks for, so the test's `model=` matches. With the
model goes its context: a `--max-model-len` above the served model's (vLLM's CI models: Qwen3's 18192 on
SmolLM2's 8192) is lowered to it and logged, as the test's model name is replaced by the served one.
vLLM's underscore spellings of flags (`--max_model_len`, which vLLM's parser accepts) are read as dashes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

# vLLM flags with a tokenloom equivalent (same name) and how many values they take.
_KEEP = {"--max-model-len": 1, "--max-num-seqs": 1, "--max-num-batched-tokens": 1, "--seed": 1,
         "--served-model-name": -1, "--api-key": 1, "--root-path": 1, "--enable-force-include-usage": 0,
         "--enable-tokenizer-info-endpoint": 0, "--enable-server-load-tracking": 0,
         "--enable-request-id-headers": 0, "--enable-prefix-caching": 0, "--no-enable-prefix-caching": 0,
         "--enable-chunked-prefill": 0, "--no-enable-chunked-prefill": 0, "--long-prefill-token-threshold": 1,
         "--scheduling-policy": 1, "--block-size": 1, "--max-logprobs": 1, "--enable-prompt-tokens-details": 0,
         "--enable-auto-tool-choice": 0, "--tool-call-parser": 1, "--tool-strict-level": 1,
         "--exclude-tools-when-tool-choice-none": 0, "--allowed-origins": 1, "--allow-credentials": 0,
         "--allowed-methods": 1, "--allowed-headers": 1, "--logits-processors": -1}
# Flags that take a value, tokenloom has no use for (GPU memory, kernels, parsers, LoRA, ...).
_DROP_WITH_VALUE = {"--dtype", "--gpu-memory-utilization", "--tokenizer-mode", "--load-format",
                    "--chat-template", "--reasoning-parser", "--lora-modules",
                    "--max-lora-rank", "--max-loras", "--max-cpu-loras", "--tensor-parallel-size", "-tp",
                    "--pipeline-parallel-size", "--kv-cache-dtype", "--quantization", "--hf-overrides",
                    "--override-generation-config", "--generation-config", "--limit-mm-per-prompt",
                    "--mm-processor-kwargs", "--tokenizer", "--revision", "--code-revision", "--logprobs-mode",
                    "--structured-outputs-config", "--speculative-config", "--compilation-config",
                    "--default-chat-template-kwargs", "--response-role", "--uvicorn-log-level",
                    "--max-num-partial-prefills", "--swap-space", "--cpu-offload-gb", "--middleware",
                    "--return-tokens-as-token-ids", "--disable-log-stats"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_context() -> int | None:
    """The context length of the model the stand-in serves (None if it cannot be read)."""
    try:
        from tokenloom.model.paths import resolve_model_path

        path = resolve_model_path(os.environ.get("TOKENLOOM_PEER_MODEL"))
        if path.is_file():
            from tokenloom.model.gguf import config_from_gguf, read_gguf

            return config_from_gguf(read_gguf(path)).max_position_embeddings
        return json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except Exception:  # plumbing only: without it the test's value goes through unchanged
        return None


def translate_args(model: str, vllm_args: list[str], context: int | None = None) -> tuple[list[str], list[str]]:
    """(tokenloom serve arguments, vLLM flags dropped or changed). `context`: the served model's context
    length, to which a larger --max-model-len is lowered."""
    out: list[str] = []
    dropped: list[str] = []
    served = False
    i = 0
    while i < len(vllm_args):
        arg = vllm_args[i]
        name, _, inline = arg.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
            arg = f"{name}={inline}" if inline else name
        if name == "--max-model-len" and context is not None:
            value = inline or (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
            if value.isdigit() and int(value) > context:
                out += [name, str(context)]
                dropped.append(f"{name} {value} (> the served model's context; {context})")
                i += 1 if inline else 2
                continue
        if name in _KEEP:
            n = _KEEP[name]
            served |= name == "--served-model-name"
            if inline:
                out.append(arg)
                i += 1
                continue
            out.append(name)
            i += 1
            if n == -1:  # a list of values up to the next flag
                while i < len(vllm_args) and not vllm_args[i].startswith("-"):
                    out.append(vllm_args[i])
                    i += 1
            else:
                out.extend(vllm_args[i:i + n])
                i += n
            continue
        dropped.append(arg)
        i += 1
        if name in _DROP_WITH_VALUE and not inline and i < len(vllm_args) and not vllm_args[i].startswith("--"):
            dropped.append(vllm_args[i])
            i += 1
    if not served:
        out += ["--served-model-name", model]
    return out, dropped


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 **unused: object) -> None:
        self.host = "127.0.0.1"
        self.port = _free_port()
        args, self.dropped = translate_args(model, list(vllm_serve_args), served_context())
        env = os.environ.copy()
        env.update(env_dict or {})
        repo = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"
        peer_model = os.environ.get("TOKENLOOM_PEER_MODEL")
        cmd = [sys.executable, "-m", "tokenloom.cli", "serve", *([peer_model] if peer_model else []), *args,
               "--host", self.host, "--port", str(self.port), "--uvicorn-log-level", "warning",
               *(["--seed", str(seed)] if seed is not None and "--seed" not in args else [])]
        log_dir = Path(os.environ.get("TOKENLOOM_PEER_LOGS") or tempfile.gettempdir())
        self.log_path = log_dir / f"tokenloom-peer-{self.port}.log"
        self.log = self.log_path.open("w")
        self.log.write(f"# {' '.join(cmd)}\n# vLLM flags dropped: {self.dropped}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_for_server(max_wait_seconds or 240)

    def _wait_for_server(self, timeout: float) -> None:
        start = time.time()
        while True:
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"Server exited unexpectedly (log: {self.log_path}).")
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.5)

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)
