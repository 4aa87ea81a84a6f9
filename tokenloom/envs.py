"""Every environment variable tokenloom reads, in one place (vLLM's `vllm/envs.py`).

The engine chooses its execution paths itself, per CPU and per step shape (quantized GEMV or GEMM,
fused decode step, packed float GEMMs, KV layout): each TOKENLOOM_* variable below is an override
for measuring or working around a path, never something a user must set. The VLLM_* variables are
vLLM's own names with vLLM's defaults, read because users of vLLM set them.

Values are read when asked for (`envs.TOKENLOOM_CPU_KERNELS`), not at import, so a test or a
launcher may change the environment first; a malformed value is a ValueError naming the variable.
Not here: the OpenMP/oneDNN/ATen variables tokenloom sets for those libraries before torch loads
(tokenloom/__init__.py; ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA only under TOKENLOOM_CPU_ISA),
which the libraries themselves read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_OFF = ("0", "false", "no", "off")
# TOKENLOOM_CPU_ISA's values (what each means: tokenloom/cpu_isa.py).
CPU_ISA_CHOICES = ("native", "avx2", "avx512", "avx512_vnni", "avx512_bf16")
_ON = ("1", "true", "yes", "on")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    return raw not in _OFF if default else raw in _ON


def _int(name: str, default: int, what: str, *, minimum: int | None = None, fallback: str | None = None) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw and fallback is not None:  # an older spelling of the same variable
        name, raw = fallback, os.environ.get(fallback, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be {minimum} or more")
    return value


def _lenient_int(name: str, default: int) -> int:
    """vLLM's reading of its limits: a value that is not a number is ignored."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.lstrip("-").isdigit() else default


def _digits(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else default


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name}={raw} must be 0 (no limit) or more")
    return value


