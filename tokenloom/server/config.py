"""Server options (the engine's are EngineConfig); `tokenloom serve --help` documents each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless --host says otherwise
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] | None = None  # None: the model's name
    max_waiting_requests: int | None = 1024  # None: unbounded
    max_request_body_bytes: int = 4 << 20
    shutdown_grace_s: float = 30.0
    uvicorn_log_level: str = "info"
    access_log: bool = True
    engine_ready_timeout_s: float = 600.0
    root_path: str = ""  # behind a path-based proxy (vLLM's --root-path)
    enable_force_include_usage: bool = False  # usage on every stream, as if stream_options asked for it
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template)
    metrics_prefix: str = "both"  # "vllm", "tokenloom" or "both": the prefix of the Prometheus names
    max_logprobs: int = 20  # cap on logprobs / top_logprobs / prompt_logprobs (-1: none, and -1 = all tokens)
    # Exit (code 1) when the engine process dies, as vLLM does; True keeps answering 503 instead.
    keep_alive_on_engine_death: bool = False
