"""Server options (the engine's are EngineConfig); `tokenloom serve --help` documents each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless --host says otherwise
    port: int = 8000
    api_key: str | list[str] | None = None  # any of several keys will do (vLLM's --api-key k1 k2)
    served_model_names: list[str] | None = None  # None: the model's name
    max_waiting_requests: int | None = 1024  # None: unbounded
    max_request_body_bytes: int = 4 << 20
    shutdown_grace_s: float = 30.0
    uvicorn_log_level: str = "info"
    access_log: bool = True
    engine_ready_timeout_s: float | None = None  # None: $TOKENLOOM_ENGINE_READY_TIMEOUT (a stall, not the load)
    root_path: str = ""  # behind a path-based proxy (vLLM's --root-path)
    enable_force_include_usage: bool = False  # usage on every stream, as if stream_options asked for it
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details (cached_tokens), vLLM's flag
    enable_request_id_headers: bool = False  # X-Request-Id on every response (vLLM's middleware)
    # CORS, vLLM's flags and defaults: no cross-origin browser access unless origins are listed.
    allowed_origins: list[str] = field(default_factory=list)
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template)
    metrics_prefix: str = "both"  # "vllm", "tokenloom" or "both": the prefix of the Prometheus names
    max_logprobs: int = 20  # cap on logprobs / top_logprobs / prompt_logprobs (-1: none, and -1 = all tokens)
    # Exit (code 1) when the engine process dies, as vLLM does; True keeps answering 503 instead.
    keep_alive_on_engine_death: bool = False
    # Tool calling (vLLM's flags): tool_choice other than "none" needs both of the first two.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in tokenloom.server.tool_parsers.TOOL_PARSERS
    tool_strict_level: str = "auto"  # "auto" | "function" | "parameter" (vLLM's --tool-strict-level)
    exclude_tools_when_tool_choice_none: bool = False
    # A request's own chat_template (a Jinja program) is refused unless this is set (vLLM's flag).
    trust_request_chat_template: bool = False
    # --lora-modules (tokenloom/server/serving_models.py LoRAModulePath): adapters served from the start.
    lora_modules: list[Any] = field(default_factory=list)

    def usage_details(self, endpoint: str, use_beam_search: bool | None) -> str | None:
        """UsageCounter's `details` for "completion" or "chat": None unless --enable-prompt-tokens-details,
        and None under beam search (vLLM's beam-search outputs carry no cache counts)."""
        return endpoint if self.enable_prompt_tokens_details and not use_beam_search else None

    def validate_tools(self) -> None:
        """vLLM's start-up checks of the tool flags (its messages)."""
        from tokenloom.server.tool_parsers import get_tool_parser

        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("Error: --enable-auto-tool-choice requires --tool-call-parser")
        if self.enable_auto_tool_choice:
            try:
                get_tool_parser(self.tool_call_parser or "")
            except KeyError as exc:
                raise ValueError(exc.args[0]) from None
        if self.tool_strict_level not in ("auto", "function", "parameter"):
            raise ValueError(f"Unknown tool strict level {self.tool_strict_level!r}; expected one of "
                             "auto, function, parameter.")
