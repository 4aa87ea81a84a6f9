"""LLM: vLLM's offline API on tokenloom — code written for `vllm.LLM` runs unchanged.

    llm = LLM()                                   # the default model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text, outs[0].metrics.time_to_first_token)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenloom.engine.beam_search import BeamSearchOutput, beam_search_offline
from tokenloom.engine.llm_engine import LLMEngine, PromptType, engine_config_from_kwargs
from tokenloom.engine.outputs import RequestOutput
from tokenloom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.dp_llm import DataParallelLLMEngine


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`data_parallel_size=N` (vLLM's name) runs N engine-core processes behind the router
        (`routing_policy`, `distributed_executor_backend="ray"` to place them with Ray)."""
        config = engine_config_from_kwargs(model=model, **kwargs)
        parallel = config.parallel
        self._dp: DataParallelLLMEngine | None = None
        if parallel is not None and (parallel.data_parallel_size > 1 or parallel.distributed_executor_backend == "ray"):
            from tokenloom.engine.dp_llm import DataParallelLLMEngine

            self._dp = DataParallelLLMEngine(config)
            self.llm_engine = None
        else:
            self.llm_engine = LLMEngine(config)

    def get_tokenizer(self):
        return self._dp.tokenizer if self._dp is not None else self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the data-parallel engine processes (a single engine lives in this process)."""
        if self._dp is not None:
            self._dp.close()
            self._dp = None

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config auto)."""
        return self.llm_engine.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """All prompts at once; results in prompt order."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:  # the model's generation_config defaults (vLLM's LLM does the same)
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        # As vLLM's LLM does: only finished outputs are read here, so the engine builds no partial ones.
        params_list = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        if self._dp is not None:
            return self._dp.generate(prompts, params_list, priority)
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                ids.append(engine.add_request(None, prompt, params, priority=priority[i] if priority else 0))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Chat conversations rendered with the model's own chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                         tokenize=True)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one BeamSearchOutput per prompt, its `sequences` best first, each
        with `tokens` (prompt included), `text` (prompt included), `cum_logprob` and per-step `logprobs`.
        Runs as one-token requests over the engine (tokenloom/engine/beam_search.py); at most
        `concurrency_limit` prompts are searched at once."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        source = self._dp if self._dp is not None else self.llm_engine
        items = []
        for prompt in prompts:
            text, token_ids = source.tokenize_prompt(prompt)
            if not token_ids:
                raise ValueError("the prompt is empty")
            items.append({"prompt_token_ids": token_ids, "prompt": text})
        tok = self.get_tokenizer()
        eos = tok.eos_token_id
        if eos is None:
            eos = self._dp.engine.info.eos_token_id if self._dp is not None else self.llm_engine.eos_token_id

        def run_step(step_prompts: list[dict[str, Any]], step_params: SamplingParams) -> list[RequestOutput]:
            return self.generate(step_prompts, step_params, use_tqdm=False)

        return beam_search_offline(items, params, run_step, lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
                                   eos, concurrency_limit=concurrency_limit, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        out_tokens = 0
        try:
            while len(finals) < len(ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"output {out_tokens / elapsed:.0f} tok/s", refresh=False)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finals])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[i] for i in ids]
