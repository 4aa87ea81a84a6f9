"""DecoderModel: the network of every decoder family, over one flattened batch of exactly the
scheduled tokens (no padding). The family's decoder-layer class comes from the registry
(tokenloom/model/models/registry.py); the blocks it is built of are tokenloom/model/layers.py's.

Weights come in with Hugging Face names and are rearranged once at load for speed: q/k/v fused
into one matrix (one GEMM instead of three), gate/up fused likewise, everything cast to the run
dtype and moved to the device.

The network is one decoder-layer class run in one loop; what varies lives in two seams:

* the linear method of each linear (tokenloom/model/linear.py): run-dtype GEMMs (oneDNN, weights
  pre-packed, for CPU bf16) or int8 W8A8 (tokenloom/model/quant.py). The method also produces its
  own input: the norm before a linear and the SiLU-and-mul before `down_proj` are the consuming
  linear's method's calls, so with the compiled kernels an int8 layer's activations cross memory as
  int8 rows and each GEMM's int32 result is scaled back inside the next fused kernel;
* the attention backend (tokenloom/model/attention_backends.py): rotary + KV write + paged
  attention in plain torch, or in the compiled CPU kernels (two fused calls per layer).

With the kernels a layer is four GEMMs plus five fused calls (rotary + KV-cache write, paged
attention, residual add + RMSNorm twice, SiLU-and-mul); without them (CUDA, or no compiler) the
same arithmetic runs as plain torch ops.

A new family is a new small class: a decoder layer whose attention adds q/k norms (Qwen3), whose
MLP is a mixture of experts, or whose norms differ (Gemma), in its own file under
tokenloom/model/models/ and named in the registry.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.distributed import get_pp_group, tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from tokenloom.model.attention import AttentionMetadata, KVCache
from tokenloom.model.attention_backends import TorchAttentionBackend, select_attention_backend
from tokenloom.model.config import ModelConfig
from tokenloom.model.execution_plan import PREPACK_LM_HEAD, PREPACK_NONE, ExecutionPlan
from tokenloom.model.layers import Hidden, RMSNorm, StepContext
from tokenloom.model.linear import (
    LinearBase,
    UnquantizedLinearMethod,
    dense,
    prepack_linears,
)
from tokenloom.model.models.registry import decoder_layer_class
from tokenloom.model.platform import return_freed_memory
from tokenloom.model.quant import check_quantization, get_linear_method
from tokenloom.model.rotary import RotaryEmbedding
from tokenloom.model.tp_shard import ShardInfo
from tokenloom.model.weight_reader import WeightReader, gguf_embedding

logger = logging.getLogger(__name__)


class DecoderModel:
    """The network. `forward` maps the step's tokens to final hidden states; `compute_logits`
    projects only the rows that sample."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        plan: ExecutionPlan,
        kernels: Any = None,
        calibration_token_ids: list[int] | None = None,
        calibration_threads: int | None = None,
        shard: ShardInfo | None = None,
    ) -> None:
        """`plan`: how this model runs here (tokenloom/model/execution_plan.py: device, dtype,
        quantization — None, "int8" for W8A8 layers, "gguf" for GGUF blocks kept quantized; the LM head
        stays in the run dtype —, oneDNN pre-packing, the fused decode step); the model follows it and
        keeps, as `self.plan`, the plan it ran (a failed pre-packing changes it: see `_prepack`).
        `kernels`: the compiled CPU kernels module (tokenloom.model.kernels.cpu_kernels()), or None.
        `calibration_token_ids`: text whose activations set int8's smoothing factors
        (without it the int8 layers are not smoothed); `calibration_threads`: torch threads for that
        forward (compute-bound, unlike the rest of loading; default: the current setting). `shard`: this
        rank's place under tensor / pipeline parallelism (the config and weights are already its cut:
        tokenloom/model/tp_shard.py); None: the whole model."""
        device, dtype, quantization = plan.device, plan.dtype, plan.quantization
        check_quantization(quantization, device)
        layer_cls = decoder_layer_class(config.architecture)
        if quantization == "int8" and not layer_cls.int8_supported:
            raise ValueError(f"quantization={quantization!r} is not implemented for {config.architecture} "
                             "(the MoE experts have no int8 path yet); run it unquantized")
        self.config = config
        self.shard = shard or ShardInfo(vocab_size=0)
        self.device = device
        self.kernels = kernels if self.device.type == "cpu" else None
        self.dtype = dtype
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        # What the model runs; loading may change it (_fall_back_for_unsupported_attention, _prepack).
        self.plan = plan
        self.attn_backend = select_attention_backend(self.kernels, self.num_q_heads, self.num_kv_heads,
                                                     self.head_dim, self.device)
        # Everything loads in the run dtype; quantization converts the decoder layers' linears after.
        # The final norm and the LM head stay here: the forward returns run-dtype hidden states.
        self.dense_method = UnquantizedLinearMethod(self.kernels)
        # --quantization gguf: the loader left the GGUF's quantized matrices as GGUFWeight blocks; the
        # reader turns them into linears of the GGUF method (tokenloom/model/gguf_method.py).
        gguf_method = get_linear_method("gguf", self.kernels) if quantization == "gguf" else None
        get = WeightReader(weights, self.device, dtype, gguf_method, row_parallel=self.shard.tp_size > 1)
        self.embed_tokens = get.raw_or_converted("model.embed_tokens.weight")
        self.norm = RMSNorm(get("model.norm.weight") + layer_cls.norm_weight_offset, config.rms_norm_eps)
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = get.linear(["lm_head"], self.dense_method, "lm_head", bias=False)
        elif isinstance(self.embed_tokens, torch.Tensor):  # tied: the same tensor
            self.lm_head = LinearBase(self.embed_tokens, None, self.dense_method, "lm_head", dtype)
        else:  # tied GGUF blocks: the head repacks them for its kernels, the embedding then reads that copy
            self.lm_head = get.linear(["model.embed_tokens"], self.dense_method, "lm_head", bias=False)
            head = getattr(self.lm_head, "gguf", None)
            if head is not None and len(head.parts) == 1 and head.parts[0].packed8:
                self.embed_tokens = head.parts[0]  # one copy of the blocks, not two
        if getattr(self.lm_head, "gguf", None) is not None:
            # Its kernels sum in fp32: the logits keep those sums (compute_logits), not a bf16 rounding of them.
            self.lm_head.out_dtype = torch.float32
        self.layers = [layer_cls(config, get, f"model.layers.{i}.", self.dense_method, layer_idx=i)
                       for i in range(config.num_hidden_layers)]
        self._fall_back_for_unsupported_attention()
        if self.kernels is not None and layer_cls.torch_ops:
            logger.info("%s: no fused CPU kernel yet for %s; they run as torch ops", config.architecture,
                        ", ".join(layer_cls.torch_ops))
        self.rope = RotaryEmbedding(config, self.device, dtype)
        # Gemma 3: the sliding layers rotate with their own base (rope_local_base_freq), unscaled.
        self.local_rope = None if config.rope_local_base_freq is None else RotaryEmbedding(
            replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None), self.device, dtype)
        # Gemma: the embeddings are scaled by sqrt(hidden_size), rounded to the run dtype (as HF).
        self.embed_scale = (torch.tensor(config.hidden_size**0.5, dtype=dtype, device=self.device)
                            if config.architecture.startswith("gemma") else None)
        self.quantization = quantization
        # Small all-decode steps run the whole stack in one compiled call (fused_decode.py); set below,
        # since int8 calibration runs forward before.
        self.fused_step: Any = None
        # LoRA (tokenloom/model/lora_layers.py): the punica wrapper the target linears share; a step
        # with an adapter row runs per op (the fused step has no LoRA), base-only steps stay fused.
        self.lora_punica: Any = None
        if quantization == "int8":
            from tokenloom.model.smoothquant import quantize_model

            quantize_model(self, quantization, calibration_token_ids, calibration_threads)
        if plan.fused_decode and quantization == "gguf":
            self.fused_step = _fused_decode_step(self)
        self.packed_linear = self._prepack()
        if self.plan.fused_decode and self.fused_step is None:
            # The layer linears stay plain: the fused step reads them, F.linear runs the bigger steps.
            self.fused_step = _fused_decode_step(self)
        logger.info("%s", self.plan.describe())
        if self.packed_linear:
            return_freed_memory()  # the plain weights the packed copies replaced
        self.head_kernels = self._dense_head_kernels()

    def _prepack(self) -> bool:
        """Pre-pack the run-dtype linears the plan names for oneDNN. True if they were packed. Where
        packing fails (a private torch API, checked on the first linear), the weights stay plain and
        the plan becomes the one without packing (the fused decode step where it covers the model)."""
        if self.plan.prepack == PREPACK_NONE:
            return False
        linears = [self.lm_head] if self.plan.prepack == PREPACK_LM_HEAD else self.dense_linears()
        if prepack_linears(linears):
            return True
        from tokenloom.model.gguf_kernels import gguf_kernels

        self.plan = self.plan.without_packing(fused_decode_available=gguf_kernels() is not None)
        return False

    def _dense_head_kernels(self) -> Any:
        """The GGUF kernels module when the LM head is a plain bf16 matrix (oneDNN could not pack it):
        its dense kernel (bf16 -> fp32 by a shift, FMA) runs the logits GEMV 1.7x (one row) to 5x
        (16 rows) faster than F.linear's bf16 path on AVX2 (benchmarks/kernels/fused_float_decode.py). None
        otherwise (packed or float32 heads stay on oneDNN, which measured as fast or faster), except when
        batch-invariant: the dense kernel sums a row in the same order at every row count, oneDNN's GEMMs
        need not, so a float32 head takes it too."""
        head = self.lm_head
        dtypes = (torch.bfloat16, torch.float32) if self.plan.batch_invariant else (torch.bfloat16,)
        if (self.device.type != "cpu" or self.kernels is None or head.packed is not None or head.bias is not None
                or head.weight is None or head.weight.dtype not in dtypes or not head.weight.is_contiguous()
                or not isinstance(head.quant_method, UnquantizedLinearMethod)):
            return None
        from tokenloom.model.gguf_kernels import gguf_kernels

        return gguf_kernels()

    def _fall_back_for_unsupported_attention(self) -> None:
        """The fused kernel has no sliding window or soft-capping yet: such models run the torch
        attention backend (the linears keep the kernels), and the log says so."""
        specs = {layer.self_attn.spec for layer in self.layers}
        unsupported = [s for s in specs if not self.attn_backend.supports(s)]
        if unsupported:
            logger.warning("%s: the fused CPU attention kernel has no sliding window / soft-capping (%s); "
                           "attention runs on the torch path", self.config.architecture, unsupported[0])
            self.attn_backend = TorchAttentionBackend(self.num_q_heads, self.num_kv_heads, self.head_dim,
                                                      self.device)
            self.plan = self.plan.with_torch_attention()

    @property
    def kv_packed(self) -> bool:
        """The KV cache holds the kernels' packed bf16 layout (set by the runner, which allocates it)."""
        return bool(getattr(self.attn_backend, "kv_packed", False))

    def linears(self) -> list[LinearBase]:
        """Every linear: the decoder layers', then the LM head."""
        return [lin for layer in self.layers for lin in layer.linears().values()] + [self.lm_head]

    def dense_linears(self) -> list[LinearBase]:
        """The run-dtype linears (all of them, or with int8 layers just the LM head)."""
        return [lin for lin in self.linears() if isinstance(lin.quant_method, UnquantizedLinearMethod)]

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size if self.shard.tp_size > 1 else self.embed_tokens.shape[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows in the run dtype (a fresh tensor). Vocab-parallel (TP): each rank looks up
        the ids in its slice, zero rows for the others, and one all-reduce sums the ranks' rows."""
        if self.shard.tp_size > 1:
            local = input_ids - self.shard.vocab_start
            outside = (local < 0) | (local >= self.shard.vocab_per_rank)
            rows = self._embed_rows(local.masked_fill(outside, 0))
            rows.masked_fill_(outside.unsqueeze(1), 0)
            return tensor_model_parallel_all_reduce(rows)
        return self._embed_rows(input_ids)

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, torch.Tensor):
            return F.embedding(input_ids, self.embed_tokens)
        return gguf_embedding(self.embed_tokens, input_ids, self.dtype)

    def weight_bytes(self) -> int:
        """Bytes the weights take (GGUF blocks counted as stored)."""
        seen: dict[int, int] = {}
        tensors: list[torch.Tensor] = [self.embed_tokens] if isinstance(self.embed_tokens, torch.Tensor) \
            else [self.embed_tokens.data]
        tensors.append(self.norm.weight)
        for layer in self.layers:
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for lin in self.linears():
            quantized = (getattr(lin, name, None) for name in ("qweight", "qweight_lo", "qweight_packed"))
            tensors += [t for t in (lin.weight, lin.bias, lin.packed, *quantized) if t is not None]
            gguf = getattr(lin, "gguf", None)
            if gguf is not None:
                tensors += [p.data for p in gguf.parts]
        for t in tensors:
            try:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # opaque (oneDNN pre-packed) tensors have no storage
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[KVCache] | list[None],
        max_position: int | None = None,
    ) -> torch.Tensor | None:
        """input_ids/positions [T] -> final-norm hidden states [T, H] (with attn_metadata.output_rows:
        of those rows only). Writes this step's K/V. `attn_metadata`: one for every layer, or one per
        layer (hybrid KV cache groups: each layer reads its group's block tables).

        Pipeline parallel: a stage after the first receives the previous stage's (MLP output, residual
        stream) instead of embedding; a stage before the last sends its own to the next stage and
        returns None (only the last stage has hidden states to project)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        per_layer = attn_metadata if isinstance(attn_metadata, list) else None
        if per_layer is not None:
            attn_metadata = per_layer[0]
        lora = self.lora_punica if self.lora_punica is not None and self.lora_punica.active else None
        if per_layer is None and lora is None and self.fused_step is not None and not self.kv_packed:
            # The fused step reads the plain KV layout, and applies no LoRA adapter.
            h = self.fused_step.run_step(input_ids, positions, attn_metadata, kv_caches, self.rope, max_position)
            if h is not None:
                return h
        backend = self.attn_backend
        ctx = StepContext(positions, backend.rope_tables(self.rope, positions, max_position), attn_metadata, backend,
                          lora=lora)
        if self.local_rope is not None:
            ctx.local_rope_tables = backend.rope_tables(self.local_rope, positions, max_position)
        hidden: Hidden | None = None
        if self.shard.pp_first:
            h = self.embed(input_ids)  # the residual stream, updated in place
            if self.embed_scale is not None:
                h = h * self.embed_scale
        else:  # the previous stage's [MLP output | residual], one message
            width = self.config.hidden_size
            both = get_pp_group().recv((input_ids.shape[0], 2 * width), self.dtype, self.shard.pp_rank - 1)
            hidden, h = both[:, :width].contiguous(), both[:, width:].contiguous()
        last = len(self.layers) - 1 if self.shard.pp_last else -1  # narrowing to output rows: the model's end
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if per_layer is not None:
                ctx.attn_metadata = per_layer[i]
            hidden, h = layer(hidden, h, ctx, kv_cache, i == last)
            if hidden is None:  # no output rows: the last layer's K/V writes were the work
                return h
        if not self.shard.pp_last:
            assert hidden is not None
            get_pp_group().send(torch.cat([dense(hidden), h], dim=1), self.shard.pp_rank + 1)
            return None
        return self.norm(hidden, h, self.dense_method)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Hidden states of the sampling rows [S, H] -> logits [S, V]: fp32, or with `fp32=False` whatever
        the head computed (the run dtype from oneDNN; fp32 from the GGUF and bf16-head kernels, which sum
        in fp32). Never rounded to bf16 after an fp32 sum: bf16 keeps 8 bits, so two logits near 16 less than
        0.0625 apart would tie (then the lower token id wins the argmax) or swap; and the greedy path and the
        sampler's (`fp32=True`, requests with logprobs) see the same values."""
        if self.head_kernels is not None and hidden.shape[0] > 0:
            logits = torch.empty(hidden.shape[0], self.lm_head.weight.shape[0])
            self.head_kernels.dense_linear(logits, hidden.float().contiguous(), self.lm_head.weight, None)
        else:  # a GGUF head's out_dtype is fp32 (set where the head is built)
            logits = self.lm_head(hidden)
        if self.shard.tp_size > 1:  # vocab-parallel head: every rank's slice, cut back to the vocabulary
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.shard.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if fp32 else logits


def _fused_decode_step(model: DecoderModel) -> Any:
    """The fused decode step over the model's own linears: GGUF blocks, or plain float32 / bf16
    weights (shared, not copied). Built where the plan says so (it checked the kernels and the
    family)."""
    from tokenloom.model.fused_decode import DecoderLayerSpec, FusedDecodeStep, build_decoder, linear_parts
    from tokenloom.model.gguf_kernels import gguf_kernels

    kernels = gguf_kernels()
    assert kernels is not None and model.kernels is not None, "the plan chose the fused step without its kernels"
    step = FusedDecodeStep(None, model.config.hidden_size, model.dtype, model.plan.fused_decode_rows,
                           every_row=model.plan.batch_invariant)

    def parts(lin: LinearBase) -> list:
        return linear_parts(getattr(lin, "gguf", None), lin.weight, lin.bias)

    specs = [DecoderLayerSpec(layer.input_layernorm.weight, parts(layer.self_attn.qkv_proj),
                              parts(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
                              parts(layer.mlp.gate_up_proj), parts(layer.mlp.down_proj)) for layer in model.layers]
    step.decoder = build_decoder(kernels, model.config, model.embed_tokens, model.norm.weight, specs)
    return step
