"""Running the server: engine process first, then uvicorn; on SIGINT/SIGTERM a graceful drain.

Shutdown, in order: stop accepting (uvicorn closes the socket, new requests on open connections get
503), let requests in flight finish for `shutdown_grace_s`, then cut the rest (finish_reason "abort"
and an SSE error event), and once every response is out stop the engine process (lifespan exit).
The engine process also exits by itself when this process dies (EOF on its pipe), so none is orphaned.

Should the engine process die instead, every request in flight fails at once (503, or an SSE error
event), /health answers 503, and ENGINE_DEATH_LINGER_S later the server exits with code 1, as vLLM's
does: a supervisor (systemd, Kubernetes) restarts the whole server, which is the only way to get
back a consistent KV cache and a model that loaded cleanly. `--keep-alive-on-engine-death` keeps
answering 503 instead (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), for whoever watches /health.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import threading
import time
from types import FrameType

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.engine.clients import make_client
from tokenloom.server.config import ServerConfig
from tokenloom.server.listen import bind_socket

logger = logging.getLogger("tokenloom.server")


def http_keep_alive_s() -> float:
    """$TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE, else vLLM's $VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else 5 s (vLLM's)."""
    return envs.TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE


def _interrupt(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_server(engine_config: EngineConfig, config: ServerConfig, sock: socket.socket | None = None) -> int:
    """Serve until stopped; `sock`: the address, bound already (tokenloom/server/listen.py), else bound here
    before the model loads."""
    t_launch = time.perf_counter()
    keep_alive_s = http_keep_alive_s()  # a bad value fails here, before the model loads
    # vLLM's periodic stats line, on unless --disable-log-stats (a bad interval also fails here).
    log_stats_interval_s = None if engine_config.disable_log_stats else envs.TOKENLOOM_LOG_STATS_INTERVAL
    if sock is None:
        sock = bind_socket(config.host, config.port)
    log_level = "DEBUG" if config.uvicorn_log_level == "trace" else config.uvicorn_log_level.upper()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(config.host):
        logger.warning("binding %s: the server is reachable beyond this machine%s", config.host,
                       "" if config.api_key else " and has no --api-key")
    # Until uvicorn takes over the signals, SIGTERM unwinds like Ctrl-C, so the engine process is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    # Spawn the engine(s) first: they load the model while this process imports the HTTP side and loads
    # the tokenizer (never torch: tests/test_startup.py).
    reasoning_parser = _reasoning_parser(engine_config)
    # Spawned, not forked from a forkserver: this process starts its engines once, all at once, so a
    # forkserver would save nothing, and a spawned engine stays the server's own child (engine/process_start.py).
    client = make_client(engine_config, log_level, start_method="spawn")
    try:
        # The HTTP side's imports (FastAPI, uvicorn, pydantic models: ~1 s on a busy machine) after the
        # spawn, so they overlap the engine's load instead of delaying it.
        import uvicorn

        from tokenloom.engine.async_llm import AsyncLLM
        from tokenloom.server.app import build_app
        from tokenloom.server.graceful import GracefulServer
        from tokenloom.server.tool_parsers import check_tokenizer

        engine = AsyncLLM.from_client(client, engine_config.tokenizer_source, config.max_waiting_requests,
                                      config.engine_ready_timeout_s,
                                      skip_tokenizer_init=engine_config.skip_tokenizer_init,
                                      stream_interval=engine_config.stream_interval)
        if config.enable_auto_tool_choice and config.tool_call_parser:
            # vLLM's start-up check: a parser whose format needs a token the vocabulary lacks stops here.
            check_tokenizer(config.tool_call_parser, engine.tokenizer, engine.info.model_name)
        app = build_app(engine, config, log_stats_interval_s, reasoning_parser)
        uv_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
            access_log=config.access_log, lifespan="on",
            # A backstop: the drain cuts requests at the grace period, uvicorn only if that fails.
            timeout_graceful_shutdown=config.shutdown_grace_s + 5,
            # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5 s): how long an idle keep-alive connection
            # stays open. A client whose own idle expiry is not below it can send a request on a
            # connection the server is closing at that moment (httpx's default expiry is also 5 s).
            timeout_keep_alive=keep_alive_s,
        )
        server = GracefulServer(uv_config, engine, config.shutdown_grace_s, t_launch,
                                config.keep_alive_on_engine_death)
        # uvicorn re-raises the signal that stopped it once it is done; by then the drain has happened.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, f: None)
        _warm_grammar_checks()
        asyncio.run(server.serve(sockets=[sock]))
        return 0 if server.started and not server.engine_died else 1
    finally:
        client.shutdown()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _reasoning_parser(engine_config: EngineConfig) -> str:
    """The engine's --reasoning-parser, which the chat and Responses endpoints parse answers with; its plugin is
    imported in this process too (the engine processes import it for their grammar gate)."""
    so = engine_config.structured_outputs_config
    if so is None or not so.reasoning_parser:
        return ""
    from tokenloom.reasoning import resolve_reasoning_parser

    resolve_reasoning_parser(so.reasoning_parser, so.reasoning_parser_plugin)
    return so.reasoning_parser


def _warm_grammar_checks() -> threading.Thread:
    """Import what checks a structured-output request (tokenloom/model/grammar.py: xgrammar, which imports
    torch, and jsonschema; 1.5-3 s of CPU) in a background thread once the server is ready, so the first
    constrained request does not pay for it on the event loop (an import holds the GIL, and every stream's
    tokens pass through that loop). Not before ready: on a small machine it would compete with the engine's
    model load for the cores, and start-up would wait for both."""

    def warm() -> None:
        try:
            import jsonschema  # noqa: F401

            import tokenloom.model.grammar  # noqa: F401
        except ImportError:  # the request that needs them gets the error
            pass

    thread = threading.Thread(target=warm, name="warm-grammar-imports", daemon=True)
    thread.start()
    return thread
