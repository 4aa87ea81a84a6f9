"""The uvicorn server `tokenloom serve` runs: the ready line, the drain on SIGINT/SIGTERM, the exit after
the engine's death (tokenloom/server/launcher.py describes the whole sequence). Its own module so that
the launcher can spawn the engine before importing uvicorn and FastAPI."""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from tokenloom.engine.async_llm import AsyncLLM

logger = logging.getLogger("tokenloom.server")

# Between the engine's death and the exit: long enough for the in-flight requests' 503s to be written
# and for a probe to read /health's 503, short enough that a supervisor restarts the server promptly.
ENGINE_DEATH_LINGER_S = 1.0


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
                        "max_model_len %d, %d KV blocks of %d tokens%s", self._url(),
                        time.perf_counter() - self.t_launch,
                        info.load_time_s, info.model_name,
                        info.dtype + (f" + {info.quantization} layers" if info.quantization else ""),
                        info.device, info.max_model_len,
                        info.num_blocks, info.block_size,
                        f" ({info.kv_cache_dtype})" if info.kv_cache_dtype else "")

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
