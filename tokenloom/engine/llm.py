"""LLM: vLLM's offline API on tokenloom — code written for `vllm.LLM` runs unchanged.

    llm = LLM()                                   # the default model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text, outs[0].metrics.time_to_first_token)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenloom.config import engine_config_from_kwargs
from tokenloom.core.prompt_fit import EMPTY_PROMPT
from tokenloom.engine.beam_search import BeamGrammar, BeamSearchOutput, beam_search_offline
from tokenloom.engine.inproc_client import InprocClient
from tokenloom.engine.input_processor import PromptType
from tokenloom.engine.llm_args import conversations, per_prompt, priority_list, prompt_list, render_conversation
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.metrics_reader import Metric
from tokenloom.engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenloom.engine.pooling import PoolingInfo, verify_pooling_task
from tokenloom.engine.scoring import (
    ScoringData,
    cosine,
    cross_encoder_pair,
    maxsim,
    token_limits,
    truncate_scoring_data,
    validate_score_input,
)
from tokenloom.engine.served_model_config import ServedModelConfig
from tokenloom.engine.sleep import PauseMode
from tokenloom.exceptions import ValidationError
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenloom.lora.request import LoRARequest


def _lora_requests(lora_request: Any, n: int) -> list[Any]:
    """vLLM's lora_request argument as one entry per prompt: a single LoRARequest (or None) for all, or a
    list with one per prompt."""
    if isinstance(lora_request, list | tuple):
        if len(lora_request) != n:
            raise ValidationError(f"lora_request: {len(lora_request)} LoRARequests for {n} prompts (give one, or "
                                  "one per prompt)", parameter="lora_request")
        return list(lora_request)
    return [lora_request] * n


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`data_parallel_size=N` (vLLM's name) runs N engine-core processes behind the router
        (`routing_policy`, `distributed_executor_backend="ray"` to place them with Ray): the LLMEngine
        then steps them through its SyncMPClient, otherwise its engine core runs in this process.
        `max_logprobs` (vLLM's, default 20): the most logprobs / prompt_logprobs a request may ask for.
        `disable_log_stats` defaults to True here, as vLLM's LLM: False keeps metrics for `get_metrics()`."""
        max_logprobs = kwargs.pop("max_logprobs", 20)
        kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default: no per-step figures unless asked
        self.llm_engine = LLMEngine(engine_config_from_kwargs(model=model, **kwargs), max_logprobs=max_logprobs)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's ValueError when the LLM was built with skip_tokenizer_init)."""
        return self.llm_engine.get_tokenizer()

    @property
    def model_config(self) -> ServedModelConfig:
        """vLLM's LLM.model_config: the model's name, context and runner, a pooling model's embedding size and
        pooler config (tokenloom/engine/served_model_config.py)."""
        engine = self.llm_engine
        info = engine.input_processor.info
        pooling = engine.pooling_info
        hf_config = engine.client.host.model_config if isinstance(engine.client, InprocClient) else None
        return ServedModelConfig(info.model_name, pooling.served_model_name if pooling else info.model_name,
                                 info.max_model_len, "generate" if pooling is None else "pooling", pooling,
                                 hf_config)

    def shutdown(self) -> None:
        """Stop the engine: the data-parallel engine processes, or the in-process engine's threads."""
        self.llm_engine.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config auto)."""
        return self.llm_engine.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """All prompts at once; results in prompt order. `lora_request`: one LoRARequest for every
        prompt, or one (or None: the base model) per prompt, as vLLM's (needs enable_lora=True)."""
        prompts = prompt_list(prompts)
        if sampling_params is None:  # the model's generation_config defaults (vLLM's LLM does the same)
            sampling_params = self.get_default_sampling_params()
        params_list = per_prompt(sampling_params, SamplingParams, len(prompts), "sampling_params")
        priorities = priority_list(priority, len(prompts))
        loras = _lora_requests(lora_request, len(prompts))
        # As vLLM's LLM does: only finished outputs are read here, so the engine builds no partial ones.
        params_list = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                ids.append(engine.add_request(None, prompt, params, priority=priorities[i], lora_request=loras[i]))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`, its arguments in its order: conversations rendered with the model's chat template
        (or `chat_template`), `tools` and `chat_template_kwargs` passed to it; `continue_final_message` goes on
        from the last (assistant) message instead of opening a new turn. Content given as a list of parts
        is joined text (vLLM's "string" content format, which "auto" picks for a text model's template);
        "openai" hands the parts to the template as they are. `lora_request` and `priority` (one for every
        conversation, or one each) as generate's."""
        if add_generation_prompt and continue_final_message:  # vLLM's message
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        tok = self.get_tokenizer()
        convs = conversations(messages, join_parts=chat_template_content_format != "openai")
        prompts = [{"prompt_token_ids": render_conversation(
            tok, i, conv, add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template, tools=tools, chat_template_kwargs=chat_template_kwargs)}
            for i, conv in enumerate(convs)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of this LLM's `vllm:` Prometheus figures as vLLM's reader types (Counter, Gauge,
        Histogram, Vector; tokenloom.engine.metrics_reader). Needs disable_log_stats=False (AssertionError
        otherwise, as vLLM's)."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: drop the cached prefix blocks, and with `reset_connector` the KV connector's cache
        (LLMEngine.reset_prefix_cache)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """vLLM's LLM.sleep where there is no sleep mode (its CPU platform): the engine pauses (level 0), and at
        level 1 / 2 also drops its prefix cache; no memory is freed (vLLM's CPU worker: "sleep mode is not
        supported on CPU, ignore it."). `mode`: abort (the default), wait or keep, for requests in flight
        (LLMEngine.sleep). generate() while asleep is refused: call wake_up() first."""
        self.llm_engine.sleep(level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: resume after sleep(); `tags` ("weights", "kv_cache", "scheduling") wake a part. Returns whether
        the engine is fully awake (it schedules again only then)."""
        return self.llm_engine.wake_up(tags)

    def beam_search(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one BeamSearchOutput per prompt, its `sequences` best first, each
        with `tokens` (prompt included), `text` (prompt included), `cum_logprob` and per-step `logprobs`.
        Runs as one-token requests over the engine (tokenloom/engine/beam_search.py); at most
        `concurrency_limit` prompts are searched at once; `lora_request` (one, or one per prompt) runs
        every beam of a prompt with its adapter; `params.structured_outputs` constrains every beam to the grammar
        (vLLM 0.32's rule: beam_search.py's BeamGrammar)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = prompt_list(prompts)
        loras = _lora_requests(lora_request, len(prompts))
        items = []
        for prompt, lora in zip(prompts, loras):
            text, token_ids = self.llm_engine.input_processor.tokenize(prompt)
            if not token_ids:
                raise ValidationError(EMPTY_PROMPT, parameter="prompt")
            items.append({"prompt_token_ids": token_ids, "prompt": text, "lora_request": lora})
        tok = self.get_tokenizer()
        eos = tok.eos_token_id
        if eos is None:
            eos = self.llm_engine.eos_token_id

        grammar = None
        if params.structured_outputs is not None:
            # Refused here as a request would be (a bad schema, an unsupported feature), then compiled once.
            from tokenloom.model.grammar import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs, self.llm_engine.structured_outputs_config)
            grammar = BeamGrammar(self.llm_engine.grammar_backend(), params.structured_outputs.key, eos)

        def run_step(step_prompts: list[dict[str, Any]],
                     step_params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
            step_loras = [p.pop("lora_request", None) for p in step_prompts]
            return self.generate(step_prompts, step_params, use_tqdm=False, lora_request=step_loras)

        return beam_search_offline(items, params, run_step, lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
                                   eos, max_logprobs=self.llm_engine.max_logprobs,
                                   concurrency_limit=concurrency_limit, use_tqdm=use_tqdm, grammar=grammar)

    # Pooling models (vLLM's LLM.encode / embed / classify / score) ---------------------------------
    # vLLM 0.32's signatures, plus tokenloom's `truncate_prompt_tokens` (vLLM's is tokenization_kwargs') and
    # pooling_params taken by position too. Each prompt is one request; prompts are truncated and bounded by
    # TokenizeParams (tokenloom/engine/tokenize_params.py), as vLLM's renderer does.
    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        *,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt with `pooling_task` (required, as vLLM's: the model's own pooling task; another one
        it supports needs PoolerConfig(task=...)); `outputs.data` is a torch tensor, as vLLM's."""
        info = self._pooling_info("LLM.encode()")
        verify_pooling_task(info, pooling_task)
        return self._encode(prompts, pooling_params, use_tqdm, pooling_task, truncate_prompt_tokens, lora_request,
                            tokenization_kwargs)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None, *, lora_request: Any = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, "embed", truncate_prompt_tokens,
                           lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None, *, lora_request: Any = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[ClassificationRequestOutput]:
        """The class probabilities of each prompt (`outputs.probs`), from a classification model."""
        outs = self.encode(prompts, pooling_params, use_tqdm, "classify", truncate_prompt_tokens,
                           lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None, *,
              lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one query against N documents (or N pairs), by the model's pooling task: a
        cross-encoder (classify, one label) scores each pair in one pass (token type ids mark the second text);
        an embedding model scores the cosine of the two embeddings (token_embed: ColBERT's MaxSim).
        `pooling_params.extra_kwargs` may hold max_tokens_per_query / max_tokens_per_doc. `chat_template` is
        read by vLLM's score templates only, which the models tokenloom runs do not have."""
        del chat_template
        info = self._pooling_info("LLM.score()")
        score_type = info.score_type
        if score_type == "cross-encoder" and info.num_labels != 1:
            raise ValueError("Scoring API is only enabled for num_labels == 1.")
        if score_type is None:
            raise ValueError("This model does not support the Scoring API.")
        data = validate_score_input(data_1, data_2, architecture=info.architecture)
        params = (pooling_params or PoolingParams()).clone()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        task = info.pooling_task
        if params.task is not None and params.task != task:
            raise ValueError(f"You cannot overwrite pooling_params.task={params.task!r} with pooling_task={task!r}!")
        params.task = task
        extra = params.extra_kwargs or {}
        limits = token_limits(extra.get("max_tokens_per_query", 0), extra.get("max_tokens_per_doc", 0),
                              self.llm_engine.input_processor.info.max_model_len)
        run = dict(use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens, lora_request=lora_request,
                   tokenization_kwargs=tokenization_kwargs)
        if score_type == "cross-encoder":
            return self._score_pairs(data, params, limits, **run)
        return self._score_apart(data, params, limits, late_interaction=score_type == "late-interaction", **run)

    def _score_pairs(self, data: ScoringData, params: PoolingParams, limits: tuple[int, int],
                     **run: Any) -> list[ScoringRequestOutput]:
        """A cross-encoder: each (query, document) encoded together, its classify output the score."""
        queries = data.data_1 * len(data.data_2) if len(data.data_1) == 1 else data.data_1
        truncate = run["truncate_prompt_tokens"]
        tok_params = self.llm_engine.tokenize_params(params.truncate_prompt_tokens if truncate is None else truncate,
                                                     run["tokenization_kwargs"])
        tokenizer = self.llm_engine.get_tokenizer()
        prompts, params_list = [], []
        for query, doc in zip(queries, data.data_2):
            ids, split = cross_encoder_pair(tokenizer, query, doc, tok_params, *limits)
            pair_params = params.clone()
            pair_params.extra_kwargs = {**(params.extra_kwargs or {}), "compressed_token_type_ids": split}
            prompts.append({"prompt_token_ids": ids})
            params_list.append(pair_params)
        outs = self._encode(prompts, params_list, run["use_tqdm"], params.task, None, run["lora_request"], None)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data.reshape(-1)[0])),
                                     o.prompt_token_ids) for o in outs]

    def _score_apart(self, data: ScoringData, params: PoolingParams, limits: tuple[int, int],
                     late_interaction: bool, **run: Any) -> list[ScoringRequestOutput]:
        """An embedding model: every query and document embedded on its own (vLLM's bi-encoder), the pair's
        score the cosine of the two (token_embed: MaxSim of their token embeddings); its prompt_token_ids the
        query's, a pad token, the document's."""
        tokenizer = self.llm_engine.get_tokenizer()
        data = truncate_scoring_data(data, tokenizer, *limits)
        outs = self._encode(data.data_1 + data.data_2, params, run["use_tqdm"], params.task,
                            run["truncate_prompt_tokens"], run["lora_request"], run["tokenization_kwargs"])
        firsts, seconds = outs[: len(data.data_1)], outs[len(data.data_1):]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        pad = [tokenizer.pad_token_id] if getattr(tokenizer, "pad_token_id", None) is not None else []
        score = maxsim if late_interaction else cosine
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(score(a.outputs.data,
                                                                                           b.outputs.data)),
                                     a.prompt_token_ids + pad + b.prompt_token_ids)
                for a, b in zip(firsts, seconds)]

    def _pooling_info(self, method: str) -> PoolingInfo:
        """The pooling engine's description; vLLM's refusal of a pooling call on a generation model."""
        info = self.llm_engine.pooling_info
        if info is None:
            raise ValueError(f"{method} is only supported for pooling models. Try passing `--runner pooling` to use "
                             "the model as a pooling model.")
        return info

    def _encode(self, prompts: Any, pooling_params: Any, use_tqdm: bool, pooling_task: str,
                truncate_prompt_tokens: int | None, lora_request: Any,
                tokenization_kwargs: dict[str, Any] | None) -> list[PoolingRequestOutput]:
        """Every prompt as a pooling request of `pooling_task`, run to the end; outputs in the prompts' order."""
        import torch

        engine = self.llm_engine
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported with pooling models")
        prompts = prompt_list(prompts)
        if not prompts:
            raise ValueError("You must pass at least one prompt")
        if pooling_params is None:
            pooling_params = PoolingParams()
        params_list = per_prompt(pooling_params, PoolingParams, len(prompts), "pooling_params")
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                params = params.clone()
                if params.task not in (None, pooling_task):
                    raise ValueError(f"You cannot overwrite pooling_params.task={params.task!r} with "
                                     f"pooling_task={pooling_task!r}!")
                params.task = pooling_task
                if truncate_prompt_tokens is not None:
                    params.truncate_prompt_tokens = truncate_prompt_tokens
                ids.append(engine.add_pooling_request(None, prompt, params, tokenization_kwargs=tokenization_kwargs))
        except Exception:
            engine.abort_request(ids)
            raise
        outs = self._run(ids, use_tqdm)
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            out.outputs = PoolingOutput(torch.from_numpy(out.outputs.data))
        return outs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        """Step the engine until every request of `ids` finished; their final outputs in that order
        (RequestOutput, or PoolingRequestOutput for a pooling model). The bar shows generated tok/s."""
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
                if engine.is_sleeping():  # vLLM would wait here forever: nothing is scheduled until wake_up()
                    raise RuntimeError("the engine is sleeping (LLM.sleep()): call LLM.wake_up() before generating; "
                                       "requests added while it sleeps are not scheduled until then")
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                        if isinstance(out, RequestOutput):
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
