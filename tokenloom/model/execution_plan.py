"""How the model runs on this machine, decided once at load time by one function.

Every choice between execution paths that does not depend on a step's shape is made here, from the
CPU's features, the run dtype, the quantization, the family and the overrides in tokenloom/envs.py
(the only place a TOKENLOOM_* variable is read), and logged once at start-up. TOKENLOOM_CPU_ISA caps
the features seen here (and the kernels' builds, and torch's) at a lower ISA: tokenloom/cpu_isa.py.

* weights: plain run-dtype linears ("float"), int8 W8A8 ("int8": oneDNN's int8 GEMM, or the CPU
  kernels' where the CPU has no VNNI / AMX-INT8), or GGUF blocks kept quantized ("gguf", run by the
  GGUF kernels' quantized GEMV / GEMM, or dequantized per call without them);
* which float linears oneDNN pre-packs: all, only the LM head, or none;
* the fused decode step (tokenloom/model/fused_decode.py): small all-decode steps in one compiled
  call, up to `fused_decode_rows` sequences;
* the KV cache layout: the CPU kernels' packed bf16 layout, or plain.

What does depend on the step stays where the step is seen: the fused step declines prefill and
mixed steps (FusedDecodeStep.run), a GGUF linear picks its kernel by row count
(tokenloom/model/gguf_weights.py), the attention backend is chosen from the layers' specs
(DecoderModel._fall_back_for_unsupported_attention).

One choice can only be made while loading: oneDNN's pre-packing is a private torch API, checked on
the first linear; when it fails, `DecoderModel` keeps the weights plain and takes the fused decode
step where it covers the model (`ExecutionPlan.without_packing`), and logs the plan it ran.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from tokenloom import cpu_isa, envs
from tokenloom.model.config import ModelConfig
from tokenloom.model.linear import packing_enabled
from tokenloom.model.platform import cpu_has_fast_int8

logger = logging.getLogger(__name__)

PREPACK_ALL, PREPACK_LM_HEAD, PREPACK_NONE = "all", "lm_head", "none"


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    dtype: torch.dtype
    quantization: str | None  # None, "int8" or "gguf" (--quantization, resolved)
    isa: str  # torch's CPU capability ("AVX2", "AVX512", "AVX512_BF16", "AMX", "DEFAULT"); "" off CPU
    isa_cap: str  # TOKENLOOM_CPU_ISA: "native", or the ISA every choice here was capped at ("avx2", ...)
    cpu_kernels: bool  # the compiled CPU kernels run norms, rotary + KV write, SiLU-and-mul
    # Attention through the compiled kernels' backend (else torch's: no kernels, or a layer with a
    # sliding window or soft-capping, which the model finds as it builds the layers: `with_torch_attention`).
    kernel_attention: bool
    quantized_kernels: bool  # GGUF weights: the GGUF kernels' quantized GEMV / GEMM (else dequantize per call)
    # How those kernels prefetch the weights they stream: 2 stages (L2, then L1), 1 (L1) or 0 (none, the
    # hardware prefetchers alone); by CPU vendor (gguf_prefetch_stages), applied to the kernels by the runner.
    gguf_prefetch_stages: int
    prepack: str  # which run-dtype linears oneDNN pre-packs: PREPACK_ALL, PREPACK_LM_HEAD or PREPACK_NONE
    fused_decode: bool  # small all-decode steps run the whole stack in one compiled call
    fused_decode_rows: int  # ... up to this many sequences (TOKENLOOM_FUSED_DECODE_ROWS)
    # The fused step could run this model (kernels, family, dtype, not sharded): where packing fails at
    # load, an unquantized model takes it instead.
    fused_decode_covered: bool
    # The packed bf16 KV layout is possible (bf16 cache, the kernels support the block size,
    # TOKENLOOM_KV_PACKED); it is used with the kernel attention backend when the fused step is not
    # (that reads the plain layout).
    kv_packed_supported: bool
    # VLLM_BATCH_INVARIANT: every row of every step runs the fused decoder's per-row arithmetic (no row
    # cap, prefill and verification rows too), the quantized linears keep their tile kernels at every row
    # count and the LM head one kernel, so a row's numbers do not depend on the step (docs/reproducibility.md).
    batch_invariant: bool = False
    # int8 W8A8: which GEMM runs the layers. "onednn": torch._int_mm, fast with VNNI or AMX-INT8;
    # "kernels": the CPU kernels' int8_gemm (exact int32 sums, AVX2 vpmaddubsw) where the CPU has neither
    # and oneDNN's int8 path runs ~20x slower than its float32 one.
    int8_gemm: str = "onednn"

    @property
    def weights(self) -> str:
        return {None: "float", "int8": "int8", "gguf": "gguf"}.get(self.quantization, str(self.quantization))

    @property
    def kv_packed(self) -> bool:
        """The KV cache holds the kernels' packed bf16 layout (where the kernel attention backend runs).
        Not with a fused decode step: it reads the plain layout, and with the packed one it would
        decline every step while its plain weights slow the per-op path."""
        return self.kernel_attention and self.kv_packed_supported and not self.fused_decode

    def with_torch_attention(self) -> ExecutionPlan:
        """The plan once a layer turned out to need the torch attention backend (window, soft-capping)."""
        return replace(self, kernel_attention=False)

    def without_packing(self, fused_decode_available: bool) -> ExecutionPlan:
        """The plan after oneDNN pre-packing failed at load: plain float weights, the fused decode step
        where it covers the model and could be built."""
        return replace(self, prepack=PREPACK_NONE,
                       fused_decode=self.fused_decode_covered and fused_decode_available)

    def describe(self) -> str:
        """One line for the start-up log."""
        weights = self.weights
        if self.quantization == "int8":
            weights += " (GEMM: CPU kernels' int8_gemm)" if self.int8_gemm == "kernels" else " (GEMM: oneDNN)"
        if self.quantization == "gguf":
            prefetch = (f"{self.gguf_prefetch_stages}-stage weight prefetch" if self.gguf_prefetch_stages
                        else "no software weight prefetch")
            weights += (f" (quantized GEMV/GEMM kernels, {prefetch})" if self.quantized_kernels
                        else " (dequantized per call)")
        fused = f"up to {self.fused_decode_rows} rows" if self.fused_decode else "off"
        if self.batch_invariant:
            fused = "every row (batch-invariant: VLLM_BATCH_INVARIANT)"
        cap = f" (capped: TOKENLOOM_CPU_ISA={self.isa_cap})" if self.isa_cap != cpu_isa.NATIVE else ""
        isa = f"{self.isa}{cap}, " if self.isa else ""
        return (f"execution plan: {self.device.type} {isa}{str(self.dtype).removeprefix('torch.')}, "
                f"weights {weights}, CPU kernels {'on' if self.cpu_kernels else 'off'}, "
                f"attention {'CPU kernels' if self.kernel_attention else 'torch'}, "
                f"oneDNN pre-packing {self.prepack}, fused decode step {fused}, "
                f"KV layout {'packed bf16' if self.kv_packed else 'plain'}")


def fused_stack_covers(config: ModelConfig) -> bool:
    """The fused stack is the Llama/Qwen2 layer (no q/k norms, windows, soft-capping, LongRoPE)."""
    rope = config.rope_scaling or {}
    return (config.architecture in ("llama", "qwen2") and not config.sliding_window
            and rope.get("rope_type", rope.get("type")) in (None, "default", "llama3"))


PREFETCH_STAGES = {"none": 0, "one-stage": 1, "two-stage": 2}  # TOKENLOOM_GGUF_PREFETCH's values


def gguf_prefetch_stages() -> int:
    """How many stages the GGUF tile kernels prefetch their weights in (csrc/gguf_kernels.cpp,
    prefetch_weights): TOKENLOOM_GGUF_PREFETCH, else 0 (none: the hardware prefetchers alone) on AMD and 2
    (L2, then L1) elsewhere. Measured (docs/performance.md, "The weight prefetch by CPU vendor" and "No
    software prefetch on AMD"): on Intel Xeons the L2 stage took 12-19 % off the decode step; on AMD Zen 4
    each stage dropped took time off (the L2 stage 5-10 %, then the L1 stage 7-16 % more wherever one
    core's stream is the limit, 1-4 % where the shared link is)."""
    choice = envs.TOKENLOOM_GGUF_PREFETCH
    if choice != "auto":
        return PREFETCH_STAGES[choice]
    return 0 if cpu_isa.this_cpu_vendor() == "AuthenticAMD" else 2


def with_engine_prefetch(module: ModuleType) -> ModuleType:
    """`module` (a build of the GGUF kernels' sources, e.g. a benchmark's A or B) set to prefetch weights as
    the engine's plan does on this machine; a build from before the choice existed keeps its own. The
    runner applies the plan itself."""
    if hasattr(module, "set_weight_prefetch_stages"):
        module.set_weight_prefetch_stages(gguf_prefetch_stages())
    return module


def plan_execution(config: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: str | None,
                   kernels: ModuleType | None, *, sharded: bool = False, block_size: int = 16,
                   kv_cache_dtype: str = "auto") -> ExecutionPlan:
    """The plan for this model on this machine. `kernels`: the compiled CPU kernels module, or None;
    `sharded`: tensor / pipeline parallel (the whole-stack decoder cannot all-reduce in its middle)."""
    on_cpu = device.type == "cpu"
    kernels = kernels if on_cpu else None
    torch_isa = torch.backends.cpu.get_cpu_capability() if on_cpu else ""
    if on_cpu:  # under TOKENLOOM_CPU_ISA torch's kernels must be capped too, or the proxy is not one
        cpu_isa.check_torch_capped(torch_isa)
    int8_gemm = "onednn"
    if quantization == "int8" and on_cpu and not cpu_has_fast_int8():
        if kernels is not None and hasattr(kernels, "int8_gemm"):
            int8_gemm = "kernels"
        else:
            logger.warning("--quantization int8 on a CPU without VNNI or AMX-INT8 and without the CPU kernels: "
                           "oneDNN's int8 GEMMs take a slow path here (slower than float32)")
    rows = envs.TOKENLOOM_FUSED_DECODE_ROWS
    covers = fused_stack_covers(config)
    packing = packing_enabled(device, dtype)
    quantized_kernels = quantization == "gguf" and _gguf_kernels_available()
    step_possible = kernels is not None and rows > 0 and covers and not sharded
    if quantization == "gguf":
        if not sharded and not covers:  # other families run their own layer loop over the same linears
            logger.info("%s: the fused decode step covers Llama/Qwen2 layers without windows or LongRoPE; "
                        "this model's layers run per op", config.architecture)
        covered = step_possible and quantized_kernels
        fused, prepack = covered, PREPACK_ALL if packing else PREPACK_NONE
    elif quantization is not None:  # int8: the decoder layers are W8A8, the LM head stays float
        covered, fused, prepack = False, False, PREPACK_ALL if packing else PREPACK_NONE
    else:
        covered = step_possible and dtype in (torch.float32, torch.bfloat16)
        if not covered:
            fused, prepack = False, PREPACK_ALL if packing else PREPACK_NONE
        elif packing and not envs.TOKENLOOM_FUSED_FLOAT:
            # One layout serves every batch size: oneDNN's packed copy is opaque, the fused step reads
            # plain [N, K] rows, and both would double the weights' memory. Packed GEMMs win the
            # batched float32 steps (docs/performance.md), so packing wins where it works.
            fused, prepack = False, PREPACK_ALL
        else:  # bf16 where oneDNN cannot pack, packing off, or TOKENLOOM_FUSED_FLOAT=1
            covered = covered and _gguf_kernels_available()  # the fused decoder is built by the GGUF kernels
            fused = covered
            prepack = PREPACK_LM_HEAD if packing and envs.TOKENLOOM_FUSED_FLOAT else PREPACK_NONE
    batch_invariant = envs.VLLM_BATCH_INVARIANT
    if batch_invariant:
        check_batch_invariant_covered(config, device, dtype, quantization, kernels, sharded=sharded,
                                      fused_kernels=quantized_kernels or (quantization is None
                                                                          and _gguf_kernels_available()))
        covered = fused = True
        prepack = PREPACK_NONE  # oneDNN picks its GEMM by row count; the fused decoder's kernels do not
    kv_packed_supported = bool(
        kernels is not None and dtype == torch.bfloat16
        and kv_cache_dtype == "auto"  # the packed layout is of bf16 elements
        and kernels.packed_layout_supported(block_size, config.head_dim)
        and envs.TOKENLOOM_KV_PACKED)
    return ExecutionPlan(
        device=device, dtype=dtype, quantization=quantization,
        isa=torch_isa, isa_cap=cpu_isa.cap_name() if on_cpu else cpu_isa.NATIVE,
        cpu_kernels=kernels is not None, kernel_attention=kernels is not None,
        quantized_kernels=quantized_kernels, gguf_prefetch_stages=gguf_prefetch_stages(), prepack=prepack,
        fused_decode=fused, fused_decode_rows=rows, fused_decode_covered=covered,
        kv_packed_supported=kv_packed_supported, batch_invariant=batch_invariant, int8_gemm=int8_gemm)


def check_batch_invariant_covered(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                                  quantization: str | None,
                                  kernels: ModuleType | None, *, sharded: bool, fused_kernels: bool) -> None:
    """Batch invariance runs every row through the fused decoder: refuse, with the reason, a model or
    machine it does not cover (rather than run a path whose rows depend on the batch)."""
    why = None
    if device.type != "cpu":
        why = f"it runs on CPU here (--device {device.type})"
    elif quantization == "int8":
        why = ("--quantization int8 (its W8A8 layers run per op, not in the fused decoder) is not covered: use a GGUF "
               "file or a float checkpoint")
    elif quantization is None and dtype not in (torch.float32, torch.bfloat16):
        why = f"--dtype {str(dtype).removeprefix('torch.')} is not covered: use float32 or bfloat16"
    elif sharded:
        why = "tensor / pipeline parallelism is not covered (the fused decoder runs the whole stack in one process)"
    elif not fused_stack_covers(config):
        why = (f"the fused decoder covers Llama / Qwen2 layers without sliding windows or LongRoPE, not this "
               f"{config.architecture} model")
    elif kernels is None or not fused_kernels:
        why = "the compiled CPU / GGUF kernels are unavailable (TOKENLOOM_CPU_KERNELS=0, or their build failed)"
    if why is not None:
        raise ValueError(f"VLLM_BATCH_INVARIANT=1: {why}")


def _gguf_kernels_available() -> bool:
    from tokenloom.model.gguf_kernels import gguf_kernels  # built on first use: only when a plan needs them

    return gguf_kernels() is not None