def _vllm_bool(name: str) -> bool:
    """vLLM's `bool(int(os.getenv(name, "0")))`, also taking true/false words; anything else is an error
    with the variable's name (vLLM's int() raises a bare ValueError)."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return False
    if raw.lstrip("-").isdigit():
        return bool(int(raw))
    if raw in _ON or raw in _OFF:
        return raw in _ON
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, "").strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _cache_dir() -> Path:
    if env := os.environ.get("TOKENLOOM_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tokenloom"


def _anchors_dir() -> Path:
    for name in ("TOKENLOOM_ANCHORS_DIR", "ANCHORS"):  # ANCHORS: the name the benchmarks read before
        if env := os.environ.get(name):
            return Path(env).expanduser()
    return Path.home() / ".cache" / "tokenloom-anchors"


def _anchors_scripts() -> Path:
    if env := os.environ.get("TOKENLOOM_ANCHORS_SCRIPTS"):
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "anchors"  # beside the repository checkout


def _vllm_python() -> str:
    return (os.environ.get("TOKENLOOM_VLLM_PYTHON") or os.environ.get("VLLM_PYTHON")  # VLLM_PYTHON: the older name
            or str(_anchors_dir() / "vllm-venv" / "bin" / "python"))


def _log_stats_interval_s() -> float:
    for name in ("TOKENLOOM_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL"):
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"${name} must be a number of seconds, got {raw!r}") from None
            # vLLM's rule: a value of 0 or less means its default (a zero-period loop would spin).
            return value if value > 0 else 10.0
    return 10.0


def _keep_alive_s() -> float:
    for name in ("TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        raw = os.environ.get(name)
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"${name} must be a number of seconds, got {raw!r}") from None
            if value <= 0:
                raise ValueError(f"${name} must be > 0 seconds, got {raw!r}")
            return value
    return 5.0


environment_variables: dict[str, Callable[[], Any]] = {
    # ---- where things are kept
    # Compiled kernels, converted tokenizers, the benchmarks' real models: $TOKENLOOM_CACHE_DIR, else
    # $XDG_CACHE_HOME/tokenloom, else ~/.cache/tokenloom (a Path).
    "TOKENLOOM_CACHE_DIR": _cache_dir,
    # ---- execution-path overrides (the engine picks each itself; see docs/model.md)
    # Run as on a CPU with only this ISA (native: all this CPU has; avx2, avx512, avx512_vnni,
    # avx512_bf16): the compiled kernels' -march, the features the plan sees, torch's ATen / oneDNN
    # kernels (tokenloom/cpu_isa.py). A proxy for a smaller CPU; above this CPU's own ISA it is an error.
    "TOKENLOOM_CPU_ISA": lambda: _choice("TOKENLOOM_CPU_ISA", "native", CPU_ISA_CHOICES),
    # 0: never build or use the compiled CPU / GGUF kernels (the pure-torch path, same results, slower).
    "TOKENLOOM_CPU_KERNELS": lambda: _flag("TOKENLOOM_CPU_KERNELS", True),
    # Decode batches up to this many rows run the whole stack as one compiled call (0: never).
    "TOKENLOOM_FUSED_DECODE_ROWS": lambda: _int(
        "TOKENLOOM_FUSED_DECODE_ROWS", 8, "an integer (0 turns the fused step off)",
        fallback="TOKENLOOM_GGUF_FUSED_ROWS"),
    # GGUF weights in the 8-row layouts: batches of at least this many rows run the batched int8 GEMM
    # (gguf_gemm_packed) instead of the small-batch tile kernel. 0 (unset): the kernels' crossover
    # (tokenloom/model/gguf_weights.py, gemm_min_rows).
    "TOKENLOOM_GGUF_GEMM_ROWS": lambda: _int("TOKENLOOM_GGUF_GEMM_ROWS", 0, "a number of rows (0: automatic)",
                                             minimum=0),
    # GGUF weights without an 8-row layout (IQ3 blocks, or a row count not a multiple of 8): batches of at
    # least this many rows dequantize and run a float GEMM; the 8-row layouts do so only from the second (4096).
    "TOKENLOOM_GGUF_DEQUANT_ROWS": lambda: _int("TOKENLOOM_GGUF_DEQUANT_ROWS", 32, "a number of rows", minimum=1),
    "TOKENLOOM_GGUF_PACKED_DEQUANT_ROWS": lambda: _int(
        "TOKENLOOM_GGUF_PACKED_DEQUANT_ROWS", 4096, "a number of rows", minimum=1),
    # IQ3_XXS / IQ3_S matrices on the quantized path: `auto` requantizes them to Q8_0 when that copy fits
    # in half the available memory (about twice as fast, about twice the memory), else keeps the file's
    # blocks; `q8_0` / `blocks` choose one (tokenloom/model/gguf_weights.py, iq3_as_q8_0).
    "TOKENLOOM_GGUF_IQ3_LAYOUT": lambda: _choice("TOKENLOOM_GGUF_IQ3_LAYOUT", "auto", ("auto", "q8_0", "blocks")),
    # How the GGUF tile kernels prefetch the weights they stream: `two-stage` (L2 two strides ahead, then L1
    # one ahead), `one-stage` (L1 only) or `none` (the hardware prefetchers alone); `auto` picks by CPU
    # vendor, none on AMD, two stages elsewhere (tokenloom/model/execution_plan.py, gguf_prefetch_stages).
    # Hints only: the outputs do not change.
    "TOKENLOOM_GGUF_PREFETCH": lambda: _choice("TOKENLOOM_GGUF_PREFETCH", "auto",
                                               ("auto", "none", "one-stage", "two-stage")),
    # 1: float32/bf16 models keep plain layer weights for the fused decode step (off: oneDNN-packed).
    "TOKENLOOM_FUSED_FLOAT": lambda: _flag("TOKENLOOM_FUSED_FLOAT", False),
    # 0: float GEMMs stay on F.linear instead of oneDNN pre-packed weights.
    "TOKENLOOM_PACKED_LINEAR": lambda: _flag("TOKENLOOM_PACKED_LINEAR", True),
    # 0: keep the bf16 KV cache in the plain layout where the CPU could use the packed one.
    "TOKENLOOM_KV_PACKED": lambda: _flag("TOKENLOOM_KV_PACKED", True),
    # vLLM's: 1 makes a row's numbers independent of the step it runs in (batch size, the other rows,
    # prefill chunking, prefix-cache hits, speculative verification): every row runs the fused decoder's
    # per-row arithmetic (docs/reproducibility.md). Off by default: prefill runs ~1.3x slower.
    "VLLM_BATCH_INVARIANT": lambda: _vllm_bool("VLLM_BATCH_INVARIANT"),
    # ---- threads
    # vLLM's: cores left out of the model's OpenMP threads (for async scheduling's engine thread).
    "VLLM_CPU_NUM_OF_RESERVED_CPU": lambda: _int(
        "VLLM_CPU_NUM_OF_RESERVED_CPU", 0, "a whole number of cores", minimum=0),
    # vLLM's: the cores of each tensor/pipeline-parallel rank's threads, ranks separated by '|'
    # ("0-15|16-31"; "auto": the usable cores split evenly between the ranks; "all": no binding).
    "VLLM_CPU_OMP_THREADS_BIND": lambda: os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() or "auto",
    # How a tensor-parallel group on one node all-reduces: shm (shared memory, vLLM's CPU communicator)
    # or gloo (torch.distributed's), for measuring one against the other.
    "TOKENLOOM_CPU_ALLREDUCE": lambda: _choice("TOKENLOOM_CPU_ALLREDUCE", "shm", ("shm", "gloo")),
    # --distributed-executor-backend ray with TP/PP: the CPUs of each rank's placement-group bundle,
    # which are also its OpenMP threads (Ray sets OMP_NUM_THREADS to an actor's CPUs).
    "TOKENLOOM_RAY_CPUS_PER_RANK": lambda: _int("TOKENLOOM_RAY_CPUS_PER_RANK", 1, "a number of CPUs", minimum=1),
    # OpenMP's own: when set, it decides the model's threads and tokenloom does not.
    "OMP_NUM_THREADS": lambda: os.environ.get("OMP_NUM_THREADS") or None,
    # Python's own; vLLM seeds the prefix-cache root hash (NONE_HASH) from it when set (tokenloom/core/block_hash.py).
    "PYTHONHASHSEED": lambda: os.environ.get("PYTHONHASHSEED") or None,
    # ---- start-up
    # How engine-core processes start (tokenloom/engine/process_start.py): `auto` forks library engines
    # (LLM, AsyncLLM) from a forkserver that imported torch once and spawns `tokenloom serve`'s; `spawn`
    # spawns every engine, `forkserver` forks the server's too. An engine whose environment changed since
    # the forkserver started is spawned whatever the setting.
    "TOKENLOOM_ENGINE_START_METHOD": lambda: _choice("TOKENLOOM_ENGINE_START_METHOD", "auto",
                                                     ("auto", "spawn", "forkserver")),
    # Seconds an engine process may go without progress (no CPU used by it or its kernel compilers,
    # nothing logged) before start-up fails; a slow load that keeps moving is never cut. 0: no limit.
    "TOKENLOOM_ENGINE_READY_TIMEOUT": lambda: _seconds("TOKENLOOM_ENGINE_READY_TIMEOUT", 600.0),
    # ---- serving
    "TOKENLOOM_API_KEY": lambda: os.environ.get("TOKENLOOM_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
    # 1: the server stays up answering 503 after its engine dies (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).
    "TOKENLOOM_KEEP_ALIVE_ON_ENGINE_DEATH": lambda: os.environ.get("TOKENLOOM_KEEP_ALIVE_ON_ENGINE_DEATH", "0") == "1",
    # Seconds an idle HTTP keep-alive connection stays open (also vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
    "TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE": _keep_alive_s,
    # Seconds between the server's stats lines ("Engine 000: Avg prompt throughput ..."; off with
    # --disable-log-stats); also vLLM's VLLM_LOG_STATS_INTERVAL. 0 or less: the default, 10 (vLLM's).
    "TOKENLOOM_LOG_STATS_INTERVAL": _log_stats_interval_s,
    # /v1/responses with store: the most responses kept in memory for previous_response_id and GET
    # (least recently used go first; 0 stores none). vLLM keeps them in memory too, without a bound.
    "TOKENLOOM_RESPONSES_STORE_SIZE": lambda: _int(
        "TOKENLOOM_RESPONSES_STORE_SIZE", 1000, "a number of responses", minimum=0),
    # vLLM's: 1 or true: a request's `model` may name any model (answered as the served one), for a proxy or
    # gateway that sends its own names; vLLM reads only those two spellings.
    "VLLM_SKIP_MODEL_NAME_VALIDATION": lambda: os.environ.get("VLLM_SKIP_MODEL_NAME_VALIDATION", "0").strip().lower()
    in ("1", "true"),
    # vLLM's: true (or 1) registers POST /v1/load_lora_adapter and /v1/unload_lora_adapter (docs/lora.md).
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False),
    # ---- vLLM's bounds on what one request may ask for (vLLM 0.32's names and defaults; docs/serving.md)
    # Prompts in one completions request.
    "VLLM_MAX_COMPLETION_PROMPTS": lambda: _digits("VLLM_MAX_COMPLETION_PROMPTS", 1024),
    # Samples of one request: n, and the beam width of beam search.
    "VLLM_MAX_N_SEQUENCES": lambda: _lenient_int("VLLM_MAX_N_SEQUENCES", 16384),
    # Stop strings in one request (the server's request bodies: completions, chat, batch chat, Responses).
    "VLLM_MAX_STOP_STRINGS": lambda: _lenient_int("VLLM_MAX_STOP_STRINGS", 4),
    # Token sequences bad_words may tokenize to (each word twice at most: as written and after a space), and
    # the tokens of all those sequences together.
    "VLLM_MAX_NUM_BAD_WORDS": lambda: _lenient_int("VLLM_MAX_NUM_BAD_WORDS", 128),
    "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS": lambda: _lenient_int("VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", 1024),
    # Seconds a structured-output regex may take to become a grammar (when the request is checked and when it is
    # compiled) before it is refused as too complex: nested quantifiers can blow up the automaton. 0 or less: no
    # limit. vLLM's name and default.
    "VLLM_REGEX_COMPILATION_TIMEOUT_S": lambda: _int(
        "VLLM_REGEX_COMPILATION_TIMEOUT_S", 5, "a whole number of seconds"),
    # The OpenAI SDK's: `tokenloom bench serve`'s default --api-key.
    "OPENAI_API_KEY": lambda: os.environ.get("OPENAI_API_KEY") or None,
    # ---- benchmarks only (benchmarks/README.md): where the reference set-up outside the repository lives
    # The anchors: vLLM's CPU build (vllm-venv/), the HF model dirs (smollm2-hf, smollm2-hf-fp32), the W1
    # workload (workloads/), llama.cpp's build, the bench lock: $TOKENLOOM_ANCHORS_DIR, else $ANCHORS,
    # else ~/.cache/tokenloom-anchors (a Path).
    "TOKENLOOM_ANCHORS_DIR": _anchors_dir,
    # The anchors' scripts (vllm_offline.py, workloads.py, serve_client.py): else shared/anchors beside
    # the repository checkout (a Path).
    "TOKENLOOM_ANCHORS_SCRIPTS": _anchors_scripts,
    # The python of vLLM's CPU build, for the benchmarks and conformance runs that drive vLLM (also
    # $VLLM_PYTHON): else <anchors>/vllm-venv/bin/python.
    "TOKENLOOM_VLLM_PYTHON": _vllm_python,
    # ---- tests only
    # 'first_token=N': steps prefilling a prompt that starts with token N fail (chaos tests).
    "TOKENLOOM_FAULT_INJECT": lambda: os.environ.get("TOKENLOOM_FAULT_INJECT") or None,
}


def set_environment(values: dict[str, str]) -> None:
    """Replace this process's environment with `values` (an engine forked from the forkserver takes the
    environment of the process that started it: tokenloom/engine/process_start.py)."""
    os.environ.clear()
    os.environ.update(values)


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides`, for a process it starts (a TP/PP worker), or to compare with
    what an engine forked from the forkserver inherited (tokenloom/engine/process_start.py)."""
    return {**os.environ, **overrides}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
