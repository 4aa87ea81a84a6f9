"""The execution plan (tokenloom/model/execution_plan.py): the choice between the fused decode step,
oneDNN pre-packing, the packed KV layout and the GGUF kernels, made by one function at load from the
CPU's features, the dtype, the quantization, the family and the overrides in tokenloom/envs.py.

The CPU kernels, the GGUF kernels and oneDNN's packing are stood in for, so every branch runs on any
machine; tests/test_fused_float_decode.py and tests/test_gguf_decode.py run the real paths."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tokenloom.model import execution_plan
from tokenloom.model.config import ModelConfig
from tokenloom.model.execution_plan import PREPACK_ALL, PREPACK_LM_HEAD, PREPACK_NONE, plan_execution

CPU = torch.device("cpu")


def config(architecture: str = "llama", **kw) -> ModelConfig:
    return ModelConfig(architecture=architecture, vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw)


@pytest.fixture
def machine(monkeypatch):
    """A CPU with the compiled kernels (packed KV layout supported), the GGUF kernels and oneDNN packing;
    tests switch parts off through the returned namespace."""
    state = SimpleNamespace(packing=True, gguf_kernels=True, packed_layout=True)
    monkeypatch.setattr(execution_plan, "packing_enabled", lambda device, dtype: state.packing)
    monkeypatch.setattr(execution_plan, "_gguf_kernels_available", lambda: state.gguf_kernels)
    state.kernels = SimpleNamespace(packed_layout_supported=lambda block_size, head_dim: state.packed_layout)
    for name in ("TOKENLOOM_FUSED_FLOAT", "TOKENLOOM_FUSED_DECODE_ROWS", "TOKENLOOM_GGUF_FUSED_ROWS",
                 "TOKENLOOM_KV_PACKED", "TOKENLOOM_GGUF_PREFETCH", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    return state


def test_gguf_llama_takes_the_fused_decode_step(machine) -> None:
    plan = plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels)
    assert plan.weights == "gguf" and plan.quantized_kernels
    assert plan.fused_decode and plan.fused_decode_rows == 8 and plan.prepack == PREPACK_ALL
    assert not plan.kv_packed  # the fused step reads the plain layout
    assert "fused decode step up to 8 rows" in plan.describe() and "quantized GEMV/GEMM" in plan.describe()


@pytest.mark.parametrize("vendor, stages, described", [("AuthenticAMD", 0, "no software weight prefetch"),
                                                       ("GenuineIntel", 2, "2-stage weight prefetch"),
                                                       ("", 2, "2-stage weight prefetch")])
def test_the_weight_prefetch_follows_the_cpu_vendor(machine, monkeypatch, vendor, stages, described) -> None:
    monkeypatch.setattr(execution_plan.cpu_isa, "this_cpu_vendor", lambda: vendor)
    plan = plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels)
    assert plan.gguf_prefetch_stages == stages and described in plan.describe()
    for override, forced in (("none", 0), ("one-stage", 1), ("two-stage", 2)):
        monkeypatch.setenv("TOKENLOOM_GGUF_PREFETCH", override)
        assert plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels).gguf_prefetch_stages == forced
    monkeypatch.setenv("TOKENLOOM_GGUF_PREFETCH", "three-stage")
    with pytest.raises(ValueError, match="TOKENLOOM_GGUF_PREFETCH"):
        plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels)


def test_gguf_without_its_kernels_dequantizes_per_op(machine) -> None:
    machine.gguf_kernels = False
    plan = plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels)
    assert not plan.quantized_kernels and not plan.fused_decode
    assert "dequantized per call" in plan.describe()


@pytest.mark.parametrize("cfg", [config("qwen3"), config("mistral", sliding_window=8),
                                 config(rope_scaling={"rope_type": "longrope"})])
def test_layers_the_fused_stack_does_not_cover_run_per_op(machine, cfg, caplog) -> None:
    with caplog.at_level("INFO", logger="tokenloom.model.execution_plan"):
        plan = plan_execution(cfg, CPU, torch.float32, "gguf", machine.kernels)
    assert not plan.fused_decode and "this model's layers run per op" in caplog.text
    assert not plan_execution(cfg, CPU, torch.bfloat16, None, machine.kernels).fused_decode


def test_sharded_models_and_rows_zero_run_per_op(machine, monkeypatch) -> None:
    assert not plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels, sharded=True).fused_decode
    monkeypatch.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "0")
    assert not plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels).fused_decode


def test_without_cpu_kernels_nothing_fused_nor_packed_kv(machine) -> None:
    plan = plan_execution(config(), CPU, torch.bfloat16, None, None)
    assert not plan.cpu_kernels and not plan.kernel_attention and not plan.fused_decode and not plan.kv_packed
    assert plan.prepack == PREPACK_ALL


def test_a_float_model_packs_where_packing_works_else_fuses(machine, monkeypatch) -> None:
    plan = plan_execution(config(), CPU, torch.float32, None, machine.kernels)
    assert plan.prepack == PREPACK_ALL and not plan.fused_decode and plan.fused_decode_covered
    machine.packing = False  # e.g. bf16 on AVX2 without avx_ne_convert, or TOKENLOOM_PACKED_LINEAR=0
    plan = plan_execution(config(), CPU, torch.bfloat16, None, machine.kernels)
    assert plan.prepack == PREPACK_NONE and plan.fused_decode
    machine.packing = True
    monkeypatch.setenv("TOKENLOOM_FUSED_FLOAT", "1")  # plain layer weights even where packing works
    plan = plan_execution(config(), CPU, torch.float32, None, machine.kernels)
    assert plan.prepack == PREPACK_LM_HEAD and plan.fused_decode


def test_a_failed_prepacking_falls_back_to_the_fused_step(machine) -> None:
    plan = plan_execution(config(), CPU, torch.float32, None, machine.kernels)
    assert plan.without_packing(fused_decode_available=True).fused_decode
    assert plan.without_packing(fused_decode_available=True).prepack == PREPACK_NONE
    assert not plan.without_packing(fused_decode_available=False).fused_decode
    gemma = plan_execution(config("gemma2"), CPU, torch.float32, None, machine.kernels)
    assert not gemma.without_packing(fused_decode_available=True).fused_decode


@pytest.mark.parametrize("fast_int8, with_kernels, gemm", [(False, True, "kernels"), (True, True, "onednn"),
                                                          (False, False, "onednn")])
def test_int8_runs_the_kernel_gemm_only_without_vnni(machine, monkeypatch, fast_int8, with_kernels, gemm) -> None:
    """oneDNN's int8 GEMM on a CPU with VNNI / AMX-INT8; the CPU kernels' int8_gemm (exact, ~25x faster
    there) on one without; oneDNN's slow path, said in a warning, when the kernels are missing too."""
    monkeypatch.setattr(execution_plan, "cpu_has_fast_int8", lambda: fast_int8)
    machine.kernels.int8_gemm = lambda acc, x, wp: None
    plan = plan_execution(config(), CPU, torch.float32, "int8", machine.kernels if with_kernels else None)
    assert plan.int8_gemm == gemm
    assert ("int8_gemm" in plan.describe()) == (gemm == "kernels")
    assert plan_execution(config(), CPU, torch.float32, "gguf", machine.kernels).int8_gemm == "onednn"


