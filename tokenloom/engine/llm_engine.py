"""LLMEngine: an engine core (EngineCoreHost) stepped in this process, with the text side on top.

    add_request(text or token ids) → tokenize → Request(s) → EngineCore.step() → OutputProcessor →
    RequestOutputs (text, tokens, finish reasons, per-request metrics)

The model, KV cache and scheduler are built by EngineCoreHost (tokenloom/engine/core_host.py), the
same construction the engine-core process runs; this class adds what only a front end needs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from tokenloom.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config_from_kwargs
from tokenloom.core.request import Request
from tokenloom.engine.core_host import EngineCoreHost
from tokenloom.engine.input_processor import InputProcessor, PromptType, check_lora_request
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.outputs import RequestOutput
from tokenloom.engine.parallel_sampling import fan_out
from tokenloom.engine.pooling import encode_text, prepare_pooling_params, truncate_prompt
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class LLMEngine(EngineCoreHost):
    """An engine core in this process (EngineCoreHost: its model, scheduler, runner and configs stay
    attributes here, as benchmarks and tests read them) plus the front end: InputProcessor in,
    OutputProcessor out."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, clock)
        # The text side, on top of the engine core: what the engine-core process never builds.
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, self.engine_ready(0.0))
        self._ids = itertools.count()

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> LLMEngine:
        return cls(engine_config_from_kwargs(model=model, **kwargs))

    # vLLM's LLMEngine.add_lora / remove_lora / list_loras.
    def add_lora(self, lora_request: Any) -> bool:
        check_lora_request(lora_request, self.lora_config)
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine_core.list_loras()

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> str:
        """Queue a request. Raises ValueError (incl. RequestRejected) with a clear message for bad input.
        `lora_request`: a tokenloom.lora.request.LoRARequest (the adapter to run it with), or None."""
        self.input_processor.check_generation_model()
        params = self.generation_defaults.apply_eos(params or self.generation_defaults.sampling_params())
        if params.structured_outputs is not None:
            from tokenloom.model.grammar import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.input_processor.tokenize(prompt)
        self.input_processor.check_prompt(token_ids, params, max_tokens_in_context=False)
        arrival = self.clock() if arrival_time is None else arrival_time
        if lora_request is not None:
            check_lora_request(lora_request, self.lora_config)
        cores = fan_out(request_id, token_ids, params, self.eos_token_id, arrival, priority, lora_request)
        added = []
        try:
            for core in cores:
                self.engine_core.add_request(core)
                added.append(core.request_id)
        except ValueError:
            self.engine_core.abort_requests(added)
            raise
        self.output_processor.add_request(request_id, text, token_ids, cores, arrival)
        return request_id

    def add_pooling_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a pooling request (params.task set: embed, classify, score, token_embed, ...); it
        finishes with a PoolingRequestOutput once its prompt is computed. ValueError for bad input."""
        self.input_processor.check_pooling_model()
        params = prepare_pooling_params(params, self.pooling_info)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        max_len = self.scheduler_config.max_model_len
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if text is not None and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            token_ids = encode_text(self.tokenizer, text, params.truncate_prompt_tokens, max_len)
        else:
            text, token_ids = self.input_processor.tokenize(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, max_len)
        arrival = self.clock() if arrival_time is None else arrival_time
        core = Request(request_id, token_ids, None, arrival_time=arrival, priority=priority, pooling_params=params)
        self.engine_core.add_request(core)
        self.output_processor.add_request(request_id, text, token_ids, [core], arrival)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        results = []
        for rid in ids:
            core_ids = self.output_processor.core_ids(rid)
            self.engine_core.abort_requests(core_ids)
            out = self.output_processor.finish_aborted(rid)
            if out is not None:
                results.append(out)
        return results

    # The step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:  # a stop string ended these: free their blocks now
            self.engine_core.abort_requests(to_abort)
        return outputs

    def reset_scheduler(
        self,
        scheduler_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """A fresh scheduler (new knobs, empty prefix cache) over the same loaded model, for
        benchmarks that compare configurations side by side without reloading weights."""
        if self.output_processor.num_unfinished() == 0 and not self.scheduler.has_unfinished_requests():
            self.engine_core.drain()  # async scheduling: a trailing step may still be in flight
        if self.has_unfinished_requests():
            raise RuntimeError("reset_scheduler needs an idle engine")
        super().reset_scheduler(scheduler_config, cache_config, clock)
        self.input_processor = InputProcessor(self.tokenizer, self.engine_ready(0.0))  # the new limits

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished() > 0 or self.engine_core.has_unfinished_requests()
