"""The offline engine behind `LLM(..., data_parallel_size=N)` (or the Ray backend).

N engine cores need the multi-process client, which speaks asyncio; this wraps AsyncLLM in a private
event loop and offers LLMEngine's request interface (add_request, step, abort_request), so `LLM` drives
either engine the same way. Prompts are tokenized and checked here by the one InputProcessor (the
engine processes never see text).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.clients import make_client
from tokenloom.engine.generation_config import GenerationDefaults
from tokenloom.engine.input_processor import PromptType, check_lora_request
from tokenloom.engine.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class DataParallelLLMEngine:
    def __init__(self, config: EngineConfig, log_level: str = "warning") -> None:
        client = make_client(config, log_level)
        self.engine = AsyncLLM.from_client(client, config.model)
        info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        self.input_processor = self.engine.input_processor
        self.model_name = info.model_name
        self.eos_token_id = info.eos_token_id
        self.pooling_info = info.pooling
        # The engines' generation_config defaults (AsyncLLM adds their extra EOS ids to every request).
        self.generation_defaults = GenerationDefaults(dict(info.sampling_defaults), list(info.extra_eos_token_ids))
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._attach())
        self._ids = itertools.count()

    async def _attach(self) -> None:
        self.engine.attach()
        self._stream = self.engine.open_stream()  # every request's outputs, on this engine's loop

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> str:
        """As LLMEngine.add_request; the arrival time is AsyncLLM's (the moment it is sent)."""
        params = params or self.generation_defaults.sampling_params()
        text, token_ids = self.input_processor.tokenize(prompt)
        request_id = request_id if request_id is not None else f"dp-{next(self._ids)}"
        if lora_request is not None:
            check_lora_request(lora_request, self.engine.info.lora)
        self.engine.add_request(request_id, token_ids, params, self._stream, prompt=text, priority=priority,
                                lora_request=lora_request)
        return request_id

    def add_pooling_request(self, request_id: str | None, prompt: PromptType, params: PoolingParams,
                            arrival_time: float | None = None, priority: int = 0) -> str:  # fmt: skip
        raise ValueError("pooling models run on one engine: data_parallel_size > 1 is not supported with them")

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Free the requests' blocks in their engines; their outputs are dropped (nobody reads them)."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.engine.abort(rid)
        return []

    def step(self) -> list[RequestOutput]:
        """The next output from the engines (blocks until one arrives); raises an engine's failure."""
        return [self._loop.run_until_complete(self._stream.__anext__())]

    def has_unfinished_requests(self) -> bool:
        return bool(self._stream.pending)

    def generate(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                 priority: Sequence[int] | None = None, lora_requests: Sequence[Any] | None = None,
                 on_finished: Callable[[], None] | None = None) -> list[RequestOutput]:  # fmt: skip
        """Every prompt's final output, in prompt order (raises the first request's error, if any).
        `lora_requests`: one LoRARequest (or None) per prompt; `on_finished`: called as each request
        finishes (a caller's progress)."""
        ids: list[str] = []
        finals: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(self.add_request(None, prompt, p, priority=priority[i] if priority else 0,
                                            lora_request=lora_requests[i] if lora_requests else None))
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finals[out.request_id] = out
                        if on_finished is not None:
                            on_finished()
        finally:
            self.abort_request([i for i in ids if i not in finals])  # whatever did not finish (an error, Ctrl-C)
        return [finals[i] for i in ids]

    def close(self) -> None:
        self.engine.shutdown()
        self._loop.close()
