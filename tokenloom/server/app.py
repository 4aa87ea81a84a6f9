"""The FastAPI application: routes, error mapping, API-key check, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenloom import envs
from tokenloom.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    InvalidRequestError,
)
from tokenloom.engine.stat_logging import PerEngineStatLogger
from tokenloom.lora.request import LoRARequest
from tokenloom.server.body import DrainBodyMiddleware, read_json
from tokenloom.server.config import ServerConfig
from tokenloom.server.errors import APIError, error_body, error_response
from tokenloom.server.request_id import RequestIdMiddleware
from tokenloom.server.responses import JSONResponse
from tokenloom.server.serving_batch import create_batch_chat_completion
from tokenloom.server.serving_chat import create_chat_completion
from tokenloom.server.serving_completions import create_completion
from tokenloom.server.serving_pooling import add_pooling_routes, pooling_invocation
from tokenloom.server.serving_responses import cancel_response, create_response, retrieve_response
from tokenloom.server.serving_tokenize import detokenize, tokenize, tokenizer_info
from tokenloom.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

# Paths any client may read, API key or not (probes and scrapers), as in vLLM.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/load"})
# Generation routes counted by GET /load (vLLM's server_load_metrics).
LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
                        "/invocations"})


def build_app(engine: AsyncLLM, config: ServerConfig, log_stats_interval_s: float | None = None,
              reasoning_parser: str = "") -> FastAPI:
    """`log_stats_interval_s`: log vLLM's stats line this often (None: never, --disable-log-stats).
    `reasoning_parser`: the engine's --reasoning-parser, which the chat and Responses endpoints parse with."""
    state = ServerState(engine, config, log_stats=log_stats_interval_s is not None, reasoning_parser=reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.attach()
        stats_task = None
        if state.stat_logger is not None and log_stats_interval_s is not None:
            stats_task = asyncio.create_task(_log_stats_forever(state.stat_logger, log_stats_interval_s))
        try:
            yield
        finally:  # uvicorn gets here after in-flight requests finished (or were cut)
            await state.background.cancel_all()  # background responses have no client to wait for
            if stats_task is not None:
                stats_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_task
            engine.shutdown()
            state.close()

    app = FastAPI(title="tokenloom", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_routes(app)
    _add_error_handlers(app)
    # Always there, as in vLLM: with no allowed origins a browser's preflight is refused (400) and responses
    # carry no Access-Control-Allow-Origin. Inside the API-key check, which lets preflights (OPTIONS) through.
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_credentials=config.allow_credentials,
                       allow_methods=config.allowed_methods, allow_headers=config.allowed_headers)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(LoadMiddleware, state=state)
    app.add_middleware(DrainBodyMiddleware)
    if config.enable_request_id_headers:  # outside the API-key check, as in vLLM: a 401 carries it too
        app.add_middleware(RequestIdMiddleware)
    if config.root_path:
        app.add_middleware(RootPathMiddleware, root_path=config.root_path)
    return app


async def _log_stats_forever(stat_logger: PerEngineStatLogger, interval_s: float) -> None:
    """vLLM's api_server loop: the stats line every `interval_s`. A failure is logged and the loop goes on:
    the log is for people, and must never take serving down."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            stat_logger.log()
        except Exception:
            logger.exception("the periodic stats log failed")


def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions/batch", create_batch_chat_completion, methods=["POST"])
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
    add_pooling_routes(app)

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        # SageMaker's entry point, as in vLLM: the body's shape picks the endpoint.
        state = get_state(raw)
        obj = await read_json(raw, state.config.max_request_body_bytes)
        raw.state.body = obj
        if state.engine.info.pooling is not None:  # vLLM's pooling invocation types, in its order
            return await pooling_invocation(raw, obj)
        if "messages" in obj:
            return await create_chat_completion(raw)
        if "prompt" in obj:
            return await create_completion(raw)
        raise APIError(400, "cannot find a suitable handler for the request: expected a chat request "
                            "(messages) or a completion request (prompt)")

    @app.get("/ping")
    @app.post("/ping")
    async def ping(raw: Request) -> Response:
        return await health(raw)

    @app.get("/load")
    async def load(raw: Request) -> JSONResponse:
        return JSONResponse({"server_load": get_state(raw).server_load})

    @app.get("/v1/models")
    async def list_models(raw: Request) -> JSONResponse:
        state = get_state(raw)
        cards = [_model_card(state, name) for name in state.model_names]
        cards += [_lora_card(state, lora) for lora in state.models.lora_requests.values()]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model:path}")
    async def get_model(raw: Request, model: str) -> JSONResponse:
        state = get_state(raw)
        lora = state.lora_request(model)
        if lora is not None:
            return JSONResponse(_lora_card(state, lora))
        if not state.models.is_served(model):  # a lookup: VLLM_SKIP_MODEL_NAME_VALIDATION does not apply
            raise state.unknown_model(model)
        return JSONResponse(_model_card(state, model))

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        # vLLM registers these only when runtime updating is allowed (a warning-worthy power: any
        # client may then load files from the server's disk as adapters).
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request) -> Response:
            state = get_state(raw)
            body = await read_json(raw, state.config.max_request_body_bytes)
            name, path, inplace = body.get("lora_name"), body.get("lora_path"), body.get("load_inplace", False)
            if not isinstance(name, str) or not isinstance(path, str):
                raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
            if not isinstance(inplace, bool):  # vLLM's LoadLoRAAdapterRequest: load_inplace: bool = False
                raise APIError(400, "load_inplace must be true or false", "load_inplace")
            await state.in_tokenizer_thread(state.models.load_lora_adapter, name, path, None, inplace)
            return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request) -> Response:
            state = get_state(raw)
            body = await read_json(raw, state.config.max_request_body_bytes)
            name, lora_int_id = body.get("lora_name"), body.get("lora_int_id")
            if not isinstance(name, str) or not name:
                raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
            if lora_int_id is not None and (isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int)):
                raise APIError(400, "lora_int_id must be an integer", "lora_int_id")  # (vLLM reads it, uses it not)
            # Requests already running keep their LoRARequest (the engine keeps its weights cached);
            # new ones can no longer name it.
            state.models.unload_lora_adapter(name)
            return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    @app.get("/health")
    async def health(raw: Request) -> Response:
        engine = get_state(raw).engine
        if (reason := engine.dead_reason) is not None:
            return JSONResponse(error_body(503, f"the engine is not running: {reason}"), status_code=503)
        if not engine.accepting:
            return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
        if (engines := engine.engine_health()) is not None:
            # Data parallelism: still serving while any engine lives; the body names the dead ones.
            status = "ok" if all(e["alive"] for e in engines) else "degraded"
            return JSONResponse({"status": status, "data_parallel_size": len(engines), "engines": engines})
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        state = get_state(raw)
        if state.metrics.engines is not None and (engines := state.engine.engine_health()) is not None:
            state.metrics.engines.record_health(engines)  # which data-parallel engine died, if one did
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version() -> JSONResponse:
        try:
            return JSONResponse({"version": version("tokenloom")})
        except PackageNotFoundError:
            return JSONResponse({"version": "unknown"})


def _lora_card(state: ServerState, lora: LoRARequest) -> dict:
    """vLLM's model card of an adapter: its path as root, the base model as parent."""
    return {"id": lora.lora_name, "object": "model", "created": state.created, "owned_by": "tokenloom",
            "root": lora.lora_path, "parent": lora.base_model_name, "max_model_len": state.engine.info.max_model_len}


def _model_card(state: ServerState, name: str) -> dict:
    info = state.engine.info
    return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenloom",
            "root": info.model_name, "parent": None, "max_model_len": info.max_model_len}


