"""`tokenloom serve [MODEL] [engine options] [server options]`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

from tokenloom import envs
from tokenloom.engine.args import add_engine_arg, add_engine_args, engine_config_from_args
from tokenloom.server.config import server_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (like `vllm serve`)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/responses, /v1/embeddings, /v1/models, /health, /metrics, /version, "
                                   "/tokenize, /detokenize.")
    add_engine_args(p)
    # The server's flags come from ServerConfig's knob fields (server/config.py), as the engine's come
    # from the engine configs: help, type, choices and default live with the field.
    g = p.add_argument_group("server")
    for a in server_args():
        add_engine_arg(g, a, field_default=True)
    # Defaults read from the environment at start-up (vLLM's variables in envs.py), not at import.
    env_key = envs.TOKENLOOM_API_KEY
    p.set_defaults(func=_serve, api_key=[env_key] if env_key else None,
                   keep_alive_on_engine_death=envs.TOKENLOOM_KEEP_ALIVE_ON_ENGINE_DEATH)
    _register_pd_proxy(sub)


def _register_pd_proxy(sub: argparse._SubParsersAction) -> None:
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
    from tokenloom.engine.exceptions import EngineStartError
    from tokenloom.server.config import ServerConfig
    from tokenloom.server.launcher import run_server
    from tokenloom.server.tool_parsers import ToolParserTokenizerError

    config = ServerConfig(**{a.field: getattr(args, a.name) for a in server_args()})
    try:
        config.validate_tools()
        if args.enable_auto_tool_choice and args.skip_tokenizer_init:
            raise ValueError("--enable-auto-tool-choice parses tool calls from the generated text, which "
                             "--skip-tokenizer-init does not make: use one or the other")
        _check_reasoning_parser(args)
    except (KeyError, ValueError) as exc:
        print(f"tokenloom serve: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 1
    try:
        return run_server(engine_config_from_args(args), config, sock)
    except (EngineStartError, ToolParserTokenizerError) as exc:
        print(f"tokenloom serve: error: {exc}", file=sys.stderr)
        return 1


def _check_reasoning_parser(args: argparse.Namespace) -> None:
    """vLLM's validate_api_server_args: an unknown --reasoning-parser stops `serve` before anything loads, in its
    words ("invalid reasoning parser: X (chose from { ... })"), its plugin imported first."""
    if not args.reasoning_parser:
        return
    from tokenloom.reasoning import resolve_reasoning_parser

    resolve_reasoning_parser(args.reasoning_parser, args.reasoning_parser_plugin or "")


def _pd_proxy(args: argparse.Namespace) -> None:
    from tokenloom.server.pd_proxy import run

    run(args.prefill, args.decode, args.host, args.port)
