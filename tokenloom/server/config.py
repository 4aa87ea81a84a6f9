"""Server options (the engine's are EngineConfig); `tokenloom serve --help` documents each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenloom.config import ConfigError, EngineArg, knob, knobs_of, parse_bytes
from tokenloom.server.lora_modules import LoRAModulePath, parse_lora_module


def _json_strings(text: str) -> list[str]:
    """vLLM's CORS flags take a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {text!r} ({exc.msg}); expected a list such as '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return value


UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


def load_chat_template(value: str | None) -> str | None:
    """vLLM's load_chat_template: a file's text, or the value itself when it reads as Jinja ({, } or a newline);
    a path-like value that names no file is refused."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except OSError:
        if not any(c in value for c in "{}\n"):
            raise ConfigError(f"The supplied chat template string ({value}) appears path-like, but doesn't "
                              "exist!") from None
        return value


@dataclass
class ServerConfig:
    """The server's options. Each `knob(...)` field is a `tokenloom serve` flag (server/cli.py derives the
    flags from these fields, as engine/args.py does for the engine's): a new option needs no CLI edit."""

    host: str = knob("127.0.0.1", "address to bind (default loopback; 0.0.0.0 exposes the server to the network)")
    port: int = knob(8000, "port to listen on")
    # Any of several keys will do (vLLM's --api-key k1 k2); the CLI's default is $TOKENLOOM_API_KEY.
    api_key: str | list[str] | None = knob(
        None, "require 'Authorization: Bearer KEY', one of these keys (except /health, /metrics, /version, "
              "/ping, /load); default $TOKENLOOM_API_KEY, else $VLLM_API_KEY", nargs="+", parse=str)
    served_model_names: list[str] | None = knob(
        None, "name(s) clients use in 'model' (default: the model's name)", arg="served_model_name", nargs="+",
        parse=str)
    max_waiting_requests: int | None = knob(
        1024, "answer 429 while this many requests wait to be scheduled (0 or None: no limit)")
    max_request_body_bytes: int = knob(4 << 20, "answer 413 to larger request bodies, e.g. 4MiB", parse=parse_bytes)
    shutdown_grace_s: float = knob(
        30.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM before they are cut",
        arg="shutdown_grace_period")
    uvicorn_log_level: UvicornLogLevel = knob("info", "uvicorn's log level")
    disable_uvicorn_access_log: bool = knob(False, "no access log line per request")
    # A stall, not the load: None reads $TOKENLOOM_ENGINE_READY_TIMEOUT (no flag).
    engine_ready_timeout_s: float | None = None
    root_path: str = knob("", "serve under this path prefix too (behind a proxy), e.g. /llm (vLLM's --root-path)")
    enable_force_include_usage: bool = knob(
        False, "usage on every streamed chunk and at the end, as if stream_options asked for it")
    enable_prompt_tokens_details: bool = knob(
        False, "usage.prompt_tokens_details: cached_tokens (prefix-cache hit) and, in chat, created_cache_tokens "
               "(vLLM's flag; off: null)")
    enable_request_id_headers: bool = knob(
        False, "an X-Request-Id header on every response: the request's own, else a fresh id (vLLM's flag)")
    # CORS, vLLM's flags and defaults: no cross-origin browser access unless origins are listed.
    allowed_origins: list[str] = knob(
        [], "CORS: origins a browser may call from, a JSON list, e.g. '[\"http://localhost:3000\"]' or '[\"*\"]' "
            "(vLLM's flag; default none: no cross-origin access)", parse=_json_strings)
    allow_credentials: bool = knob(False, "CORS: allow credentials (vLLM's flag)")
    allowed_methods: list[str] = knob(["*"], "CORS: allowed methods, a JSON list", parse=_json_strings)
    allowed_headers: list[str] = knob(["*"], "CORS: allowed request headers, a JSON list", parse=_json_strings)
    enable_tokenizer_info_endpoint: bool = knob(
        False, "serve GET /tokenizer_info (it exposes the chat template)")
    enable_server_load_tracking: bool = knob(False, "accepted for vLLM compatibility: GET /load is always served")
    metrics_prefix: Literal["both", "vllm", "tokenloom"] = knob(
        "both", "Prometheus names: vLLM's (vllm:...), tokenloom's (tokenloom:...), or both")
    return_tokens_as_token_ids: bool = knob(
        False, "logprobs name tokens as 'token_id:N' unless a request says otherwise (vLLM's flag; the request's "
               "return_tokens_as_token_ids overrides it)")
    max_logprobs: int = knob(
        20, "the most logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's option); -1 (or at "
            "least the vocabulary) also allows -1, every token")
    # Exit (code 1) when the engine process dies, as vLLM does; True keeps answering 503 instead.
    keep_alive_on_engine_death: bool = knob(
        False, "when the engine process dies, keep answering 503 instead of exiting with code 1 (vLLM's "
               "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH); the CLI's default is $TOKENLOOM_KEEP_ALIVE_ON_ENGINE_DEATH")
    # Tool calling (vLLM's flags): tool_choice other than "none" needs both of the first two.
    enable_auto_tool_choice: bool = knob(
        False, "let the model call tools (tool_choice auto, required, a named function); needs --tool-call-parser "
               "(vLLM's flag: without it those tool_choice values are a 400)")
    tool_call_parser: str | None = knob(
        None, "the model family's tool-call format: hermes (Hermes 2 Pro, Qwen 2.5: <tool_call> JSON blocks) or its "
              "alias qwen3_json; qwen3_coder / qwen3_xml (Qwen3-Coder: <tool_call><function=...> XML); pythonic "
              "(Llama 3.2/4: [f(a=1), ...]); llama3_json / llama4_json (needs <|python_tag|> in the vocabulary); "
              "phi4_mini_json (Phi-4-mini: functools[...]); a name a --tool-parser-plugin registers; mistral is "
              "known and refused")
    tool_parser_plugin: str = knob(
        "", "a Python file (or importable module) of tool parsers written against vLLM's ToolParser, registered "
            "with @ToolParserManager.register_module(name) (from tokenloom.server.tool_parsers import "
            "ToolParser, ToolParserManager); its names become --tool-call-parser choices (vLLM's flag)")
    tool_strict_level: Literal["auto", "function", "parameter"] = knob(
        "auto", "grammar floor for tool calls: auto (required / named calls and strict tools constrained), "
                "function (every call's envelope), parameter (arguments too, as if every tool were strict)")
    exclude_tools_when_tool_choice_none: bool = knob(
        False, "do not show the tools to the chat template when tool_choice is none")
    # vLLM's --chat-template: the template every chat endpoint renders with instead of the tokenizer's own (a
    # file's path, or the Jinja text itself); read once at start-up (load_chat_template).
    chat_template: str | None = knob(
        None, "the chat template to use instead of the model's (a file, or the Jinja template itself)")
    # A request's own chat_template (a Jinja program) is refused unless this is set (vLLM's flag).
    trust_request_chat_template: bool = knob(
        False, "run a chat_template sent with a request (a Jinja program); refused with 400 otherwise")
    # Adapters served from the start (tokenloom/server/serving_models.py); runtime loading adds more.
    lora_modules: list[LoRAModulePath] = knob(
        [], "LoRA adapters to serve (with --enable-lora): name=path, or vLLM's JSON form "
            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's `model` picks one",
        nargs="+", parse=parse_lora_module)

    def __post_init__(self) -> None:
        self.chat_template = load_chat_template(self.chat_template)
        if self.max_waiting_requests == 0:  # the CLI's "no limit"
            self.max_waiting_requests = None
        if isinstance(self.api_key, list) and not self.api_key:
            self.api_key = None

    @property
    def access_log(self) -> bool:
        return not self.disable_uvicorn_access_log

    def usage_details(self, endpoint: str, use_beam_search: bool | None) -> str | None:
        """UsageCounter's `details` for "completion" or "chat": None unless --enable-prompt-tokens-details,
        and None under beam search (vLLM's beam-search outputs carry no cache counts)."""
        return endpoint if self.enable_prompt_tokens_details and not use_beam_search else None

    def validate_tools(self) -> None:
        """vLLM's start-up checks of the tool flags (its messages); a --tool-parser-plugin is imported first,
        so the parsers it registers are known (ValueError when it does not load)."""
        from tokenloom.server.tool_parsers import ToolParserManager, get_tool_parser

        if self.tool_parser_plugin:
            ToolParserManager.import_tool_parser(self.tool_parser_plugin)
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


def server_args() -> list[EngineArg]:
    """The server's options as arguments (the `knob(...)` fields of ServerConfig), in declaration order."""
    return knobs_of(ServerConfig, "server")
