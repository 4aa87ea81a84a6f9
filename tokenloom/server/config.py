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
    # Exit (code 1) when the engine process dies, as vLLM does; True keeps answering 503 instead.
    keep_alive_on_engine_death: bool = False
