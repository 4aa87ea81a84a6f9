"""The offline engine behind `LLM(..., data_parallel_size=N)` (or the Ray backend).

N engine cores need the multi-process client, which speaks asyncio; this wraps AsyncLLM in a private
event loop so `LLM.generate` stays a plain blocking call. Prompts are tokenized here (the engine
processes never see text) and all requests enter at once, as in LLMEngine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.dp_client import make_engine_client
from tokenloom.engine.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams


class DataParallelLLMEngine:
    def __init__(self, config: EngineConfig, log_level: str = "warning") -> None:
        client = make_engine_client(config, log_level)
        self.engine = AsyncLLM.from_client(client, config.model)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.info.model_name
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._attach())
        self._ids = itertools.count()

    async def _attach(self) -> None:
        self.engine.attach()

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def generate(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                 priority: Sequence[int] | None = None, lora_requests: Sequence[Any] | None = None,
                 on_finished: Callable[[], None] | None = None) -> list[RequestOutput]:  # fmt: skip
        """Every prompt's final output, in prompt order (raises the first request's error, if any).
        `lora_requests`: one LoRARequest (or None) per prompt; `on_finished`: called as each request
        finishes (a caller's progress)."""
        return self._loop.run_until_complete(self._generate(prompts, params, priority, on_finished, lora_requests))

    async def _generate(self, prompts, params, priority, on_finished=None, lora_requests=None) -> list[RequestOutput]:
        stream = self.engine.open_stream()
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                text, token_ids = self.tokenize_prompt(prompt)
                rid = f"dp-{next(self._ids)}"
                lora = lora_requests[i] if lora_requests else None
                if lora is not None:
                    from tokenloom.engine.llm_engine import check_lora_request

                    check_lora_request(lora, getattr(self.engine.info, "lora", None))
                self.engine.add_request(rid, token_ids, p, stream, prompt=text,
                                        priority=priority[i] if priority else 0, lora_request=lora)
                ids.append(rid)
            finals: dict[str, RequestOutput] = {}
            async for out in stream:
                if out.finished:
                    finals[out.request_id] = out
                    if on_finished is not None:
                        on_finished()
        finally:
            stream.close()  # aborts whatever did not finish (an error, Ctrl-C)
        return [finals[i] for i in ids]

    def close(self) -> None:
        self.engine.shutdown()
        self._loop.close()
