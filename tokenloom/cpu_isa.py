"""TOKENLOOM_CPU_ISA: run as if the CPU had only a given instruction set (a proxy for a smaller CPU).

The engine picks its paths from the CPU's features (tokenloom/model/execution_plan.py): bf16 where
there is AVX512-BF16 or AMX, VNNI dot products in the GGUF kernels, AVX-512 in the compiled kernels,
and torch/oneDNN pick their own kernels the same way. A cap makes every one of those decisions as
on a CPU with only the named ISA, so that, say, a 2-core AVX2 EPYC's figures can be approximated
on an AVX-512 Xeon (docs/performance.md "An AVX2 proxy on an AVX-512 machine"):

* the compiled kernels build with the cap's `-march` instead of `-march=native`, into their own
  cache entries (`<stem>_<cap>-<key>`), so native and capped builds live side by side;
* the CPU feature flags the platform checks (`cpu_flags()`) lose every AVX-512 / AMX / AVX-VNNI
  flag above the cap;
* torch's own kernels: `ATEN_CPU_CAPABILITY` and `ONEDNN_MAX_CPU_ISA`, set by tokenloom/__init__.py
  before torch loads (a value the user set wins).

What a cap cannot change: the cache sizes, core count and memory bandwidth of this machine; and the
`-march` targets are Intel cores (haswell for avx2), which tune for Intel rather than for Zen.
Capping *up*, to an ISA this CPU lacks, is an error. Pure Python: imported before torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from tokenloom import envs

NATIVE = "native"


@dataclass(frozen=True)
class IsaCap:
    name: str  # the TOKENLOOM_CPU_ISA value
    march: str  # gcc's -march for the compiled kernels
    aten: str  # torch's ATEN_CPU_CAPABILITY (default, avx2, avx512)
    onednn: str  # oneDNN's ONEDNN_MAX_CPU_ISA
    flags: frozenset[str]  # /proc/cpuinfo flags a CPU of this level has (and this one must have)
    rank: int  # torch's capabilities in order: what the cap allows get_cpu_capability() to report


_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}

CAPS: dict[str, IsaCap] = {
    # haswell: AVX2 + FMA + F16C + BMI2, what a Zen 2/3 EPYC's -march=native has of the kernels' #ifs.
    "avx2": IsaCap("avx2", "haswell", "avx2", "AVX2", _AVX2, 1),
    "avx512": IsaCap("avx512", "skylake-avx512", "avx512", "AVX512_CORE", _AVX512, 2),
    "avx512_vnni": IsaCap("avx512_vnni", "cascadelake", "avx512", "AVX512_CORE_VNNI", _AVX512 | {"avx512_vnni"}, 2),
    "avx512_bf16": IsaCap("avx512_bf16", "cooperlake", "avx512", "AVX512_CORE_BF16",
                          _AVX512 | {"avx512_vnni", "avx512_bf16"}, 3),
}
assert set(CAPS) | {NATIVE} == set(envs.CPU_ISA_CHOICES)

# torch.backends.cpu.get_cpu_capability()'s answers, lowest first.
TORCH_CAPABILITY_RANK = {"DEFAULT": 0, "NO AVX": 0, "AVX2": 1, "AVX512": 2, "AVX512_BF16": 3, "AMX": 4}

# Flags a cap hides unless the level has them: the vector extensions the engine and its libraries test.
_GATED_PREFIXES = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")


@cache
def _cpuinfo_field(name: str) -> str:
    """The first processor's `name` field in /proc/cpuinfo ("" where there is none, or no /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


@lru_cache(maxsize=1)
def this_cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo feature flags, uncapped (empty where there is no /proc/cpuinfo)."""
    return frozenset(_cpuinfo_field("flags").split())


def this_cpu_vendor() -> str:
    """This CPU's /proc/cpuinfo vendor_id ("AuthenticAMD", "GenuineIntel", ...; "" where unknown). A cap
    does not change it: it decides tuning (how the kernels prefetch), not which instructions exist."""
    return _cpuinfo_field("vendor_id")


def active_cap(native_flags: frozenset[str] | None = None) -> IsaCap | None:
    """The cap TOKENLOOM_CPU_ISA asks for (None: native), checked against this CPU (or against
    `native_flags`, another CPU's /proc/cpuinfo flags).

    Raises ValueError for an unknown value (envs) or for a level the CPU does not have."""
    name = envs.TOKENLOOM_CPU_ISA
    if name == NATIVE:
        return None
    cap = CAPS[name]
    native = this_cpu_flags() if native_flags is None else native_flags
    missing = sorted(cap.flags - native) if native else []
    if missing:
        raise ValueError(f"TOKENLOOM_CPU_ISA={name} asks for an ISA this CPU lacks (no {', '.join(missing)}); "
                         f"a cap can only lower the ISA: use one this CPU has, or native")
    return cap


def cap_name() -> str:
    """'native' or the cap's name, for logs and cache entries."""
    cap = active_cap()
    return cap.name if cap else NATIVE


def cpu_flags(native_flags: frozenset[str] | None = None) -> frozenset[str]:
    """/proc/cpuinfo's feature flags (or `native_flags`) as a CPU of the capped level would show them
    (all of them without a cap)."""
    flags = this_cpu_flags() if native_flags is None else native_flags
    cap = active_cap(flags)
    if cap is None:
        return flags
    return frozenset(f for f in flags if not f.startswith(_GATED_PREFIXES) or f in cap.flags)


def march() -> str:
    """The compiled kernels' -march: native, or the cap's target."""
    cap = active_cap()
    return cap.march if cap else NATIVE


def capped_cflags(cflags: list[str]) -> list[str]:
    """`cflags` with -march=native replaced by the cap's target (unchanged without a cap)."""
    target = march()
    return [f"-march={target}" if flag == "-march=native" else flag for flag in cflags]


def torch_environment() -> dict[str, str]:
    """The variables that cap torch's own kernels (ATen's dispatch, oneDNN's JIT) at the cap's level;
    empty without a cap or for a malformed value (the engine reports that one when it reads it)."""
    try:
        cap = active_cap()
    except ValueError:
        return {}
    return {} if cap is None else {"ATEN_CPU_CAPABILITY": cap.aten, "ONEDNN_MAX_CPU_ISA": cap.onednn}


def check_torch_capped(torch_capability: str) -> None:
    """Raise when torch's kernels run above the cap: torch picked its ISA before the cap was set."""
    cap = active_cap()
    if cap is None:
        return
    if TORCH_CAPABILITY_RANK.get(torch_capability.upper(), 0) > cap.rank:
        raise ValueError(f"TOKENLOOM_CPU_ISA={cap.name}, but torch already runs its {torch_capability} kernels: "
                         f"import tokenloom before torch (it sets ATEN_CPU_CAPABILITY={cap.aten} and "
                         f"ONEDNN_MAX_CPU_ISA={cap.onednn}), or set those two yourself")
