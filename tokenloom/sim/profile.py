"""A profile: a fitted cost model plus what it was measured on, as JSON. No torch here.

`tokenloom profile` writes one (tokenloom/sim/profiler.py); `tokenloom simulate --profile` reads one.
The samples travel with the fit so a profile can be refitted, or its error re-checked, later.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import metadata, resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from tokenloom.config import kv_cache_row_bytes
from tokenloom.core.cost_model import PROFILE_FORMAT, CostModel, StepShape
from tokenloom.sim.cost_fit import FitError, Sample

FORMAT = PROFILE_FORMAT
DEFAULT_PROFILE = "smollm2-135m-instruct-cpu.json"
# Profiles shipped with tokenloom, by the name `--profile` accepts.
SHIPPED_PROFILES = {"default": DEFAULT_PROFILE, "int8": "smollm2-135m-instruct-cpu-int8.json"}
_SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu")


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Profile:
    model: str
    dtype: str
    block_size: int
    hardware: dict[str, Any]
    cost_model: CostModel  # the runner's execute_model, fitted on the samples
    fit: FitError
    samples: list[Sample] = field(default_factory=list)
    # The engine's own work around execute_model (schedule + update_from_output), seconds per step
    # and per scheduled request, measured on the real Scheduler; added to every simulated step.
    scheduler_overhead: dict[str, float] = field(default_factory=dict)
    # What the simulator needs to size things as the engine does: the model's context length and
    # the KV cache's bytes per token (the engine's default pool is its KV memory / this).
    max_model_len: int = 2048
    kv_bytes_per_token: int = 0
    # The model's head size: with --kv-cache-dtype int8 a (token, layer, K or V, head) row is this
    # many bytes plus its scale (kv_bytes_per_token_for). 0: not recorded (profiles before int8 KV).
    kv_head_dim: int = 0
    # The KV cache dtype the profiled runner stored (its step costs are that cache's): "auto", the run dtype's
    # (kv_bytes_per_token's elements), or the engine's auto choice for a float32 run of a 16-bit checkpoint
    # (config.auto_kv_cache_dtype), which --kv-cache-dtype auto then means in the simulation too.
    kv_cache_dtype: str = "auto"
    runner_fingerprint: str = ""  # runner_fingerprint() when profiled
    quantization: str | None = None  # the runner's --quantization when profiled
    created: str = ""
    tokenloom_version: str = ""

    def kv_bytes_per_token_for(self, cache_dtype: str = "auto") -> int:
        """The KV bytes per token of the engine's pool with this --kv-cache-dtype: the profiled dtype's
        (auto), or the same rows stored in another cache dtype: 16-bit values, or int8 values + float32
        scales (the engine's block bytes, model/attention.kv_cache_bytes_per_block). The step costs stay
        the profiled cache's."""
        if cache_dtype == "auto":
            cache_dtype = self.kv_cache_dtype
        if cache_dtype == "auto" or not self.kv_bytes_per_token:
            return self.kv_bytes_per_token
        elem = _DTYPE_BYTES.get(self.dtype)
        if not self.kv_head_dim or elem is None:
            raise ValueError(f"the profile of {self.model} does not say its KV head size (profiled before int8 KV); "
                             f"re-profile it, or pass --num-blocks, to simulate --kv-cache-dtype {cache_dtype}")
        rows = self.kv_bytes_per_token // (self.kv_head_dim * elem)
        return rows * kv_cache_row_bytes(self.kv_head_dim, elem, cache_dtype)

    def is_stale(self) -> bool:
        """True when the runner's code differs from the code that was profiled."""
        return bool(self.runner_fingerprint) and self.runner_fingerprint != runner_fingerprint()

    @property
    def step_model(self) -> CostModel:
        """What one engine step costs: the runner's fit plus the scheduler's overhead."""
        return self.cost_model.plus(self.scheduler_overhead)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "block_size": self.block_size,
            "hardware": self.hardware,
            "max_model_len": self.max_model_len,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_head_dim": self.kv_head_dim,
            "kv_cache_dtype": self.kv_cache_dtype,
            "runner_fingerprint": self.runner_fingerprint,
            "created": self.created,
            "tokenloom_version": self.tokenloom_version or tokenloom_version(),
            "coefficients_s": self.cost_model.coefficients,
            "scheduler_overhead_s": self.scheduler_overhead,
            "fit": asdict(self.fit),
            "samples": [{**asdict(s.shape), "seconds": s.seconds} for s in self.samples],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Profile:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a tokenloom profile (format {data.get('format')!r}, expected {FORMAT!r})")
        samples = [
            Sample(_shape_of(s), float(s["seconds"]))
            for s in data.get("samples", [])
        ]
        return Profile(
            model=data["model"],
            dtype=data["dtype"],
            quantization=data.get("quantization"),
            block_size=int(data["block_size"]),
            hardware=dict(data.get("hardware", {})),
            cost_model=CostModel(dict(data["coefficients_s"])),
            scheduler_overhead=dict(data.get("scheduler_overhead_s", {})),
            fit=FitError(**data["fit"]),
            samples=samples,
            max_model_len=int(data.get("max_model_len", 2048)),
            kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
            kv_head_dim=int(data.get("kv_head_dim", 0)),
            kv_cache_dtype=data.get("kv_cache_dtype", "auto"),
            runner_fingerprint=data.get("runner_fingerprint", ""),
            created=data.get("created", ""),
            tokenloom_version=data.get("tokenloom_version", ""),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")


def tokenloom_version() -> str:
    try:
        return metadata.version("tokenloom")
    except metadata.PackageNotFoundError:
        return "unknown"


def runner_fingerprint() -> str:
    """sha256 (first 16 hex digits) of tokenloom/model's sources, the code that decides how long a step takes,
    plus tokenloom/core/gemm_rows.py (the row buckets the runner's GEMMs are padded to).

    All of them (Python and the compiled kernels' C++), not a chosen few: a new kernel changes step times
    as much as an edit does. Read as files; torch is not imported.
    """
    digest = hashlib.sha256()
    sources = _sources(resources.files("tokenloom.model"), "")
    sources.append(("core/gemm_rows.py", resources.files("tokenloom.core").joinpath("gemm_rows.py").read_bytes()))
    for name, data in sorted(sources):
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()[:16]


def _sources(folder: Traversable, prefix: str) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.name.startswith((".", "__")):
            out += _sources(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(_SOURCE_SUFFIXES):
            out.append((prefix + entry.name, entry.read_bytes()))
    return out


def load_profile(path: str | Path | None = None) -> Profile:
    """A profile file, or a shipped one by name: "default" (or None; the default model's bf16 runner)
    or "int8" (the same with --quantization int8)."""
    name = "default" if path is None else str(path)
    if name in SHIPPED_PROFILES:
        text = resources.files("tokenloom.sim").joinpath("profiles").joinpath(SHIPPED_PROFILES[name]).read_text("utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return Profile.from_dict(json.loads(text))


def _shape_of(sample: dict[str, Any]) -> StepShape:
    """A saved sample's shape. Profiles written before `decode_context_sum` existed profiled decodes
    that all shared one context, so their sum is decode_tokens × decode_max_context."""
    fields = {k: v for k, v in sample.items() if k != "seconds"}
    fields.setdefault("decode_context_sum", fields.get("decode_tokens", 0) * fields.get("decode_max_context", 0))
    return StepShape(**fields)
