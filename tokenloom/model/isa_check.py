"""Compile every ISA variant of the C++ kernels on any x86 machine (syntax and types, no code).

The kernels are built with `-march=native`, so a machine compiles only the `#if` branches its own CPU
has: on an AVX2-only machine the AVX-512, AVX-512 BF16 and VNNI blocks are never compiled, and a
mistake in them reaches the first user with such a CPU. This check compiles each source with
`-fsyntax-only` once per target below, whatever the CPU; which of them also *run* here is what
`-march=native` picks (the test suite runs those).

Targets, by the macros the sources branch on:

    x86-64-v2       no AVX: the plain loops
    haswell         AVX2 + FMA + F16C, no VNNI, no AVX-512
    alderlake       AVX2 + AVX-VNNI (the 256-bit VNNI without AVX-512)
    skylake-avx512  AVX-512 F/BW/VL, no VNNI, no BF16
    sapphirerapids  AVX-512 with VNNI and BF16 (and AMX)

`python -m tokenloom.model.isa_check` checks the shipped sources (make test runs it once per source
change); `check(sources, targets)` is the function the tests call.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# Headers (gguf_quants.h) are checked through the sources that include them.
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "gguf_kernels.cpp", CSRC / "fused_decode.cpp", CSRC / "lora_kernels.cpp")
TARGETS = ("x86-64-v2", "haswell", "alderlake", "skylake-avx512", "sapphirerapids")


@dataclass
class Failure:
    source: Path
    target: str
    errors: str


def _include_flags() -> list[str]:
    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [f"-I{p}" for p in paths]


def compile_one(source: Path, target: str, include_flags: Sequence[str] = ()) -> Failure | None:
    cmd = ["c++", "-std=c++17", "-fsyntax-only", "-fopenmp", f"-march={target}", "-w",
           "-DTORCH_EXTENSION_NAME=tokenloom_isa_check", *include_flags, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
    return Failure(source, target, "\n".join(errors[:10]) or done.stderr[-2000:])


def check(sources: Sequence[Path] = SOURCES, targets: Sequence[str] = TARGETS, jobs: int = 2,
          include_flags: Sequence[str] | None = None) -> list[Failure]:
    """Every (source, target) pair that does not compile (empty: all do)."""
    flags = _include_flags() if include_flags is None else list(include_flags)
    pairs = [(s, t) for s in sources for t in targets]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda pair: compile_one(pair[0], pair[1], flags), pairs))
    return [r for r in results if r is not None]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloom.model.isa_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="compilers at once (default 2)")
    parser.add_argument("--target", action="append", help="a -march target (repeatable; default: all)")
    args = parser.parse_args(argv)
    if shutil.which("c++") is None:
        print("isa_check: no C++ compiler; tokenloom runs its pure-torch path and there is nothing to check")
        return 0
    targets = args.target or list(TARGETS)
    failures = check(SOURCES, targets, jobs=args.jobs)
    for f in failures:
        print(f"isa_check: {f.source.name} does not compile for -march={f.target}:\n{f.errors}", file=sys.stderr)
    if not failures:
        print(f"isa_check: {len(SOURCES)} sources compile for {', '.join(targets)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
