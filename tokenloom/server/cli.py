"""`tokenloom serve [MODEL] [engine options] [server options]`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import sys

from tokenloom import envs
from tokenloom.engine.args import add_engine_args, cli_type, engine_config_from_args, parse_bytes


def _json_strings(text: str) -> list[str]:
    """vLLM's CORS flags take a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {text!r} ({exc.msg}); expected a list such as '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (like `vllm serve`)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics, /version, /tokenize, /detokenize.")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes the server to the network)")
    g.add_argument("--port", type=int, default=8000)
    env_key = envs.TOKENLOOM_API_KEY
    g.add_argument("--api-key", nargs="+", default=[env_key] if env_key else None,
                   help="require 'Authorization: Bearer KEY', one of these keys (except /health, /metrics, /version, "
                        "/ping, /load); default $TOKENLOOM_API_KEY, else $VLLM_API_KEY")
    g.add_argument("--allowed-origins", type=cli_type(_json_strings), default=[],
                   help="CORS: origins a browser may call from, a JSON list, e.g. '[\"http://localhost:3000\"]' "
                        "or '[\"*\"]' (vLLM's flag; default none: no cross-origin access)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (vLLM's flag)")
    g.add_argument("--allowed-methods", type=cli_type(_json_strings), default=["*"],
                   help="CORS: allowed methods, a JSON list (default [\"*\"])")
    g.add_argument("--allowed-headers", type=cli_type(_json_strings), default=["*"],
                   help="CORS: allowed request headers, a JSON list (default [\"*\"])")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model's name)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="answer 429 while this many requests wait to be scheduled (0: no limit)")
    g.add_argument("--max-request-body-bytes", type=cli_type(parse_bytes), default=4 << 20,
                   help="answer 413 to larger request bodies, e.g. 4MiB")
    g.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are cut")
    g.add_argument("--keep-alive-on-engine-death", action="store_true",
                   default=envs.TOKENLOOM_KEEP_ALIVE_ON_ENGINE_DEATH,
                   help="when the engine process dies, keep answering 503 instead of exiting with code 1 "
                        "(vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH); default $TOKENLOOM_KEEP_ALIVE_ON_ENGINE_DEATH")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--root-path", default="", help="serve under this path prefix too (behind a proxy), e.g. /llm")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="usage on every streamed chunk and at the end, as if stream_options asked for it")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details: cached_tokens (prefix-cache hit) and, in chat, "
                        "created_cache_tokens (vLLM's flag; off: null)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (it exposes the chat template)")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="accepted for vLLM compatibility: GET /load is always served")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="an X-Request-Id header on every response: the request's own, else a fresh id "
                        "(vLLM's flag; off: none)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's option); "
                        "-1 (or at least the vocabulary) also allows -1, every token")
    g.add_argument("--metrics-prefix", choices=["both", "vllm", "tokenloom"], default="both",
                   help="Prometheus names: vLLM's (vllm:...), tokenloom's (tokenloom:...), or both (default)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools (tool_choice auto, required, a named function); needs "
                        "--tool-call-parser (vLLM's flag: without it those tool_choice values are a 400)")
    g.add_argument("--tool-call-parser", default=None,
                   help="the model family's tool-call format: hermes (Hermes 2 Pro, Qwen 2.5: <tool_call> "
                        "JSON blocks) or its alias qwen3_json; pythonic (Llama 3.2/4: [f(a=1), ...]); "
                        "llama3_json / llama4_json (needs <|python_tag|> in the vocabulary); mistral is "
                        "known and refused")
    g.add_argument("--tool-strict-level", choices=["auto", "function", "parameter"], default="auto",
                   help="grammar floor for tool calls: auto (required / named calls and strict tools "
                        "constrained), function (every call's envelope), parameter (arguments too, as if "
                        "every tool were strict)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="do not show the tools to the chat template when tool_choice is none")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template sent with a request (a Jinja program); refused with 400 otherwise")
    p.set_defaults(func=_serve)
    pd = sub.add_parser("pd-proxy", help="disaggregated prefill/decode proxy in front of two `tokenloom serve`s "
                        "(docs/kv_offload.md)",
                        description="Send each completion to a prefill engine (max_tokens 1, kv_transfer_params "
                                    "do_remote_decode), then with the prefill's kv_transfer_params to a decode engine "
                                    "(vLLM's disaggregated-serving proxy flow).")
    pd.add_argument("--prefill", required=True, help="the prefill engine's base URL (kv_role kv_producer)")
    pd.add_argument("--decode", required=True, help="the decode engine's base URL (kv_role kv_consumer)")
    pd.add_argument("--host", default="127.0.0.1")
    pd.add_argument("--port", type=int, default=8000)
    pd.set_defaults(func=_pd_proxy)


def _serve(args: argparse.Namespace) -> int:
    from tokenloom.server.listen import PortUnavailableError, bind_socket

    # The address first: a port in use fails now, not after the model has loaded.
    try:
        sock = bind_socket(args.host, args.port)
    except PortUnavailableError as exc:
        print(f"tokenloom serve: error: {exc}", file=sys.stderr)
        return 1
    try:
        return _serve_on(args, sock)
    finally:
        sock.close()


def _serve_on(args: argparse.Namespace, sock) -> int:
    from tokenloom.engine.core_client import EngineStartError
    from tokenloom.server.config import ServerConfig
    from tokenloom.server.launcher import run_server
    from tokenloom.server.tool_parsers import ToolParserTokenizerError

    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or None, served_model_names=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests or None, max_request_body_bytes=args.max_request_body_bytes,
        shutdown_grace_s=args.shutdown_grace_period, uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log, root_path=args.root_path,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_request_id_headers=args.enable_request_id_headers,
        allowed_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers, metrics_prefix=args.metrics_prefix,
        max_logprobs=args.max_logprobs,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        tool_strict_level=args.tool_strict_level,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    try:
        config.validate_tools()
    except ValueError as exc:
        print(f"tokenloom serve: {exc}", file=sys.stderr)
        return 1
    try:
        return run_server(engine_config_from_args(args), config, sock)
    except (EngineStartError, ToolParserTokenizerError) as exc:
        print(f"tokenloom serve: error: {exc}", file=sys.stderr)
        return 1


def _pd_proxy(args: argparse.Namespace) -> None:
    from tokenloom.server.pd_proxy import run

    run(args.prefill, args.decode, args.host, args.port)
