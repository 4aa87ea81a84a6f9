"""What every handler needs: the engine, the options, the model names, a tokenizer thread, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

from tokenloom import envs
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.input_processor import NO_TOKENIZER
from tokenloom.engine.metrics import PrometheusMetrics
from tokenloom.engine.stat_logging import PerEngineStatLogger
from tokenloom.lora.request import LoRARequest
from tokenloom.reasoning import ReasoningParser, ReasoningParserManager
from tokenloom.server.config import ServerConfig
from tokenloom.server.errors import APIError
from tokenloom.server.response_store import ResponseStore
from tokenloom.server.responses_background import BackgroundRuns
from tokenloom.server.serving_models import ServingModels

if TYPE_CHECKING:  # the tokenizer module imports torch
    from tokenloom.model.tokenizer import Tokenizer

T = TypeVar("T")


class ServerState:
    def __init__(self, engine: AsyncLLM, config: ServerConfig, log_stats: bool = False,
                 reasoning_parser: str = "") -> None:
        """`log_stats`: keep the figures for the periodic stats line (`stat_logger`; the app's lifespan
        calls its log()); off with --disable-log-stats. `reasoning_parser`: the engine's --reasoning-parser
        (an engine argument, as in vLLM), registered already (its plugin imported: launcher.py)."""
        self.engine = engine
        self.config = config
        self.model_names = list(config.served_model_names or [engine.info.model_name])
        if config.chat_template is not None and engine.tokenizer is not None:  # --chat-template, for every chat
            engine.tokenizer.chat_template = config.chat_template
        if getattr(engine.info, "pooling", None) is not None:  # the name vLLM's pooling messages quote
            engine.info.pooling.served_model_name = self.model_names[0]
        # The base model's names and the LoRA adapters served (--lora-modules, runtime loading).
        self.models = ServingModels(self.model_names, getattr(engine.info, "lora", None), config.lora_modules)
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size
        self.server_load = 0  # generation requests in flight (GET /load)
        self.responses = ResponseStore(envs.TOKENLOOM_RESPONSES_STORE_SIZE)  # /v1/responses with store
        self.background = BackgroundRuns()  # /v1/responses with background: the runs in flight
        # The model's generation_config.json defaults (empty with --generation-config vllm).
        self.sampling_defaults = dict(getattr(engine.info, "sampling_defaults", None) or {})
        self.created = int(time.time())
        # --reasoning-parser (checked at start-up, its plugin imported): None without one.
        self.reasoning_parser_cls: type[ReasoningParser] | None = (
            ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None)
        # One thread: tokenization and chat templates stay off the event loop, and a Hugging Face fast
        # tokenizer is never entered from two threads at once.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.metrics = PrometheusMetrics(self.model_names[0], engine.info.num_blocks, config.metrics_prefix,
                                     engine.info, engine.data_parallel_size)
        engine.stat_loggers.append(self.metrics.record)
        self.stat_logger: PerEngineStatLogger | None = None
        if log_stats:
            self.stat_logger = PerEngineStatLogger(engine.data_parallel_size, engine.info.device)
            engine.stat_loggers.append(self.stat_logger.record)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with: the one requested, the served model's when none is (vLLM: an empty name too)
        or when VLLM_SKIP_MODEL_NAME_VALIDATION takes any name; else vLLM's 404."""
        if not requested:
            return self.model_names[0]
        if self.models.is_served(requested):
            return requested
        if envs.VLLM_SKIP_MODEL_NAME_VALIDATION:
            return self.model_names[0]
        raise self.unknown_model(requested)

    def unknown_model(self, requested: str) -> APIError:
        return APIError(404, f"The model `{requested}` does not exist. Valid aliases: {', '.join(self.model_names)}.",
                        "model")

    def check_generates(self) -> None:
        """A generation endpoint on a pooling model: 400 naming the endpoints it serves, before any chat
        template or tokenization can fail with a less useful message (an encoder has no chat template)."""
        pooling = getattr(self.engine.info, "pooling", None)
        if pooling is not None:
            raise APIError(400, f"The model `{self.model_names[0]}` is a pooling model (tasks: "
                                f"{', '.join(pooling.supported_tasks)}) and does not support generation: use "
                                "/v1/embeddings, "
                                "/pooling, /classify, /score or /rerank", "model")

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return self.models.lora_request(requested)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; with --skip-tokenizer-init (none loaded) whatever needs it is a 400 in vLLM's
        words (chat, text prompts, /tokenize, tool calls, ...); completions of token ids read engine.tokenizer."""
        if self.engine.tokenizer is None:
            raise APIError(400, NO_TOKENIZER, "skip_tokenizer_init")
        return self.engine.tokenizer

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def get_state(request: Request) -> ServerState:
    return request.app.state.server
