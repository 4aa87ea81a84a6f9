"""TOKENLOOM_CPU_ISA (tokenloom/cpu_isa.py): run as on a CPU with only the named ISA, a proxy for an
AVX2-only EPYC on an AVX-512 Xeon. The cap is parsed and refused when bad or above the CPU; under
`avx2` the dtype, the int8 check, the kernels' -march and cache entries and torch's own kernels are
those of an AVX2 CPU; and the capped float32 path gives the uncapped one's greedy tokens (every
kernel on another code path: oneDNN's AVX2 GEMMs, the CPU kernels' AVX2 branches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenloom import cpu_isa, envs
from tokenloom.model import platform


def cpuinfo_flags(line: str) -> frozenset[str]:
    return frozenset(line.split())


# An AMX Xeon's vector flags (this development machine's, trimmed) and an AVX2-only EPYC's.
XEON = cpuinfo_flags("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni "
                     "avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx512vbmi")
EPYC = cpuinfo_flags("sse4_2 avx avx2 fma f16c bmi2 sha_ni")
HAVE_AVX2 = cpu_isa.CAPS["avx2"].flags <= cpu_isa.this_cpu_flags()
REPO = Path(__file__).resolve().parents[1]


def test_an_unknown_isa_is_refused_naming_the_choices(monkeypatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="TOKENLOOM_CPU_ISA must be one of native, avx2, avx512, avx512_vnni, "
                                         "avx512_bf16, got 'avx3'"):
        cpu_isa.active_cap()
    assert cpu_isa.torch_environment() == {}  # tokenloom/__init__.py leaves torch alone; the engine raises


def test_capping_up_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match=r"TOKENLOOM_CPU_ISA=avx512 asks for an ISA this CPU lacks \(no avx512bw"):
        cpu_isa.active_cap(EPYC)
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx2")
    assert cpu_isa.active_cap(EPYC).march == "haswell"


def test_each_cap_hides_the_flags_above_it(monkeypatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx2")
    assert cpu_isa.cpu_flags(XEON) == {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx512_vnni")
    flags = cpu_isa.cpu_flags(XEON)
    assert "avx512_vnni" in flags and "avx512bw" in flags
    assert not flags & {"avx512_bf16", "amx_int8", "amx_bf16", "avx_vnni", "avx512_fp16"}
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "native")
    assert cpu_isa.cpu_flags(XEON) == XEON


def test_the_cap_reaches_the_build_flags_and_torch(monkeypatch) -> None:
    flags = ["-O3", "-march=native", "-fopenmp"]
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "native")
    assert cpu_isa.capped_cflags(flags) == flags and cpu_isa.torch_environment() == {}
    if not HAVE_AVX2:
        pytest.skip("this CPU has no AVX2 to cap at")
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx2")
    assert cpu_isa.capped_cflags(flags) == ["-O3", "-march=haswell", "-fopenmp"]
    assert cpu_isa.torch_environment() == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(not HAVE_AVX2, reason="this CPU has no AVX2 to cap at")
def test_under_avx2_dtype_auto_is_float32_and_onednn_has_no_fast_int8(monkeypatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx2")
    assert platform.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert not platform.cpu_supports_bf16() and not platform.cpu_has_fast_int8()


@pytest.mark.skipif(not HAVE_AVX2, reason="this CPU has no AVX2 to cap at")
def test_torch_running_above_the_cap_is_an_error(monkeypatch) -> None:
    """torch picked its kernels before the cap was set (it was imported, and ran, before tokenloom)."""
    monkeypatch.setenv("TOKENLOOM_CPU_ISA", "avx2")
    with pytest.raises(ValueError, match="torch already runs its AVX512 kernels: import tokenloom before torch"):
        cpu_isa.check_torch_capped("AVX512")
    cpu_isa.check_torch_capped("AVX2")
    cpu_isa.check_torch_capped("DEFAULT")


def test_a_user_set_torch_capability_wins() -> None:
    if not HAVE_AVX2:
        pytest.skip("this CPU has no AVX2 to cap at")
    env = {**os.environ, "TOKENLOOM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(REPO)}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    code = ("import os, tokenloom, torch; "
            "print(os.environ['ATEN_CPU_CAPABILITY'], os.environ['ONEDNN_MAX_CPU_ISA'], "
            "torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["default", "AVX2", "DEFAULT"]


# The capped engine, in a process of its own: torch reads the cap when it loads.
_CAPPED = """
import json, logging, sys
import tokenloom
from tokenloom import LLM, SamplingParams
import torch
from tokenloom.model.kernels import cpu_kernels
from tokenloom.model.gguf_kernels import gguf_kernels
plans = []
class Plans(logging.Handler):
    def emit(self, record):
        if "execution plan" in record.getMessage(): plans.append(record.getMessage())
logging.getLogger("tokenloom").addHandler(Plans()); logging.getLogger("tokenloom").setLevel(logging.INFO)
llm = LLM(quantization="none", dtype="auto")
outs = llm.generate(json.loads(sys.argv[1]), SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2])))
ck, gk = cpu_kernels(), gguf_kernels()
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "plan": plans[-1],
                  "torch": torch.backends.cpu.get_cpu_capability(), "dtype": str(llm.llm_engine.dtype),
                  "cpu_kernels": ck.__file__, "avx512": ck.has_avx512(),
                  "gguf_kernels": gk.__file__, "gguf_avx2": gk.has_avx2(), "gguf_vnni": gk.has_vnni()}))
"""

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colours:"]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_AVX2 or not shutil.which("c++") or not envs.TOKENLOOM_CPU_KERNELS,
                    reason="needs AVX2 and the compiled kernels")
def test_capped_avx2_engine_matches_the_uncapped_float32_tokens() -> None:
    """Under avx2 the default model's `--dtype auto` is float32, torch runs its AVX2 kernels, the
    kernels build for haswell into their own cache entries without AVX-512 or VNNI, and the greedy
    tokens equal the uncapped float32 path's (oneDNN's AVX-512 GEMMs, the kernels' AVX-512 branches)."""
    from tokenloom import LLM, SamplingParams

    max_tokens = 32
    env = {**os.environ, "TOKENLOOM_CPU_ISA": "avx2", "PYTHONPATH": str(REPO)}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _CAPPED, json.dumps(PROMPTS), str(max_tokens)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    capped = json.loads(done.stdout.strip().splitlines()[-1])
    assert capped["torch"] == "AVX2" and capped["dtype"] == "torch.float32"
    assert "AVX2 (capped: TOKENLOOM_CPU_ISA=avx2), float32" in capped["plan"]
    assert "/cpu_kernels_avx2-" in capped["cpu_kernels"] and not capped["avx512"]
    assert "/gguf_kernels_avx2-" in capped["gguf_kernels"] and capped["gguf_avx2"] and not capped["gguf_vnni"]

    llm = LLM(quantization="none", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert capped["tokens"] == [list(o.outputs[0].token_ids) for o in outs]