def test_int8_layers_never_fuse(machine) -> None:
    plan = plan_execution(config(), CPU, torch.bfloat16, "int8", machine.kernels)
    assert plan.weights == "int8" and not plan.fused_decode and plan.prepack == PREPACK_ALL


def test_the_packed_kv_layout(machine, monkeypatch) -> None:
    plan = plan_execution(config("qwen3"), CPU, torch.bfloat16, None, machine.kernels)
    assert plan.kv_packed and "KV layout packed bf16" in plan.describe()
    assert not plan.with_torch_attention().kv_packed  # a layer with a window or soft-capping
    assert not plan_execution(config("qwen3"), CPU, torch.float32, None, machine.kernels).kv_packed
    assert not plan_execution(config("qwen3"), CPU, torch.bfloat16, None, machine.kernels,
                              kv_cache_dtype="int8").kv_packed
    machine.packed_layout = False  # no AVX512-BF16, or a block size the layout does not take
    assert not plan_execution(config("qwen3"), CPU, torch.bfloat16, None, machine.kernels).kv_packed
    machine.packed_layout = True
    monkeypatch.setenv("TOKENLOOM_KV_PACKED", "0")
    assert not plan_execution(config("qwen3"), CPU, torch.bfloat16, None, machine.kernels).kv_packed


def test_the_execution_overrides_are_read_only_by_the_planner() -> None:
    """The variables that pick an execution path are read in one module of the model room (linear.py's
    packing_enabled, which the planner calls, reads TOKENLOOM_PACKED_LINEAR)."""
    model_room = Path(execution_plan.__file__).parent
    readers = {}
    for path in model_room.rglob("*.py"):
        names = set(re.findall(r"envs\.(TOKENLOOM_FUSED_DECODE_ROWS|TOKENLOOM_FUSED_FLOAT|TOKENLOOM_KV_PACKED"
                               r"|TOKENLOOM_GGUF_PREFETCH)",
                               path.read_text(encoding="utf-8")))
        if names:
            readers[path.name] = names
    assert set(readers) == {"execution_plan.py"}, readers


@pytest.mark.parametrize("quantization, dtype", [("gguf", torch.float32), (None, torch.float32),
                                                 (None, torch.bfloat16)])
def test_batch_invariant_runs_every_row_fused_without_packing(machine, monkeypatch, quantization, dtype) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    plan = plan_execution(config(), CPU, dtype, quantization, machine.kernels)
    assert plan.batch_invariant and plan.fused_decode and plan.prepack == PREPACK_NONE and not plan.kv_packed
    assert "every row (batch-invariant" in plan.describe()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not plan_execution(config(), CPU, dtype, quantization, machine.kernels).batch_invariant


@pytest.mark.parametrize("case, match", [
    ("gemma", "covers Llama / Qwen2 layers .* not this gemma2 model"),
    ("window", "covers Llama / Qwen2 layers"),
    ("int8", "--quantization int8"),
    ("float16", "--dtype float16 is not covered"),
    ("sharded", "tensor / pipeline parallelism"),
    ("no kernels", "kernels are unavailable"),
    ("no gguf kernels", "kernels are unavailable"),
    ("cuda", "it runs on CPU here"),
])
def test_batch_invariant_refuses_what_it_does_not_cover(machine, monkeypatch, case, match) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    cfg, device, dtype, quant, kernels, sharded = config(), CPU, torch.float32, "gguf", machine.kernels, False
    if case == "gemma":
        cfg = config("gemma2")
    elif case == "window":
        cfg = config(sliding_window=8)
    elif case == "int8":
        quant = "int8"
    elif case == "float16":
        quant, dtype = None, torch.float16
    elif case == "sharded":
        sharded = True
    elif case == "no kernels":
        kernels = None
    elif case == "no gguf kernels":
        machine.gguf_kernels = False
    elif case == "cuda":
        device = torch.device("cuda")
    with pytest.raises(ValueError, match=f"VLLM_BATCH_INVARIANT=1: .*{match}"):
        plan_execution(cfg, device, dtype, quant, kernels, sharded=sharded)
