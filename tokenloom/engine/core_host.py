"""EngineCoreHost: an engine core built from an EngineConfig alone — vLLM's EngineCore construction.

    EngineConfig → checks before loading → model (through the executor) → KV cache sized, max_model_len
    resolved → scheduler (+ LoRA limits, KV connector, grammars) → EngineCore (schedule, execute, update)

One construction path for both places an engine core runs: LLMEngine (in this process, with the text
side on top: tokenizing, detokenizing, stop strings) and the engine-core process (tokenloom/engine/
core_proc.py), which never sees text and so builds no OutputProcessor. It still loads the tokenizer
(through `tokenizers`; transformers only on demand): the grammar backend compiles structured outputs
against its vocabulary, int8 quantization calibrates on tokenized text, and its EOS id is the engine's.
`EngineCore` itself (tokenloom/engine/core.py) stays the step loop alone, which the simulator builds
over a cost model instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tokenloom import envs
from tokenloom.config import (
    STR_POOLING_REJECTS_LOGITSPROCS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    auto_kv_cache_dtype,
    check_verification_budget,
    token_budget_labels,
    token_budget_text,
)
from tokenloom.core.kv_cache_groups import layers_per_block, make_kv_cache_groups, max_in_flight_tokens
from tokenloom.core.prompt_fit import max_model_len_that_fits, resolve_max_model_len, sched_max_len_default
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.core.structured_output import StructuredOutputManager
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_messages import EngineReady
from tokenloom.engine.executor import ModelThread, UniProcExecutor
from tokenloom.engine.generation_config import load_generation_defaults
from tokenloom.engine.kv_connectors import check_kv_transfer, make_kv_connectors
from tokenloom.engine.pooling import (
    PoolingInfo,
    build_pooling_info,
    check_pooling_engine,
    read_hf_config,
    resolve_runner,
    sentence_bert_max_seq_length,
)
from tokenloom.engine.trace import StepTracer

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
ACTIVATION_RESERVE_BYTES = 1 << 30  # what a CUDA KV budget leaves for activations


def cuda_kv_budget(free: int, total: int, gpu_memory_utilization: float | None) -> int:
    """The KV cache's bytes on a GPU with `free` of `total` bytes free once the weights are loaded: 90 % of the free
    memory by default; with vLLM's gpu_memory_utilization, that share of the whole GPU less what is in use already
    (this engine's weights and anything else on the device). Both leave ACTIVATION_RESERVE_BYTES for activations."""
    if gpu_memory_utilization is None:
        return int(free * 0.9) - ACTIVATION_RESERVE_BYTES
    budget = int(total * gpu_memory_utilization) - (total - free) - ACTIVATION_RESERVE_BYTES
    if budget <= 0:
        raise ConfigError(f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache: "
                          f"{(total - free) >> 20} MiB of the GPU's {total >> 20} MiB are in use already (weights "
                          f"included) and {ACTIVATION_RESERVE_BYTES >> 20} MiB are kept for activations; raise it")
    return budget


class EngineCoreHost:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """Load the model and build the engine core over it (engine_core); nothing here handles text."""
        import torch

        from tokenloom.model.attention import kv_cache_bytes_per_block
        from tokenloom.model.loader import checkpoint_float_dtype, load_model, resolve_model_path, resolve_quantization
        from tokenloom.model.platform import model_threads, resolve_device, resolve_dtype
        from tokenloom.model.tokenizer import load_tokenizer

        parallel = config.parallel
        # The Ray backend places engine cores (LLM, serve) and, inside one, its TP/PP ranks (this engine).
        if parallel is not None and (parallel.data_parallel_size > 1 or (parallel.distributed_executor_backend == "ray"
                                                                         and parallel.model_parallel_size == 1)):
            raise ConfigError("data_parallel_size > 1 (or the Ray backend) runs engine-core processes: use LLM(...), "
                              "LLMEngine(config), `tokenloom serve` or `bench throughput`; an in-process engine core "
                              "(InprocClient) is one engine")
        check_async_scheduling(config)
        check_speculative_engine(config)
        check_kv_transfer(config)
        check_batch_invariant(config)
        model_parallel = parallel.model_parallel_size if parallel is not None else 1
        if model_parallel > 1:
            check_model_parallel(config)
        path = resolve_model_path(config.model)
        # hf_overrides as the dict every load below (and every worker) applies; a callable runs here, once.
        config = resolve_model_overrides(config, path)
        overrides = model_overrides(config)
        self.runner_type, self.convert = resolve_runner(config, path, overrides)
        # The custom logits processors' class names, for the front end's validate_params (none: no processor).
        self.logits_processor_names: list[str] = []
        if self.runner_type == "pooling" and config.logits_processors:  # vLLM's refusal, before the load
            raise ConfigError(STR_POOLING_REJECTS_LOGITSPROCS)
        if config.logits_processors:  # a name that does not load fails now, not after minutes of loading
            from tokenloom.sample.logits_processor import _load_logitsprocs_by_fqcns

            _load_logitsprocs_by_fqcns(config.logits_processors)
        if model_parallel > 1 and self.runner_type == "pooling":
            raise ConfigError("tensor/pipeline parallelism runs generation models; pooling models run on one rank")
        self.lora_config = config.lora_config
        if self.lora_config is not None and self.runner_type == "pooling":
            raise ConfigError("enable_lora: LoRA adapters are served on generation models; a pooling model "
                              "(--runner pooling) cannot take them")
        self.pooling_info: PoolingInfo | None = None
        if self.runner_type == "pooling":
            check_pooling_engine(config)
            from tokenloom.model.bert import is_encoder_checkpoint

            if is_encoder_checkpoint(path, overrides):
                if config.quantization not in (None, "none"):
                    raise ConfigError(f"--quantization {config.quantization}: an encoder runs in --dtype "
                                      "(quantized weights are the decoders' GGUF path)")
                if config.cache is not None and config.cache.cache_dtype != "auto":
                    raise ConfigError(f"--kv-cache-dtype {config.cache.cache_dtype}: an encoder (BERT-style) keeps "
                                      "no KV cache; leave it at auto")
                self._init_encoder(config, path, clock, overrides)
                return
        device = resolve_device(config.device)
        if config.quantization not in (None, "none") and device.type != "cpu":  # before minutes of loading
            raise ConfigError(f"quantization={config.quantization!r} runs on CPU only; the device is {device}")
        # The method in force from here on (auto: a quantized GGUF stays quantized on CPU).
        config = replace(config, quantization=resolve_quantization(config.quantization, path, device))
        self.config = config
        self.clock = clock
        dtype = resolve_dtype(config.dtype, device)
        if device.type == "cpu" and not envs.OMP_NUM_THREADS:
            try:  # a bad VLLM_CPU_NUM_OF_RESERVED_CPU fails here, before the weights load
                model_threads(len(os.sched_getaffinity(0)))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        # Async scheduling: one thread owns the model from the load on and runs every step, so that
        # the engine thread never starts an OpenMP team of its own (engine/executor.py, ModelThread).
        async_scheduling = config.scheduler is not None and config.scheduler.async_scheduling
        self._model_thread = ModelThread() if async_scheduling else None
        on_model_thread = self._model_thread.call if self._model_thread is not None else _call_here
        try:
            if model_parallel > 1:  # the workers load their shards; this process needs the config only
                from tokenloom.model.loader import load_model_config
                from tokenloom.model.tp_shard import check_parallel_model

                loaded = _ConfigOnly(load_model_config(path, overrides))
                try:
                    check_parallel_model(loaded.config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            else:
                loaded = on_model_thread(load_model, path, dtype, quantized=config.quantization == "gguf",
                                         overrides=overrides)
        except BaseException:
            if self._model_thread is not None:  # a failed load leaves no idle thread behind
                self._model_thread.shutdown()
            raise
        self.model_config = loaded.config
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        # Through `tokenizers` where it can: the engine-core process then never imports transformers.
        # skip_tokenizer_init: none at all; the EOS id is then the model's own (config / GGUF metadata), as
        # vLLM's generation config supplies it there.
        self.tokenizer = (None if config.skip_tokenizer_init
                          else load_tokenizer(config.tokenizer_source, lazy_transformers=True))
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if self.eos_token_id is None:
            self.eos_token_id = loaded.config.eos_token_id
        self.generation_defaults = load_generation_defaults(path if path.is_dir() else path.parent / "_none",
                                                            config.generation_config, self.eos_token_id)

        cache_cfg = config.cache or CacheConfig()
        # auto: the model's dtype (a float32 run of a 16-bit checkpoint keeps a 16-bit cache: config.py).
        cache_dtype = auto_kv_cache_dtype(cache_cfg.cache_dtype, str(config.dtype),
                                          str(dtype).removeprefix("torch."), checkpoint_float_dtype(path))
        cache_cfg = replace(cache_cfg, layer_windows=self._layer_windows(loaded.config), cache_dtype=cache_dtype)
        kv_cache_groups = make_kv_cache_groups(cache_cfg.layer_windows, loaded.config.num_hidden_layers,
                                               hybrid=not cache_cfg.disable_hybrid_kv_cache_manager)
        # A block holds the K/V of one group's layers (all of them with one group).
        block_bytes = kv_cache_bytes_per_block(loaded.config, cache_cfg.block_size, dtype,
                                               num_layers=layers_per_block(kv_cache_groups),
                                               cache_dtype=cache_cfg.cache_dtype)
        if model_parallel > 1:
            # Each rank's cache holds its KV heads of its stage's layers, in --kv-cache-memory of its own
            # (vLLM's per-worker KV space); sized for the stage with the most layers.
            from tokenloom.model.tp_shard import rank_config

            pp = parallel.pipeline_parallel_size
            block_bytes = max(kv_cache_bytes_per_block(rank_config(loaded.config, parallel.tensor_parallel_size, s, pp),
                                                       cache_cfg.block_size, dtype, cache_dtype=cache_cfg.cache_dtype)
                              for s in range(pp))
        num_blocks = cache_cfg.num_blocks or self._num_blocks_for(config, device, block_bytes)
        # The default max_model_len is capped at the longest request the pool can hold, every KV cache
        # group counted (vLLM's estimate_max_model_len; a sliding group needs only its window's blocks).
        sched_in = config.scheduler or SchedulerConfig()
        # The model's context: max_position_embeddings, or the window under disable_sliding_window (vLLM's).
        context = loaded.config.context_length
        pool_tokens = max_model_len_that_fits(num_blocks, cache_cfg.block_size, context, kv_cache_groups,
                                              max_in_flight_tokens(sched_in.token_budget_ceiling,
                                                                   sched_in.async_scheduling))
        sched_cfg = self._scheduler_config(config, context, pool_tokens, loaded.config.context_length_key)
        cache_cfg = replace(cache_cfg, num_blocks=num_blocks)
        if len(kv_cache_groups) > 1:
            logger.info("%s mixes sliding-window and full-attention layers: %d KV cache groups of %d layers "
                        "(vLLM's hybrid KV cache manager; --disable-hybrid-kv-cache-manager keeps every block)",
                        loaded.config.architecture, len(kv_cache_groups), layers_per_block(kv_cache_groups))
        self.scheduler_config, self.cache_config = sched_cfg, cache_cfg
        # The KV cache the runner (or each worker) allocated: what reset_scheduler may use at most.
        self.kv_cache_held = (cache_cfg.block_size, cache_cfg.num_blocks)

        calibration = None
        if config.quantization == "int8":
            if self.tokenizer is None:
                raise ConfigError("quantization int8 calibrates its activation scales on text, which needs the "
                                  "tokenizer: drop skip_tokenizer_init or choose another quantization")
            from tokenloom.model.quant import calibration_token_ids

            calibration = calibration_token_ids(self.tokenizer, loaded.config.context_length)
        # Custom logits processors run where the model samples: built in the runner (each worker's under TP/PP).
        # Not with a pooling model or speculative decoding, where vLLM leaves installed entry points unloaded
        # (the processors given explicitly were refused above, and by EngineConfig).
        logitsprocs_config = None
        if self.runner_type != "pooling" and config.speculative_config is None:
            logitsprocs_config = logits_processor_config(config, path, loaded.config, sched_cfg, cache_cfg, dtype)
        if model_parallel > 1:
            if logitsprocs_config is not None:  # loaded here first (a bad name fails before the workers start)
                from tokenloom.sample.logits_processor import _load_custom_logitsprocs, fqcn

                self.logits_processor_names = [fqcn(c) for c in _load_custom_logitsprocs(config.logits_processors)]
            self.executor = _model_parallel_executor(config, path, dtype, device, sched_cfg,
                                                     block_size=cache_cfg.block_size, num_blocks=num_blocks,
                                                     kv_cache_groups=kv_cache_groups,
                                                     kv_cache_dtype=cache_cfg.cache_dtype,
                                                     calibration_token_ids=calibration,
                                                     logitsprocs_config=logitsprocs_config)
            self.runner = None  # the runners live in the worker processes
            self.dtype, self.device = dtype, device
        else:
            # Async scheduling: the runner in a worker thread, two steps in flight (engine/executor.py).
            self.executor = UniProcExecutor.from_config(config, loaded, worker_thread=sched_cfg.async_scheduling,
                                                        model_thread=self._model_thread,
                                                        block_size=cache_cfg.block_size,
                                                        num_blocks=num_blocks, dtype=dtype, device=device,
                                                        kv_cache_groups=kv_cache_groups,
                                                        kv_cache_dtype=cache_cfg.cache_dtype,
                                                        calibration_token_ids=calibration)
            self.runner = self.executor.runner  # the ModelRunner, for its KV cache shape and tests
            self.dtype, self.device = self.runner.dtype, self.runner.device
        del loaded
        if self.runner_type == "pooling":
            caching = self._pool_decoder(path, self.model_config, cache_cfg.enable_prefix_caching, overrides)
            cache_cfg = self.cache_config = replace(cache_cfg, enable_prefix_caching=caching)
        self.speculative_config = config.speculative_config
        if self.lora_config is not None:
            on_model_thread(self.runner.enable_lora, self.lora_config)
        # A KV connector (--kv-transfer-config, --kv-offloading-size): its scheduler side in the scheduler, its
        # worker side in the runner (tokenloom/engine/kv_connectors.py).
        self.kv_connector: Any = None
        if config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector is not None:
            self.kv_connector, self.runner.kv_connector = on_model_thread(
                make_kv_connectors, config, self.runner, path, len(kv_cache_groups), self.runner_type)
        if self.speculative_config is not None and self.runner is not None:  # (workers: enabled at start)
            on_model_thread(self.runner.enable_speculative_decoding, self.speculative_config, sched_cfg.max_model_len)
        if logitsprocs_config is not None and self.runner is not None:
            self.logits_processor_names = on_model_thread(self.runner.enable_logits_processors, logitsprocs_config,
                                                          config.logits_processors or ())
        self.reasoning_token_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (set with the manager)
        self.structured_output_manager = self._structured_output_manager()
        self.scheduler = self._new_scheduler()
        self.tracer = StepTracer(config.trace_steps) if config.trace_steps else None
        self.engine_core = EngineCore(self.scheduler, self.executor, self.tracer)
        if cache_cfg.enable_prefix_caching and cache_cfg.prefix_caching_hash_algo.startswith("xxhash"):
            # vLLM warns too: its seed is random then; tokenloom's root is fixed (core/block_hash.py root_seed).
            logger.warning("prefix_caching_hash_algo=%s is not collision resistant: prompts could be built whose "
                           "blocks share a hash, and one request be served another's KV. Use sha256 where tenants "
                           "do not trust each other, or set PYTHONHASHSEED to a private value.",
                           cache_cfg.prefix_caching_hash_algo)
        weight_bytes = getattr(getattr(self.runner, "model", None), "weight_bytes", lambda: 0)()
        if self.runner is None:  # worker processes: the ranks' shards together
            weight_bytes = sum(i["weight_bytes"] for i in getattr(self.executor, "worker_info", []))
        logger.info(
            "tokenloom engine ready in %.1f s: %s (%s) on %s, %s%s, weights %.0f MiB, %d KV blocks of %d tokens "
            "(%.0f MiB%s), max_model_len %d, %s%s", time.perf_counter() - t0, self.model_name, path.name,
            self.device, str(self.dtype).replace("torch.", ""),
            f" + {config.quantization} layers" if config.quantization else "", weight_bytes / 2**20, num_blocks,
            cache_cfg.block_size, num_blocks * block_bytes / 2**20,
            f", {cache_cfg.cache_dtype} KV" if cache_cfg.cache_dtype != "auto" else "", sched_cfg.max_model_len,
            token_budget_text(sched_cfg),
            ", async scheduling" if sched_cfg.async_scheduling else "",
        )

    def _init_encoder(self, config: EngineConfig, path: Any, clock: Callable[[], float],
                      overrides: Any = None) -> None:
        """A BERT-style encoder as a pooling model: the EncoderRunner (no KV cache), chunked prefill
        off (bidirectional attention: a prompt is computed in one step, as vLLM), prefix caching off,
        a block pool that only accounts for one step's tokens (requests finish in the step they run)."""
        from tokenloom.model.bert import load_bert
        from tokenloom.model.platform import resolve_device, resolve_dtype
        from tokenloom.model.pooler import resolve_pooler
        from tokenloom.model.pooling_runner import EncoderRunner
        from tokenloom.model.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        self.config = config
        self.clock = clock
        self._model_thread = None
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        bert_config, weights = load_bert(path, dtype, overrides)
        self.model_config = bert_config
        self.model_name = config.model or path.name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer_source)
        self.eos_token_id = None
        self.generation_defaults = load_generation_defaults(path.parent / "_none", "vllm", None)
        pooler = resolve_pooler(path, is_encoder=True, user=config.pooler_config)
        model_len = bert_config.max_positions
        st_len = sentence_bert_max_seq_length(path)
        if st_len:
            model_len = min(model_len, st_len)
        max_model_len = resolve_max_model_len(config, bert_config.max_positions, default=model_len)
        sched_in = config.scheduler or SchedulerConfig()
        sched_cfg = replace(sched_in, max_model_len=max_model_len, enable_chunked_prefill=False)
        cache_in = config.cache or CacheConfig()
        bs = cache_in.block_size
        num_blocks = cache_in.num_blocks or (-(-sched_cfg.token_budget_ceiling // bs) + sched_cfg.max_num_seqs + 1)
        cache_cfg = replace(cache_in, num_blocks=num_blocks, enable_prefix_caching=False, layer_windows=None)
        self.scheduler_config, self.cache_config = sched_cfg, cache_cfg
        # The KV cache the runner (or each worker) allocated: what reset_scheduler may use at most.
        self.kv_cache_held = (cache_cfg.block_size, cache_cfg.num_blocks)
        runner = EncoderRunner(path, pooler, block_size=bs, num_blocks=num_blocks, dtype=dtype, device=device,
                               loaded=(bert_config, weights))
        del weights
        self.executor = UniProcExecutor(runner)
        self.runner = runner
        self.dtype, self.device = runner.dtype, runner.device
        self.speculative_config = None
        self.scheduler = make_scheduler(sched_cfg, cache_cfg, clock=clock)
        self.structured_output_manager = StructuredOutputManager(lambda: None)
        self.reasoning_token_ids = None
        self.tracer = StepTracer(config.trace_steps) if config.trace_steps else None
        self.engine_core = EngineCore(self.scheduler, self.executor, self.tracer)
        tasks = ("classify", "token_classify") if bert_config.is_classifier else ("embed", "token_embed")
        self.pooling_info = build_pooling_info(
            pooler, config.pooler_config, tasks, bert_config.hidden_size, True, read_hf_config(path, overrides),
            num_labels=bert_config.num_labels, id2label=bert_config.id2label,
            is_cross_encoder=bert_config.is_classifier, served_model_name=self.model_name)
        logger.info("tokenloom pooling engine ready in %.1f s: %s (%s, %s) on %s, %s, %s pooling%s, task %s, "
                    "max_model_len %d, %s", time.perf_counter() - t0, self.model_name, bert_config.architecture,
                    path.name, self.device, str(self.dtype).replace("torch.", ""), pooler.seq_pooling_type.value,
                    " + normalize" if pooler.use_activation and not bert_config.is_classifier else "",
                    self.pooling_info.pooling_task, max_model_len, token_budget_text(sched_cfg))

    def _pool_decoder(self, path: Any, loaded_config: Any, prefix_caching: bool, overrides: Any = None) -> bool:
        """A decoder as an embedding model (--runner pooling / --convert embed), in the ModelRunner over
        its KV cache: LAST pooling by default (the final-norm hidden state of the prompt's last token);
        MEAN / CLS / ALL / STEP (--pooler-config, or the token_embed task) keep each chunk's rows until
        the prompt ends. Returns whether prefix caching stays on: only with LAST pooling and no
        token_embed task (a cached prefix has no hidden states to pool; vLLM keeps it for LAST)."""
        from tokenloom.model.pooler import PoolingType, resolve_pooler

        if self.convert != "embed":
            raise ConfigError("a decoder runs as a pooling model with --convert embed only")
        user = self.config.pooler_config
        pooler = resolve_pooler(path if path.is_dir() else path.parent / "_none", is_encoder=False, user=user)
        keep_prefix_caching = (prefix_caching and pooler.seq_pooling_type is PoolingType.LAST
                               and (user is None or user.task != "token_embed"))
        self.runner.pooler = pooler
        tasks = ("embed",) if keep_prefix_caching else ("embed", "token_embed")
        self.pooling_info = build_pooling_info(pooler, user, tasks, loaded_config.hidden_size, False,
                                               read_hf_config(path, overrides), served_model_name=self.model_name)
        return keep_prefix_caching

    def _structured_output_manager(self) -> StructuredOutputManager:
        """Grammars for structured outputs; the xgrammar backend is built on the first constrained
        request, in a compile thread (it reads the whole vocabulary: about 2 s)."""
        tokenizer, vocab_size = self.tokenizer, self.model_config.vocab_size
        so_config = self.config.structured_outputs_config
        if tokenizer is None:  # skip_tokenizer_init: no vocabulary to compile a grammar against
            return StructuredOutputManager(None)

        def backend() -> Any:
            from tokenloom.model.grammar import make_xgrammar_backend

            return make_xgrammar_backend(tokenizer, vocab_size, so_config)

        assert so_config is not None
        return StructuredOutputManager(backend, reasoner_factory=self._reasoner_factory(tokenizer, so_config),
                                       enable_in_reasoning=so_config.enable_in_reasoning)

    def _reasoner_factory(self, tokenizer: Any, so_config: StructuredOutputsConfig) -> Any:
        """The reasoning gate's parsers (vLLM's StructuredOutputManager builds them from the tokenizer, in every
        engine process): the plugin imported here too, the parser checked against the vocabulary once, now, so
        a parser whose tokens the model lacks stops the start in vLLM's words rather than the first request."""
        name = so_config.reasoning_parser
        if not name:
            return None
        from tokenloom.reasoning import check_reasoning_tokenizer, reasoning_token_ids, resolve_reasoning_parser

        try:
            parser_cls = resolve_reasoning_parser(name, so_config.reasoning_parser_plugin)
            check_reasoning_tokenizer(name, parser_cls, tokenizer, self.model_name)
        except (KeyError, ValueError) as exc:
            raise ConfigError(exc.args[0]) from None
        self.reasoning_token_ids = reasoning_token_ids(parser_cls(tokenizer), tokenizer)
        return lambda kwargs: parser_cls(tokenizer, **kwargs)

    @staticmethod
    def _layer_windows(model_config: Any) -> tuple[int | None, ...] | None:
        """Each layer's sliding window, or None when no layer has one (the KV cache groups follow:
        every layer windowed → one sliding group; mixed → hybrid groups, tokenloom/core/kv_cache_groups.py)."""
        windows = tuple(model_config.sliding_windows)
        return windows if any(w is not None for w in windows) else None

    # Sizing ---------------------------------------------------------------------------------
    @staticmethod
    def _num_blocks_for(config: EngineConfig, device: Any, block_bytes: int) -> int:
        budget = config.kv_cache_memory
        if budget is None:
            if device.type == "cuda":
                import torch

                free, total = torch.cuda.mem_get_info(device)
                budget = cuda_kv_budget(free, total, config.gpu_memory_utilization)
            else:
                if config.gpu_memory_utilization is not None:
                    logger.info("gpu_memory_utilization applies to CUDA devices; on CPU the KV pool is "
                                "--kv-cache-memory's (%d MiB)", DEFAULT_CPU_KV_BYTES >> 20)
                budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory={budget} bytes holds no KV block ({block_bytes} bytes each); give it more memory"
            )
        return num_blocks

    @staticmethod
    def _scheduler_config(config: EngineConfig, model_max_len: int, pool_tokens: int,
                          model_max_len_key: str = "max_position_embeddings") -> SchedulerConfig:
        sched = config.scheduler or SchedulerConfig()
        max_model_len = resolve_max_model_len(config, model_max_len,
                                              default=sched_max_len_default(config, model_max_len, pool_tokens),
                                              key=model_max_len_key)
        if config.max_model_len is None and max_model_len < model_max_len:
            # vLLM's default is the model's whole context; ours stops at 8,192 and what the pool holds: the
            # start-up log says so, or a long prompt's refusal would be the first a user hears of it.
            how = (f"--max-model-len raises it, up to {pool_tokens} with this KV pool" if pool_tokens > max_model_len
                   else "the KV pool holds no longer request: a larger --kv-cache-memory and --max-model-len raise it")
            logger.info("max_model_len %d by default; the model's context is %d (%s)",
                        max_model_len, model_max_len, how)
        return replace(sched, max_model_len=max_model_len)  # SchedulerConfig checks it against its knobs

    def lora_info(self) -> dict[str, Any] | None:
        """What a front end checks an adapter against (EngineReady.lora), or None without LoRA."""
        manager = getattr(self.runner, "lora_manager", None) if self.lora_config is not None else None
        if manager is None:
            return None
        return {"max_loras": self.lora_config.max_loras, "max_lora_rank": self.lora_config.max_lora_rank,
                "max_cpu_loras": self.lora_config.max_cpu_loras,
                "num_layers": manager.num_layers, "target_shapes": dict(manager.target_shapes)}

    def engine_ready(self, load_time_s: float) -> EngineReady:
        """What a front end needs to know of this engine core (the engine process sends it once loaded)."""
        return EngineReady(
            model_name=self.model_name,
            max_model_len=self.scheduler_config.max_model_len,
            num_blocks=self.cache_config.num_blocks or 0,
            block_size=self.cache_config.block_size,
            eos_token_id=self.eos_token_id,
            vocab_size=self.model_config.vocab_size,
            dtype=str(self.dtype).replace("torch.", ""),
            device=str(self.device),
            load_time_s=load_time_s,
            quantization=self.config.quantization,
            sampling_defaults=dict(self.generation_defaults.params),
            extra_eos_token_ids=list(self.generation_defaults.eos_token_ids),
            kv_cache_group_windows=[g.sliding_window for g in self.scheduler.kv_cache_manager.kv_cache_groups],
            max_in_flight_tokens=self.scheduler.kv_cache_manager.max_in_flight_tokens or 0,
            token_budget=token_budget_labels(self.scheduler_config),
            pooling=self.pooling_info,
            lora=self.lora_info(),
            logits_processors=list(self.logits_processor_names),
            num_speculative_tokens=self.speculative_config.num_speculative_tokens if self.speculative_config else 0,
            reasoning_token_ids=self.reasoning_token_ids,
            custom_histogram_buckets=self.config.custom_histogram_buckets,
            kv_cache_dtype=(str(self.dtype).replace("torch.", "") if self.cache_config.cache_dtype == "auto"
                            else self.cache_config.cache_dtype),
        )

    def reset_scheduler(
        self,
        scheduler_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """A fresh scheduler (new knobs, empty prefix cache) over the same loaded model, for
        benchmarks that compare configurations side by side without reloading weights."""
        if not self.scheduler.has_unfinished_requests():
            self.engine_core.drain()  # async scheduling: a trailing step may still be in flight
        if self.engine_core.has_unfinished_requests():
            raise RuntimeError("reset_scheduler needs an idle engine")
        cache_config = cache_config or self.cache_config
        # Against what the runner allocated at start-up, not the previous reset's (smaller) config: a benchmark
        # may shrink the pool and grow it back.
        block_size, num_blocks = self.kv_cache_held
        if cache_config.block_size != block_size or (cache_config.num_blocks or 0) > (num_blocks or 0):
            raise ConfigError(
                f"the runner's KV cache has {num_blocks} blocks of {block_size} tokens; "
                "a new scheduler can use fewer blocks, not other sizes"
            )
        self.scheduler_config = scheduler_config or self.scheduler_config
        check_verification_budget(self.scheduler_config.token_budget_ceiling, self.speculative_config)
        self.cache_config = cache_config
        self.clock = clock or self.clock
        self.executor.reset()
        if self.runner is None:  # worker processes (TP/PP): their executor's batch queue stays as built
            if self.scheduler_config.async_scheduling != self.executor.async_scheduling:
                raise ConfigError("a tensor/pipeline-parallel engine keeps the async scheduling it was built with")
        elif self.scheduler_config.async_scheduling != (self.executor.max_concurrent_batches > 1):
            # Sync <-> async on the same loaded model. An engine built for async keeps its model thread
            # in both modes (sync steps run there one at a time); one built sync moves the runner into
            # a worker thread of the executor's own, which then has a second OpenMP team (slower
            # barriers on a small machine: build the engine with async scheduling to measure it).
            self.executor.shutdown()
            self.executor = UniProcExecutor(self.runner, worker_thread=self.scheduler_config.async_scheduling,
                                            model_thread=self._model_thread)
        self.scheduler = self._new_scheduler()
        self.engine_core = EngineCore(self.scheduler, self.executor, self.tracer)

    def _new_scheduler(self) -> Scheduler:
        """A scheduler over this engine's configs with the parts the engine owns attached (the LoRA limits,
        the KV connector's scheduler side, the grammars): at start-up and on every reset_scheduler."""
        scheduler = make_scheduler(self.scheduler_config, self.cache_config, clock=self.clock,
                                   speculative_config=self.speculative_config)
        scheduler.lora_config = self.lora_config
        scheduler.connector = getattr(self, "kv_connector", None)  # an encoder engine has none
        scheduler.structured_output_manager = self.structured_output_manager
        return scheduler

    def close(self) -> None:
        self.engine_core.drain()
        self.executor.shutdown()
        for side in (getattr(self, "kv_connector", None), getattr(self.runner, "kv_connector", None)):
            if side is not None:
                side.shutdown()
        if self._model_thread is not None:
            self._model_thread.shutdown()
        self.structured_output_manager.clear_backend()
        if self.tracer is not None:
            self.tracer.close()


def _call_here(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


@dataclass
class _ConfigOnly:
    """The engine process's view of a checkpoint whose weights the worker processes load."""

    config: Any


def check_model_parallel(config: EngineConfig) -> None:
    """Refuse, before loading, what tensor / pipeline parallelism does not combine with yet."""
    parallel = config.parallel
    assert parallel is not None
    if config.device == "cuda":
        raise ConfigError("tensor/pipeline parallelism runs on CPU worker processes here; use --device cpu")
    # What the worker processes do not build yet (docs/parallelism.md).
    for given, what in ((config.lora_config is not None, "LoRA adapters (--enable-lora)"),
                        (config.kv_transfer_config is not None,
                         "a KV connector (--kv-transfer-config, --kv-offloading-size)")):
        if given:
            raise ConfigError(f"tensor/pipeline parallelism does not combine with {what} yet; run it with "
                              "-tp 1 -pp 1")
    if parallel.pipeline_parallel_size > 1:
        sched = config.scheduler
        if sched is not None and sched.async_scheduling:
            raise ConfigError("--pipeline-parallel-size > 1 cannot be combined with --async-scheduling yet: the "
                              "pipeline keeps its own batches in flight, one per stage, each with other requests "
                              "(docs/parallelism.md); async scheduling runs with tensor parallelism")
        if config.speculative_config is not None:
            raise ConfigError("--pipeline-parallel-size > 1 cannot be combined with speculative decoding yet (the "
                              "drafts are proposed on the last stage only); use tensor parallelism")


def logits_processor_config(config: EngineConfig, path: Any, model_config: Any, sched_cfg: SchedulerConfig,
                            cache_cfg: CacheConfig, dtype: Any) -> Any:
    """What the engine's custom logits processors get as vLLM's `vllm_config` (tokenloom/sample/logits_processor,
    LogitsProcessorConfig): the scheduler, cache and parallel configs in force and the model's vocabulary."""
    from tokenloom.config import ParallelConfig
    from tokenloom.sample.logits_processor import LogitsProcessorConfig, ProcessorModelConfig

    model = ProcessorModelConfig(model=str(path), vocab_size=model_config.vocab_size,
                                 max_model_len=sched_cfg.max_model_len, dtype=str(dtype).removeprefix("torch."),
                                 seed=config.seed)
    return LogitsProcessorConfig(model_config=model, scheduler_config=sched_cfg, cache_config=cache_cfg,
                                 parallel_config=config.parallel or ParallelConfig(),
                                 structured_outputs_config=config.structured_outputs_config)


def _model_parallel_executor(config: EngineConfig, path: Any, dtype: Any, device: Any, sched_cfg: SchedulerConfig,
                             logitsprocs_config: Any = None, **runner_kwargs: Any) -> Any:
    """The MultiprocExecutor over tensor_parallel_size x pipeline_parallel_size worker processes (the
    RayExecutor's Ray actors with --distributed-executor-backend ray)."""
    from tokenloom.engine.multiproc_executor import MultiprocExecutor
    from tokenloom.engine.ray_executor import RayExecutor
    from tokenloom.engine.worker import WorkerInit

    parallel = config.parallel
    assert parallel is not None
    if parallel.pipeline_parallel_size > 1:
        runner_kwargs["kv_cache_groups"] = None  # each stage's one group of its own layers
    processors = None  # None: the workers build no custom logits processors
    if logitsprocs_config is not None:
        from tokenloom.sample.logits_processor import fqcn_for_another_process

        # By name: each worker is a fresh interpreter that imports them (and runs no script of the user's).
        processors = [fqcn_for_another_process(p, allow_main=False) for p in config.logits_processors or ()]
    inits = [WorkerInit(rank=r, tensor_parallel_size=parallel.tensor_parallel_size,
                        pipeline_parallel_size=parallel.pipeline_parallel_size, dist_init_method="",
                        model_path=str(path), dtype=str(dtype).removeprefix("torch."), device=str(device),
                        quantization=config.quantization, seed=config.seed, runner_kwargs=dict(runner_kwargs),
                        speculative_config=config.speculative_config, max_model_len=sched_cfg.max_model_len,
                        log_level=logging.getLevelName(logger.getEffectiveLevel()),
                        logits_processors=processors, logits_processors_config=logitsprocs_config,
                        model_overrides=model_overrides(config))
             for r in range(parallel.model_parallel_size)]
    executor_class = RayExecutor if parallel.distributed_executor_backend == "ray" else MultiprocExecutor
    return executor_class(inits, async_scheduling=sched_cfg.async_scheduling)


def resolve_model_overrides(config: EngineConfig, path: Any) -> EngineConfig:
    """The config with hf_overrides as a dict, what every load applies (a callable is run once, here, on the
    model's Hugging Face config: model/hf_overrides.py), and load_format checked against the model path."""
    check_load_format(config.load_format, path)
    if not callable(config.hf_overrides):
        return config
    from tokenloom.model.loader import resolve_hf_overrides

    try:
        return replace(config, hf_overrides=resolve_hf_overrides(config.hf_overrides, path))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def model_overrides(config: EngineConfig) -> Any:
    """The ModelOverrides the loads apply (hf_overrides resolved to a dict, disable_sliding_window), or None."""
    from tokenloom.model.hf_overrides import ModelOverrides

    assert not callable(config.hf_overrides), "resolve_model_overrides first"
    return ModelOverrides.of(config.hf_overrides, config.disable_sliding_window)


def check_load_format(load_format: str, path: Any) -> None:
    """vLLM's load_format against what the model path holds: gguf names a .gguf file, hf / safetensors a Hugging
    Face directory (auto: whichever it is)."""
    if load_format == "gguf" and not path.is_file():
        raise ConfigError(f"load_format 'gguf' needs a .gguf model file; {path} is a Hugging Face directory")
    if load_format in ("hf", "safetensors") and path.is_file():
        raise ConfigError(f"load_format {load_format!r} reads a Hugging Face directory's safetensors; {path.name} is "
                          "a GGUF file (load_format 'auto' or 'gguf')")


def check_batch_invariant(config: EngineConfig) -> None:
    """Refuse, before loading, what VLLM_BATCH_INVARIANT=1 does not cover (the model's own checks follow at
    load: tokenloom/model/execution_plan.py, check_batch_invariant_covered)."""
    if not envs.VLLM_BATCH_INVARIANT:
        return
    parallel = config.parallel
    for given, what in ((config.lora_config is not None,
                         "LoRA adapters (--enable-lora): an adapter's rows run per op, beside the fused decoder"),
                        (parallel is not None and parallel.model_parallel_size > 1,
                         "tensor / pipeline parallelism (the fused decoder runs the whole stack in one process)"),
                        (config.device == "cuda", "--device cuda (it runs on CPU here)"),
                        (config.quantization == "int8",
                         "--quantization int8 (its W8A8 layers run per op, not in the fused decoder)")):
        if given:
            raise ConfigError(f"VLLM_BATCH_INVARIANT=1 does not cover {what}")


def check_speculative_engine(config: EngineConfig) -> None:
    """The engine's checks of speculative decoding against the scheduler knobs, before loading."""
    spec = config.speculative_config
    if spec is None:
        return
    sched = config.scheduler or SchedulerConfig()
    check_verification_budget(sched.token_budget_ceiling, spec)


def check_async_scheduling(config: EngineConfig) -> None:
    """Refuse what async scheduling does not run with, before minutes of loading."""
    sched = config.scheduler
    if sched is None or not sched.async_scheduling:
        return
    spec = config.speculative_config
    if spec is not None and spec.method == "suffix":
        # vLLM 0.32 (config/vllm.py:1563) refuses an explicit async scheduling with every proposer but
        # EAGLE/MTP/draft models/ngram_gpu/DSpark/DFlash; tokenloom runs n-gram's GPU-style variant only.
        raise ConfigError(
            "Currently, async scheduling is only supported with EAGLE/MTP/Draft Model/NGram GPU/DSpark/DFlash "
            "kind of speculative decoding: speculative_config.method 'suffix' cannot be combined with "
            "--async-scheduling (tokenloom also accepts 'ngram' there)"
        )
    if spec is not None and spec.adaptive:
        # The adaptive policy trims the drafts the scheduler receives after each step; under async
        # scheduling the scheduler receives none (the runner fills K placeholder drafts itself).
        raise ConfigError(
            "speculative_config.adaptive cannot be combined with --async-scheduling: under async scheduling "
            "the runner fills the drafts itself and the policy has nothing to trim; drop one of the two"
        )