def _add_error_handlers(app: FastAPI) -> None:
    def handle(exc_type: type[Exception], status: int, headers: dict[str, str] | None = None,
               log: bool = False) -> None:
        async def handler(request: Request, exc: Exception) -> JSONResponse:
            if log:
                logger.info("%s %s: %s from %s: %s", request.method, request.url.path, status, type(exc).__name__,
                            str(exc)[:200].encode("utf-8", "backslashreplace").decode("utf-8"))
            return error_response(APIError(status, str(exc) or type(exc).__name__, getattr(exc, "param", None),
                                           headers))

        app.add_exception_handler(exc_type, handler)

    handle(InvalidRequestError, 400)
    # vLLM's fallbacks for exceptions raised on bad input: a 400 (501 for what is not implemented)
    # rather than a 500, which Starlette would also re-raise into uvicorn, closing the connection.
    # Logged, since a server bug raising one of these would otherwise pass for the client's mistake.
    for bad_input in (ValueError, TypeError, OverflowError, RecursionError):
        handle(bad_input, 400, log=True)
    handle(NotImplementedError, 501, log=True)
    handle(EngineOverloadedError, 429, {"Retry-After": "1"})
    handle(EngineDeadError, 503)
    handle(EngineDrainingError, 503)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405, with its Allow header) in the same error shape.
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, f"invalid request: {exc.errors()[:3]}"))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection while it was still sending the body: nobody will read a
        # response, and it is not a server error (the soak's clients that walk away did this).
        logger.debug("client left during %s %s before sending the whole body", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on everything but OPEN_PATHS and CORS preflights (OPTIONS, as vLLM lets
    them through): 401 otherwise. Any of the keys will do (vLLM's `--api-key` takes several); each is compared
    in constant time, all of them every time."""

    def __init__(self, app: ASGIApp, api_key: str | list[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else api_key
        self.expected = [f"Bearer {key}".encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            matches = [hmac.compare_digest(given, expected) for expected in self.expected]
            if not any(matches):
                response = JSONResponse(error_body(401, "invalid or missing API key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LoadMiddleware:
    """Counts generation requests in flight for GET /load (until their response is fully sent)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LOAD_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class RootPathMiddleware:
    """--root-path: serve under a path prefix (behind a proxy that keeps it) as well as without it."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.prefix = "/" + root_path.strip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == self.prefix or path.startswith(self.prefix + "/"):
                scope = {**scope, "path": path[len(self.prefix):] or "/", "root_path": self.prefix}
        await self.app(scope, receive, send)
