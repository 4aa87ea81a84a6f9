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
import time
from types import FrameType

import uvicorn

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.dp_client import make_engine_client
from tokenloom.server.app import build_app
from tokenloom.server.config import ServerConfig
from tokenloom.server.listen import bind_socket
from tokenloom.server.tool_parsers import check_tokenizer

logger = logging.getLogger("tokenloom.server")

# Between the engine's death and the exit: long enough for the in-flight requests' 503s to be written
# and for a probe to read /health's 503, short enough that a supervisor restarts the server promptly.
ENGINE_DEATH_LINGER_S = 1.0


def http_keep_alive_s() -> float:
    """$TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE, else vLLM's $VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else 5 s (vLLM's)."""
    return envs.TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace_s: float, t_launch: float,
                 keep_alive_on_engine_death: bool = False) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.t_launch = t_launch
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.engine_died = False
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.failure_listeners.append(self._on_engine_death)

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            info = self.engine.info
            logger.info("tokenloom serve ready on %s in %.1f s (engine loaded in %.1f s): %s, %s on %s, "
                        "max_model_len %d, %d KV blocks of %d tokens", self._url(),
                        time.perf_counter() - self.t_launch,
                        info.load_time_s, info.model_name,
                        info.dtype + (f" + {info.quantization} layers" if info.quantization else ""),
                        info.device, info.max_model_len,
                        info.num_blocks, info.block_size)

    def _url(self) -> str:
        host = self.config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.config.port}"

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain)
        super().handle_exit(sig, frame)

    def _on_engine_death(self, message: str) -> None:
        """On the event loop, after AsyncLLM failed every request in flight."""
        if self.keep_alive_on_engine_death:
            logger.critical("the engine process died; answering 503 until stopped (--keep-alive-on-engine-death)")
            return
        self.engine_died = True
        logger.critical("the engine process died; the server exits with code 1 in %.0f s", ENGINE_DEATH_LINGER_S)
        asyncio.get_running_loop().call_later(ENGINE_DEATH_LINGER_S, self._exit_after_engine_death)

    def _exit_after_engine_death(self) -> None:
        self.should_exit = True

    def _begin_drain(self) -> None:
        self.engine.stop_accepting()
        n = self.engine.num_unfinished
        if n:
            logger.info("shutting down: %d requests in flight get %.0f s to finish", n, self.grace_s)
            assert self._loop is not None
            self._loop.call_later(self.grace_s, self.engine.abort_all,
                                  f"the server shut down; the request was cut after a {self.grace_s:g} s grace period")


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
    if sock is None:
        sock = bind_socket(config.host, config.port)
    log_level = "DEBUG" if config.uvicorn_log_level == "trace" else config.uvicorn_log_level.upper()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(config.host):
        logger.warning("binding %s: the server is reachable beyond this machine%s", config.host,
                       "" if config.api_key else " and has no --api-key")
    # Until uvicorn takes over the signals, SIGTERM unwinds like Ctrl-C, so the engine process is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    # Spawn the engine(s) first: they load the model while this process loads torch and the tokenizer.
    client = make_engine_client(engine_config, log_level)
    _import_grammar_checks()
    try:
        engine = AsyncLLM.from_client(client, engine_config.model, config.max_waiting_requests,
                                      config.engine_ready_timeout_s)
        if config.enable_auto_tool_choice and config.tool_call_parser:
            # vLLM's start-up check: a parser whose format needs a token the vocabulary lacks stops here.
            check_tokenizer(config.tool_call_parser, engine.tokenizer, engine.info.model_name)
        app = build_app(engine, config)
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
        asyncio.run(server.serve(sockets=[sock]))
        return 0 if server.started and not server.engine_died else 1
    finally:
        client.shutdown()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _import_grammar_checks() -> None:
    """Import what checks a structured-output request (xgrammar, jsonschema: ~0.4 s) while the engine
    loads its model, not when the first constrained request arrives: an import holds the GIL, and
    in this process every stream's tokens pass through the event loop."""
    try:
        import jsonschema  # noqa: F401
        import xgrammar  # noqa: F401
    except ImportError:  # the request that needs them gets the error
        pass
