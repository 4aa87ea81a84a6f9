"""ModelRunner: turns a SchedulerOutput into one forward pass + sampling, keeping per-request state.

The runner owns the network, the paged KV cache and, per request, its token ids (prompt + outputs
it sampled itself), block table, sampling params and generator. Each step:

  1. drop state of finished / preempted requests, add (or replace) the new and resumed ones,
     extend block tables of the cached ones;
  2. lay out the scheduled tokens as one flat batch in the order the model's attention backend
     asks for (tokenloom/model/attention_backends.py: the torch backend puts decodes first,
     grouped by context length, then prefill chunks; the kernel backend keeps scheduler order),
     build input ids, positions, KV slots and block tables with numpy in bulk, and let the backend
     build its attention metadata from them;
  3. run the model, project only the rows that sample (a chunk that stops short of its sequence's
     end samples nothing), sample, append the sampled tokens to each request's state.

A request whose inputs are invalid (token id outside the vocabulary, block table too short, ...)
is reported in `ModelRunnerOutput.failed` (and listed in req_ids with no tokens), its state dropped,
and left out of the batch; errors inside the forward propagate to the engine.

Debugging: `execute_model(so, return_logits=True)` keeps the step's fp32 logits of the sampling
rows in `last_logits` (row of a request: `last_logits_index[req_id]`); off by default, it costs
nothing then.

CPU kernels: when tokenloom/model/kernels.py can build/load the compiled kernels (the default on
CPU; `cpu_kernels=False` or TOKENLOOM_CPU_KERNELS=0 turn them off), the step runs the fused path
(see tokenloom/model/decoder_model.py and attention.py): inputs are laid out in scheduler order with one
block-table row per sequence (no decode grouping, masks or key biases), the KV cache is left
uninitialised (nothing unwritten reaches a result) and, for bf16, stored in the kernels' packed
layout; the last layer runs attention, o-proj and MLP for the sampling rows only; all-greedy
batches take the kernels' argmax of the head's own logits (fp32 from the GGUF / bf16-head kernels, bf16
from oneDNN's bf16 GEMM), the values the sampler's fp32 path sees too.

Threads (CPU): torch intra-op threads = usable cores (2 here; oneDNN GEMMs scale with them),
inter-op threads = 1 (nothing runs concurrently); OMP_NUM_THREADS overrides. On an oversubscribed
machine 2 OpenMP threads can be much slower than 1 (every op waits at a barrier for a descheduled
thread): give the engine its cores, or set OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenloom.config import resolve_kv_cache_dtype
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec, make_kv_cache_groups
from tokenloom.core.outputs import ModelRunnerOutput, NewRequestData, SampleLogprobs, SchedulerOutput
from tokenloom.model.attention import (
    AttentionMetadata,
    CommonAttentionMetadata,
    allocate_kv_cache,
    kv_storage_dtype,
)
from tokenloom.model.attention_backends import CpuKernelAttentionBackend, TorchAttentionBackend
from tokenloom.model.config import ModelConfig
from tokenloom.model.decoder_model import DecoderModel
from tokenloom.model.execution_plan import plan_execution
from tokenloom.model.input_batch import InputBatch
from tokenloom.model.platform import (
    configure_cpu_threads,
    keep_freed_memory_in_process,
    resolve_device,
    resolve_dtype,
    single_threaded,
)
from tokenloom.model.sampler import (
    BatchProcessors,
    GrammarRows,
    Sampler,
    SamplerOutput,
    SamplingRow,
    all_plain_greedy,
    apply_grammar_bitmask,
    make_generator,
)
from tokenloom.model.spec_runner import DraftTokenIds, SpecDecodeRunner, verification_input_ids
from tokenloom.model.thinking_budget import ThinkingBudget
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- per-request state


@dataclass
class _RequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far (its own sampled tokens appended)
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]  # one block table per KV cache group
    params: SamplingParams
    generator: torch.Generator | None
    # Tokens whose KV this runner wrote and kept (prompt + accepted outputs, all but the last
    # sampled token). The scheduler's num_computed_tokens can be ahead of it by the drafts a step
    # still in flight will reject (async scheduling with drafts: it counts them optimistically).
    num_computed: int = 0
    pooling_params: Any = None  # a pooling request: pooled at its prompt's end instead of sampled
    # A pooling request that needs every prompt row (MEAN, CLS, ALL, STEP): its chunks' hidden states.
    pooling_rows: list = field(default_factory=list)
    lora_request: Any = None  # its LoRA adapter (tokenloom/lora/request.py); None: the base model
    # Its outputs so far, appended with token_ids: the live list custom logits processors hold (vLLM's
    # output_token_ids; a resumed request's starts with the outputs it had). None: the engine runs none.
    output_token_ids: list[int] | None = None
    # Its thinking_token_budget's tracker (tokenloom/model/thinking_budget.py); None without a budget.
    thinking: ThinkingBudget | None = None

    def append_outputs(self, tokens: list[int]) -> None:
        """A step's sampled (or, pipeline parallel, received) tokens: the sequence grows, and its KV is computed
        up to the last one (a rejected draft's KV is overwritten later)."""
        self.token_ids.extend(tokens)
        if self.output_token_ids is not None:
            self.output_token_ids.extend(tokens)
        self.num_computed = len(self.token_ids) - 1


def _thinking_budget(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int) -> ThinkingBudget | None:
    """A request's thinking_token_budget tracker (its ids filled in by the engine's input processor)."""
    if params.thinking_token_budget is None or params._thinking_token_ids is None:
        return None
    start_ids, end_ids = params._thinking_token_ids
    return ThinkingBudget(params.thinking_token_budget, start_ids, end_ids, token_ids, num_prompt_tokens)


@dataclass
class _Scheduled:
    state: _RequestState
    start: int  # num_computed_tokens before this step
    num_tokens: int
    drafts: list[int] = field(default_factory=list)  # draft tokens to verify (the last scheduled rows)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end == len(self.state.token_ids) + len(self.drafts)

    @property
    def input_ids(self) -> list[int]:
        if self.drafts:
            return verification_input_ids(self.state.token_ids, self.start, self.num_tokens, self.drafts)
        return self.state.token_ids[self.start : self.end]


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    max_position: int
    attn: AttentionMetadata
    # Hybrid KV cache groups: each layer's metadata (its group's block tables); None: `attn` for all.
    layer_attn: list[AttentionMetadata] | None
    sample_indices: torch.Tensor  # rows of the flat batch whose logits are needed
    sample_reqs: list[_RequestState] = field(default_factory=list)
    # prompt_logprobs: (request, first prompt token scored, flat-batch rows whose logits score it and on).
    prompt_rows: list[tuple[_RequestState, int, np.ndarray]] = field(default_factory=list)
    # Speculative decoding: the drafts each sampling request verifies (its 1 + d output rows).
    sample_drafts: list[list[int]] | None = None
    # Each scheduled request's rows in the flat batch: (state, first row, rows), in batch order.
    row_spans: list[tuple[_RequestState, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: Any = None,
        *,
        block_size: int = 16,
        num_blocks: int,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        cpu_kernels: bool | None = None,
        quantization: str | None = None,
        calibration_token_ids: list[int] | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`model`: a LoadedModel (anything with .config and .weights), or a path / None for the
        loader (None: the default SmolLM2-135M-Instruct GGUF).

        `cpu_kernels`: run the compiled CPU kernels (tokenloom/model/kernels.py). None (default):
        on CPU when they build/load, else the pure-torch path; False: always the torch path; True:
        require them (raises if they are unavailable).

        `quantization`: None, or "int8" for W8A8 decoder layers (tokenloom/model/quant.py), smoothed
        with the activations of `calibration_token_ids` when given (the engine passes
        tokenloom/data/calibration.txt).

        `kv_cache_groups`: the scheduler's KV cache groups (tokenloom/core/kv_cache_groups.py); each
        layer reads its group's block table. None: one group of every layer.

        `kv_cache_dtype`: "auto" (the run dtype), "bfloat16" / "float16" (K and V stored in that type under
        any run dtype) or "int8" (int8 values + float32 scales per token and kv head), read by every
        attention path (tokenloom/model/attention.py, docs/kv_cache.md)."""
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if kv_cache_dtype != "int8" and kv_storage_dtype(self.dtype, kv_cache_dtype) == self.dtype:
            kv_cache_dtype = "auto"  # the run dtype named: the cache every path (packed layout included) knows
        self.kv_cache_dtype = kv_cache_dtype
        if self.device.type == "cpu":
            configure_cpu_threads()
            keep_freed_memory_in_process()
        if not (hasattr(model, "config") and hasattr(model, "weights")):
            from tokenloom.model.loader import load_model, resolve_model_path

            model = load_model(resolve_model_path(model), self.dtype)
        self.model_config: ModelConfig = model.config
        kernels = None
        if cpu_kernels is not False and self.device.type == "cpu":
            from tokenloom.model.kernels import cpu_kernels as load_cpu_kernels

            kernels = load_cpu_kernels()
        if cpu_kernels and kernels is None:
            raise RuntimeError("cpu_kernels=True but the compiled CPU kernels are unavailable (see the log)")
        shard = getattr(model, "shard", None)
        # Every choice of execution path that a step's shape does not decide, made once here.
        plan = plan_execution(model.config, self.device, self.dtype, quantization, kernels,
                              sharded=shard is not None and shard.sharded, block_size=block_size,
                              kv_cache_dtype=kv_cache_dtype)
        if plan.quantized_kernels or plan.fused_decode:
            from tokenloom.model.gguf_kernels import gguf_kernels

            gk = gguf_kernels()
            if plan.quantized_kernels:
                gk.set_weight_prefetch_stages(plan.gguf_prefetch_stages)
            # Process-wide, as the prefetch stages: the engine that loads last in a process sets it. The kernels
            # read it (Q8_0's one-row tile), and so does GGUFLinear (no GEMM or dequantizing crossover).
            gk.set_batch_invariant(plan.batch_invariant)
        threads = torch.get_num_threads()
        with single_threaded():  # memory-bound copies: a second thread only adds OpenMP waits
            self.model = DecoderModel(model.config, model.weights, plan, kernels=kernels,
                                      calibration_token_ids=calibration_token_ids, calibration_threads=threads,
                                      shard=shard)
        self.use_kernels = kernels is not None
        # The attention backend the model runs; it builds each step's metadata.
        self.attn_backend = self.model.attn_backend
        if isinstance(self.attn_backend, CpuKernelAttentionBackend):
            # The kernels' packed bf16 KV layout where the plan (as the model ran it) chose it.
            self.attn_backend.kv_packed = self.model.plan.kv_packed
        self.vocab_size = self.model.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache_groups = list(kv_cache_groups or make_kv_cache_groups(None, model.config.num_hidden_layers))
        if len(self.kv_cache_groups) > 1 and not isinstance(self.attn_backend, TorchAttentionBackend):
            raise ValueError("hybrid KV cache groups need the torch attention backend (their layers have windows)")
        # Layer i reads the block table of group layer_group[i].
        self.layer_group = [0] * model.config.num_hidden_layers
        for g, group in enumerate(self.kv_cache_groups):
            for layer in group.layer_ids:
                self.layer_group[layer] = g
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, self.dtype, self.device,
                                           zeroed=self.attn_backend.zeroed_kv_cache,
                                           kv_cache_groups=self.kv_cache_groups, cache_dtype=kv_cache_dtype)
        self.sampler = Sampler()
        self.requests: dict[str, _RequestState] = {}
        # Pipeline parallel, a stage before the last: the sampling states of each step (by step index)
        # whose tokens the last stage has not handed back yet (receive_pipeline_tokens).
        self.num_steps = 0
        self.pipeline_unsynced: dict[int, list[_RequestState]] = {}
        # Speculative decoding (enable_speculative_decoding): proposer + rejection sampler.
        self.spec_decode: SpecDecodeRunner | None = None
        # Debug: fp32 logits of the sampling rows of the last step run with return_logits=True.
        self.last_logits: torch.Tensor | None = None
        self.last_logits_index: dict[str, int] = {}
        # A pooling engine over a decoder (--runner pooling): its ResolvedPooler (LAST pooling); the
        # requests that reach their prompt's end are pooled, not sampled (tokenloom/model/pooler.py).
        self.pooler: Any = None
        # LoRA adapters (enable_lora): the manager of their slots; None: requests run the base model.
        self.lora_manager: Any = None
        # The worker side of a KV connector (tokenloom/kv_transfer, role WORKER), set by the engine: it loads
        # blocks before the forward and saves them after, as the step's kv_connector_metadata says.
        self.kv_connector: Any = None
        # Custom logits processors (enable_logits_processors) and the persistent batch whose rows they see;
        # without processors it keeps no rows and costs nothing.
        self.input_batch = InputBatch()

    def enable_lora(self, lora_config: Any) -> None:
        """Serve LoRA adapters (tokenloom/lora/): a LoRALinear on every target linear, the slot manager.
        `lora_config`: tokenloom.config.LoRAConfig."""
        from tokenloom.model.lora_layers import create_lora_manager

        self.lora_manager = create_lora_manager(self.model, lora_config)

    def add_lora(self, lora_request: Any) -> bool:
        """Load and check an adapter into the host cache (vLLM's add_lora); raises ValueError saying why
        it cannot run. Safe from another thread than the one running steps."""
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (enable_lora=True)")
        self.lora_manager.add_adapter(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.lora_manager.list_adapters()) if self.lora_manager is not None else set()

    def kv_cache_block_views(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor a KV block lives in, with its block axis: a KV connector copies a block's bytes
        through these (tokenloom/kv_transfer/block_copy.py). Each layer's K and V ([heads, blocks, block
        size, head dim]); a KV cache that adds tensors per block (int8 values + scales) lists them here."""
        return [(t, 1) for layer in self.kv_caches for t in layer]

    def enable_speculative_decoding(self, config, max_model_len: int) -> None:
        """Verify drafts in the flattened batch and propose drafts (n-gram or suffix) after each step."""
        self.spec_decode = SpecDecodeRunner(config, max_model_len)
        for rid, state in self.requests.items():
            self.spec_decode.add_request(rid, state.token_ids, state.num_prompt_tokens)

    def enable_logits_processors(self, vllm_config: Any, custom_logitsprocs: Sequence[Any]) -> list[str]:
        """Build the engine's custom logits processors here (vLLM's build_logitsprocs, in the runner's process):
        `vllm_config` a LogitsProcessorConfig, `custom_logitsprocs` classes or "module:Class" names (installed
        entry points load too). Returns the built classes' names, for the front end's validate_params. A
        pooling runner refuses processors given explicitly (vLLM's words) and loads none."""
        from tokenloom.sample.logits_processor import build_logitsprocs, processor_names

        logitsprocs = build_logitsprocs(vllm_config, self.device, self.device.type == "cuda",
                                        self.pooler is not None, custom_logitsprocs)
        self.input_batch = InputBatch(logitsprocs)
        return processor_names(logitsprocs)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (vLLM's post_step hands them to the scheduler)."""
        return self.spec_decode.take_draft_token_ids() if self.spec_decode is not None else None

    # ----------------------------------------------------------------------- the step

    def execute_model(self, scheduler_output: SchedulerOutput, return_logits: bool = False) -> ModelRunnerOutput:
        connector = self.kv_connector
        if connector is None or scheduler_output.kv_connector_metadata is None:
            return self._execute_model(scheduler_output, return_logits)
        # Whole-step KV transfers (vLLM's connector hooks around the forward; a CPU forward is one call,
        # so there is no layer to overlap with): the step's loads first, its saves after.
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            connector.start_load_kv()
            out = self._execute_model(scheduler_output, return_logits)
            connector.wait_for_save()
            out.kv_connector_output = connector.build_connector_worker_output()
        finally:
            connector.clear_connector_metadata()
        return out

    def _execute_model(self, scheduler_output: SchedulerOutput, return_logits: bool = False) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        step_index, self.num_steps = self.num_steps, self.num_steps + 1
        failed = self._update_states(scheduler_output)
        scheduled = self._collect_scheduled(scheduler_output, failed)
        if self.input_batch.enabled:
            self._update_input_batch(scheduler_output, scheduled)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[SampleLogprobs]] = {}
        prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]] = {}
        pooled: dict[str, Any] = {}
        if scheduled and self.pooler is not None:
            self._run_pooling(self._prepare_inputs(scheduled), pooled)
        elif scheduled:
            inputs = self._prepare_inputs(scheduled)
            self._run(inputs, sampled, logprobs, return_logits, prompt_logprobs,
                      grammar_rows(scheduler_output, inputs.sample_reqs, inputs.sample_drafts))
            if self.model.shard.pp_size > 1 and not self.model.shard.pp_last and inputs.sample_reqs:
                self.pipeline_unsynced[step_index] = list(inputs.sample_reqs)
        if self.spec_decode is not None:
            self.spec_decode.propose(sampled, [r for r in scheduler_output.num_scheduled_tokens if r not in failed])
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=logprobs or None,
            prompt_logprobs=prompt_logprobs or None,
            failed=failed,
            execute_time=time.perf_counter() - t0,
            pooler_output=pooled or None,
        )

    def _run_pooling(self, inputs: _StepInputs, pooled: dict[str, Any]) -> None:
        """A decoder as a pooling model. LAST: the last row of each prompt that ends this step. Pooling
        that reads every row (MEAN, CLS, ALL, STEP, token_* tasks): each chunk's rows are kept until
        the chunk that ends the prompt, then pooled together (the engine turns prefix caching off for
        these: a cached prefix has no hidden states). A chunk that stops short pools nothing."""
        from tokenloom.model.pooler import PoolingType
        from tokenloom.model.pooling_runner import pool_request

        def needs_rows(state: _RequestState) -> bool:
            task = state.pooling_params.task or "embed"
            return self.pooler.pooling_type_for(task) is not PoolingType.LAST

        for state, _, _ in inputs.row_spans:
            if state.pooling_params is None:
                raise RuntimeError(f"request {state.req_id!r} is a generation request in a pooling engine")
        keep = [span for span in inputs.row_spans if needs_rows(span[0])]
        if keep:
            for meta in [inputs.attn, *(inputs.layer_attn or [])]:
                if getattr(meta, "output_rows", None) is not None:
                    meta.output_rows = None  # every row's last-layer output, as prompt_logprobs asks
                    meta.output_kernel = None
        with torch.inference_mode():
            hidden = self.model.forward(
                inputs.input_ids, inputs.positions, inputs.layer_attn or inputs.attn, self.kv_caches,
                inputs.max_position
            )
            for state, first, n in keep:
                state.pooling_rows.append(hidden[first : first + n].float().clone())
            if not inputs.sample_reqs:
                return
            last = hidden
            if last.shape[0] != inputs.sample_indices.shape[0]:
                last = last.index_select(0, inputs.sample_indices)
            for state, row in zip(inputs.sample_reqs, last):
                if needs_rows(state):
                    rows = torch.cat(state.pooling_rows)
                    state.pooling_rows = []
                    if rows.shape[0] != state.num_prompt_tokens:
                        raise RuntimeError(f"request {state.req_id!r}: {rows.shape[0]} rows kept for a "
                                           f"{state.num_prompt_tokens}-token prompt")
                else:
                    rows = row.unsqueeze(0)
                pooled[state.req_id] = pool_request(rows, state.token_ids, state.pooling_params, self.pooler)

    def _run(
        self,
        inputs: _StepInputs,
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[SampleLogprobs]],
        return_logits: bool,
        prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]] | None = None,
        grammar: GrammarRows | None = None,
    ) -> None:
        with torch.inference_mode():
            hidden = self.model.forward(
                inputs.input_ids, inputs.positions, inputs.layer_attn or inputs.attn, self.kv_caches,
                inputs.max_position
            )
            if hidden is None:  # a pipeline stage before the last: it sent its activations on
                return
            if inputs.prompt_rows and prompt_logprobs is not None:
                prompt_logprobs.update(self._prompt_logprobs(hidden, inputs.prompt_rows))
            if not inputs.sample_reqs:
                return
            if hidden.shape[0] != inputs.sample_indices.shape[0]:  # else: exactly the sampling rows, in order
                hidden = hidden.index_select(0, inputs.sample_indices)
            rows = [SamplingRow(s.params, s.token_ids, s.num_prompt_tokens, s.generator,
                                s.thinking.forced_token(s.token_ids) if s.thinking is not None else None)
                    for s in inputs.sample_reqs]
            if inputs.sample_drafts is not None:
                self._run_verification(inputs, hidden, rows, sampled, logprobs, return_logits, grammar)
                return
            processors = self._step_processors(inputs.sample_reqs)
            if (not return_logits and self.model.kernels is not None and all_plain_greedy(rows)
                    and (processors is None or not processors.non_argmax_invariant)):
                # The kernels' argmax of the head's own logits (compute_logits(fp32=False): no cast):
                # the same tokens as the sampler's argmax of them in fp32, without the fp32 copy of
                # bf16 ones (torch's bf16 argmax is ~10x slower).
                logits = self.model.compute_logits(hidden, fp32=False)
                if grammar is not None:
                    apply_grammar_bitmask(logits, grammar)
                token_ids = self.model.kernels.argmax_rows(logits)
                nan_rows = token_ids < 0
                if bool(nan_rows.any()):
                    token_ids[nan_rows] = logits[nan_rows].float().argmax(dim=-1)
                out = SamplerOutput(token_ids=token_ids.tolist(), logprobs=None)
            else:
                logits = self.model.compute_logits(hidden)
                out = self.sampler(logits, rows, grammar, processors)
        if return_logits:
            self.last_logits = logits
            self.last_logits_index = {s.req_id: i for i, s in enumerate(inputs.sample_reqs)}
        for i, (state, token) in enumerate(zip(inputs.sample_reqs, out.token_ids)):
            state.append_outputs([token])
            sampled[state.req_id] = [token]
            if out.logprobs is not None and out.logprobs[i] is not None:
                logprobs[state.req_id] = [out.logprobs[i]]

    def receive_pipeline_tokens(self, steps: list[tuple[int, dict[str, list[int]]]]) -> None:
        """Pipeline parallel, a stage before the last: the tokens the last stage sampled in earlier steps
        (step index, req_id -> tokens), which are this stage's inputs when it next runs those requests.
        They come with a later step's message (vLLM sends them in the scheduler output for the same
        reason) rather than by a broadcast at the end of each step, which would hold this stage until the
        last one finished: with them deferred it runs the next micro-batch meanwhile. The engine core
        schedules a request again only after its step's output came back, so its tokens arrive first.
        They go to the states that sampled in that step (a request resumed since has a new state)."""
        for step_index, tokens in steps:
            for state in self.pipeline_unsynced.pop(step_index, ()):
                new = tokens.get(state.req_id)
                if new:
                    state.append_outputs(new)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt_rows: list[tuple[_RequestState, int, np.ndarray]]
    ) -> dict[str, tuple[int, list[SampleLogprobs]]]:
        """Log-probabilities of prompt tokens from the rows before them (hidden holds every row here)."""
        out: dict[str, tuple[int, list[SampleLogprobs]]] = {}
        for state, first, rows in prompt_rows:
            logits = self.model.compute_logits(hidden.index_select(0, self._to_device(rows)))
            lps = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(state.token_ids[first : first + len(rows)], dtype=torch.long, device=lps.device)
            chosen = lps.gather(1, targets.unsqueeze(1))
            ranks = (lps >= chosen).float().sum(dim=-1).long().tolist()
            n = state.params.prompt_logprobs or 0
            top_lp, top_ids = lps.topk(n, dim=-1) if n else (lps[:, :0], targets[:, None][:, :0])
            out[state.req_id] = (first, [
                SampleLogprobs(token_id=t, logprob=c, rank=r, top=list(zip(ids, vals)))
                for t, c, r, ids, vals in zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks,
                                              top_ids.tolist(), top_lp.tolist())
            ])
        return out

    @staticmethod
    def _prompt_rows(s: _Scheduled, offset: int) -> tuple[_RequestState, int, np.ndarray] | None:
        """Rows of this chunk whose logits score a prompt token (position p scores token p + 1)."""
        if s.state.params.prompt_logprobs is None:
            return None
        last = min(s.end, s.state.num_prompt_tokens - 1)  # positions start .. last - 1
        if last <= s.start:
            return None
        return s.state, s.start + 1, np.arange(offset, offset + last - s.start, dtype=np.int64)

    def _run_verification(self, inputs: _StepInputs, hidden: torch.Tensor, rows: list[SamplingRow],
                          sampled: dict[str, list[int]], logprobs: dict[str, list[SampleLogprobs]],
                          return_logits: bool, grammar: GrammarRows | None = None) -> None:
        """A batch with drafts: each sampling request has 1 + d output rows; the rejection sampler
        turns them into its accepted drafts plus one token."""
        assert self.spec_decode is not None and inputs.sample_drafts is not None
        token_ids, lps, logits = self.spec_decode.sample(
            lambda fp32: self.model.compute_logits(hidden, fp32=fp32), rows, inputs.sample_drafts,
            self.model.kernels, return_logits, grammar)
        if return_logits:
            self.last_logits = logits
            self.last_logits_index = {}
        for i, (state, tokens) in enumerate(zip(inputs.sample_reqs, token_ids)):
            state.append_outputs(tokens)
            sampled[state.req_id] = tokens
            if lps is not None and lps[i] is not None:
                logprobs[state.req_id] = lps[i]

    # ----------------------------------------------------------------------- custom logits processors

    def _update_input_batch(self, so: SchedulerOutput, scheduled: list[_Scheduled]) -> None:
        """The persistent batch's rows after this step's changes (tokenloom/model/input_batch.py), and each
        processor's update_state. A request that failed validation this step is left out, as unscheduled."""
        order = [new.req_id for new in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        self.input_batch.update(so.finished_req_ids, [s.state for s in scheduled], order)

    def _step_processors(self, sample_reqs: list[_RequestState]) -> BatchProcessors | None:
        """The custom processors for this step's sampled rows, or None when the engine runs none."""
        if not self.input_batch.enabled:
            return None
        return self.input_batch.sampling_rows([s.req_id for s in sample_reqs], self.device)

    # ----------------------------------------------------------------------- state updates

    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply the scheduler's bookkeeping; returns requests that failed validation."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.spec_decode is not None:
                self.spec_decode.remove_request(req_id)
        failed: dict[str, str] = {}
        for new in so.scheduled_new_reqs:
            error = self._add_request(new)
            if error:
                failed[new.req_id] = error
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            state = self.requests.get(req_id)
            if state is None:
                failed[req_id] = f"request {req_id!r} is scheduled as running but the runner has no state for it"
                continue
            error = self._check_block_ids(new_blocks)
            if error:
                failed[req_id] = error
                self.requests.pop(req_id)
                continue
            for table, blocks in zip(state.block_ids, new_blocks):
                table.extend(blocks)
        return failed

    def _add_request(self, new: NewRequestData) -> str | None:
        self.requests.pop(new.req_id, None)
        tokens = list(new.prefill_token_ids)
        if tokens:
            arr = np.asarray(tokens)
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                return f"token id out of range [0, {self.vocab_size}) in request {new.req_id!r}"
        error = self._check_block_ids(new.block_ids)
        if error:
            return error
        if new.lora_request is not None and self.lora_manager is None:
            return f"request {new.req_id!r} names a LoRA adapter, but the runner has LoRA disabled"
        params = new.sampling_params
        generator = make_generator(self.device) if params.seed is not None else None
        self.requests[new.req_id] = _RequestState(
            req_id=new.req_id,
            token_ids=tokens,
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=tuple(list(ids) for ids in new.block_ids),
            params=params,
            generator=generator,
            num_computed=new.num_computed_tokens,
            pooling_params=new.pooling_params,
            lora_request=new.lora_request,
            output_token_ids=tokens[len(new.prompt_token_ids):] if self.input_batch.enabled else None,
            thinking=_thinking_budget(params, tokens, len(new.prompt_token_ids)),
        )
        if self.spec_decode is not None:
            self.spec_decode.add_request(new.req_id, tokens, len(new.prompt_token_ids))
        return None

    def _check_block_ids(self, block_ids: Sequence[list[int]]) -> str | None:
        if len(block_ids) != len(self.kv_cache_groups):
            return f"{len(block_ids)} block tables for {len(self.kv_cache_groups)} KV cache groups"
        for ids in block_ids:
            if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
                return f"block id out of range [0, {self.num_blocks})"
        return None

    def _collect_scheduled(self, so: SchedulerOutput, failed: dict[str, str]) -> list[_Scheduled]:
        """The requests to run, in scheduler order, with their start positions; bad ones go to `failed`."""
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        starts.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        out: list[_Scheduled] = []
        for req_id, n in so.num_scheduled_tokens.items():
            if req_id in failed:
                continue
            state = self.requests.get(req_id)
            start = starts.get(req_id)
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id) or [])
            error = None
            if state is not None and start is not None:
                start, n, drafts, error = self._realign(state, start, n, drafts)
            error = error or self._check_scheduled(req_id, state, start, n, drafts)
            if error:
                failed[req_id] = error
                self.requests.pop(req_id, None)
                continue
            assert state is not None and start is not None
            out.append(_Scheduled(state, start, n, drafts))
            state.num_computed = start + n  # a sampling request moves it again after sampling
        return out

    def _realign(self, state: _RequestState, start: int, n: int, drafts: list[int]
                 ) -> tuple[int, int, list[int], str | None]:
        """The rows this request really runs, from what the scheduler decided without knowing
        the outputs still in flight (vLLM's gpu_model_runner does this on the GPU, on a copy of the
        SchedulerOutput: the scheduler's own copy keeps its counts).

        - Start: under async scheduling with drafts the scheduler counted the drafts of the step in
          flight as computed; the ones that step rejected are not. The runner knows how many: it ran
          that step. The tokens to compute (`n - len(drafts)`) are the same; they start earlier.
        - Placeholder drafts (-1): the AsyncScheduler schedules K of them per request (and vLLM pads
          a first decode with them); the runner fills them with the drafts it proposed from the
          request's tokens after its last step (vLLM's ngram_gpu) and trims the ones it has no
          draft for (`update_scheduler_for_invalid_drafts`), so no row verifies a fake token.
        """
        excess = start - state.num_computed
        if excess < 0 or (excess and self.spec_decode is None):
            return start, n, drafts, (f"request {state.req_id!r} is scheduled from token {start}, but the runner "
                                      f"has computed {state.num_computed}")
        if drafts and drafts[0] < 0:
            if any(t >= 0 for t in drafts):
                return start, n, drafts, f"request {state.req_id!r} mixes placeholder and real drafts"
            filled = self._placeholder_drafts(state, len(drafts))
            n -= len(drafts) - len(filled)
            drafts = filled
        elif any(t < 0 for t in drafts):
            # Real drafts padded with -1 where the grammar cut them (update_draft_token_ids_in_output):
            # verify the real ones only.
            real = next(i for i, t in enumerate(drafts) if t < 0)
            if any(t >= 0 for t in drafts[real:]):
                return start, n, drafts, f"request {state.req_id!r} has a real draft after a placeholder"
            n -= len(drafts) - real
            drafts = drafts[:real]
        return start - excess, n, drafts, None

    def _placeholder_drafts(self, state: _RequestState, num_slots: int) -> list[int]:
        """Drafts for a request's placeholder slots: its latest proposal, up to `num_slots`.
        A constrained request's placeholders stay empty: its bitmask rows were built over the
        placeholders, so drafts filled here would be verified against rows made for no draft (under
        async scheduling the engine core fills them, grammar-checked, before it builds the bitmask)."""
        if self.spec_decode is None or getattr(state.params, "structured_outputs", None) is not None:
            return []
        return self.spec_decode.latest_drafts(state.req_id)[:num_slots]

    def _check_scheduled(self, req_id: str, state: _RequestState | None, start: int | None, n: int,
                         drafts: list[int]) -> str | None:
        if state is None or start is None:
            return f"request {req_id!r} is scheduled but neither new nor cached in this step"
        if drafts and self.spec_decode is None:
            return "drafts were scheduled but speculative decoding is not enabled in the ModelRunner"
        if n < 1 or start < 0 or start + n > len(state.token_ids) + len(drafts):
            return f"cannot compute tokens [{start}, {start + n}) of a {len(state.token_ids)}-token sequence"
        if drafts and start + n != len(state.token_ids) + len(drafts):
            return f"drafts of request {req_id!r} must end its scheduled tokens"
        if any(t >= self.vocab_size for t in drafts):
            return f"draft token id out of range [0, {self.vocab_size}) in request {req_id!r}"
        held = min(len(table) for table in state.block_ids)
        if -(-(start + n) // self.block_size) > held:
            return f"{held} blocks cannot hold {start + n} tokens"
        return None

    # ----------------------------------------------------------------------- input preparation

    def _prepare_inputs(self, scheduled: list[_Scheduled]) -> _StepInputs:
        """Flat inputs in the attention backend's order; the backend builds its own metadata."""
        scheduled = self.attn_backend.reorder_batch(scheduled)
        bs = self.block_size
        n = len(scheduled)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=n)
        counts = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=n)
        q_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=q_start[1:])
        ends = starts + counts
        num_blocks = -(-ends // bs)
        # One block table per KV cache group (sliding groups hold block 0, the null block, where
        # their blocks left the window: the window mask hides those keys).
        group_tables = [np.zeros((n, int(num_blocks.max())), dtype=np.int32) for _ in self.kv_cache_groups]
        ids: list[int] = []
        for i, s in enumerate(scheduled):
            for tables, table in zip(group_tables, s.state.block_ids):
                tables[i, : num_blocks[i]] = table[: num_blocks[i]]
            if s.num_tokens == 1:
                ids.append(s.state.token_ids[s.start])
            else:
                ids.extend(s.input_ids)  # a verification chunk ends with its drafts
        total = int(q_start[-1])
        seq = np.repeat(np.arange(n), counts)
        pos = np.arange(total, dtype=np.int64) + np.repeat(starts - q_start[:-1], counts)
        samples = np.fromiter((s.samples for s in scheduled), dtype=bool, count=n)
        num_drafts = np.fromiter((len(s.drafts) for s in scheduled), dtype=np.int64, count=n)
        has_drafts = bool(num_drafts.any())
        commons = [
            CommonAttentionMetadata(
                query_start_loc=q_start, num_computed_tokens=starts, block_table=tables,
                slot_mapping=tables[seq, pos // bs].astype(np.int64) * bs + pos % bs,
                samples=samples, block_size=bs, num_drafts=num_drafts if has_drafts else None,
            )
            for tables in group_tables
        ]
        common = commons[0]
        attn = self.attn_backend.build_metadata(common)
        # Hybrid groups: each layer gets its group's metadata (the torch backend's; only its block
        # tables and slots differ between groups).
        group_attn = [attn] + [self.attn_backend.build_metadata(c) for c in commons[1:]]
        layer_attn = [group_attn[g] for g in self.layer_group] if len(group_attn) > 1 else None
        # Each sequence's last row samples (when the sequence reaches its end this step); one that
        # verifies d drafts samples from its last 1 + d rows.
        sample_rows = common.output_rows
        prompt_rows = [pr for i, s in enumerate(scheduled) if (pr := self._prompt_rows(s, int(q_start[i])))]
        if prompt_rows and attn.output_rows is not None:
            # prompt_logprobs need every row's last-layer output, not only the sampling rows'.
            attn.output_rows = None
            attn.output_kernel = None
        if attn.output_rows is not None:
            sample_idx = attn.output_rows  # the same rows (the backend built them from `samples`)
        else:
            sample_idx = self._to_device(sample_rows)
        input_ids = torch.tensor(ids, dtype=torch.int64)
        if self.lora_manager is not None:  # the slot of every row, for the target linears (tokenloom/lora/)
            self.lora_manager.set_step([s.state.lora_request for s in scheduled], counts)
        return _StepInputs(
            input_ids=input_ids if self.device.type == "cpu" else input_ids.to(self.device),
            positions=self._to_device(pos),
            max_position=int(ends.max()) - 1,
            attn=attn,
            layer_attn=layer_attn,
            sample_indices=sample_idx,
            sample_reqs=[s.state for s, smp in zip(scheduled, samples.tolist()) if smp],
            prompt_rows=prompt_rows,
            sample_drafts=[s.drafts for s, smp in zip(scheduled, samples.tolist()) if smp] if has_drafts else None,
            row_spans=[(s.state, int(q_start[i]), s.num_tokens) for i, s in enumerate(scheduled)],
        )

    # Bounds on the decodes sharing one padded attention call: the torch backend's (see
    # TorchAttentionBackend.split_decode_groups); the kernel backend has no decode groups.
    @property
    def decode_group_min(self) -> int | None:
        return getattr(self.attn_backend, "decode_group_min", None)

    @decode_group_min.setter
    def decode_group_min(self, value: int) -> None:
        if isinstance(self.attn_backend, TorchAttentionBackend):
            self.attn_backend.decode_group_min = value

    @property
    def decode_group_max(self) -> int | None:
        return getattr(self.attn_backend, "decode_group_max", None)

    @decode_group_max.setter
    def decode_group_max(self, value: int) -> None:
        if isinstance(self.attn_backend, TorchAttentionBackend):
            self.attn_backend.decode_group_max = value

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


def grammar_rows(so: SchedulerOutput, sample_reqs: list[Any],
                 sample_drafts: list[list[int]] | None = None) -> GrammarRows | None:
    """The step's grammar bitmask, paired with the logits rows it constrains (None: no constraint).
    With drafts, a request's 1 + d output rows each have their bitmask row (the scheduler made one per
    scheduled draft position and one more), in the same order. The runner may verify fewer drafts
    than were scheduled (placeholders it has no draft for, or -1 padding where the grammar cut them):
    the drafts it keeps are then a prefix of the scheduled ones, never a replacement (a constrained
    request's placeholders are not filled, `_placeholder_drafts`), so its first 1 + d rows are right."""
    if so.grammar_bitmask is None:
        return None
    width = [1 + len(d) for d in sample_drafts] if sample_drafts is not None else [1] * len(sample_reqs)
    first_row, at = {}, 0
    for state, n in zip(sample_reqs, width):
        first_row[state.req_id] = (at, n)
        at += n
    keep: list[int] = []  # bitmask rows
    rows: list[int] = []  # their logits rows
    b = 0
    for rid in so.structured_output_request_ids:
        n = 1 + len(so.scheduled_spec_decode_tokens.get(rid) or ())
        if rid in first_row:  # else: it failed validation this step and samples nothing
            start, width_here = first_row[rid]
            assert width_here <= n, f"{rid}: {n} bitmask rows for {width_here} output rows"
            keep += range(b, b + width_here)
            rows += range(start, start + width_here)
        b += n
    if not keep:
        return None
    bitmask = so.grammar_bitmask
    if len(keep) != bitmask.shape[0]:
        bitmask = bitmask[keep]
    return GrammarRows(bitmask=bitmask, rows=rows)
