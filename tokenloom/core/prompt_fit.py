"""Whether a request can ever be served: the one rule behind the scheduler's RequestRejected and the front
ends' InvalidRequestError (HTTP 400 in the server). `prompt_fit` measures a request against the pool;
`prompt_refusal` says, in vLLM's words, why it can never run: both callers raise with its message (the
scheduler prefixes the request id), so the limits and the words are defined here once.

The KV blocks a request needs at its longest are counted as vLLM counts a request's share of the pool
(`_max_memory_usage_bytes_from_groups` / `get_max_concurrency_for_kv_cache_config`,
vllm/v1/core/kv_cache_utils.py): every KV cache group claims its own blocks from the one shared pool,
so the need is the sum over groups; a full-attention group needs cdiv(tokens, block_size), a
sliding-window group at most its admission cap (`SlidingWindowSpec.max_admission_blocks_per_request`:
cdiv(min(W - 1 + tokens in flight, max_model_len), block_size) + 1), since the blocks that left its
window are freed as the request runs. vLLM checks this once at start-up for max_model_len ("To serve
at least one request with the model's max seq len ..."); tokenloom lets the pool be smaller than
max_model_len and checks each request against it instead, so a request that could never finish is
refused up front rather than waiting forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.config import ConfigError, EngineConfig, SchedulerConfig
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec

# Upper bound on the default context: enough for chat, and keeps a small default pool useful.
_DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class PromptFit:
    num_prompt_tokens: int
    max_model_len: int
    final_len: int  # the longest the request can grow: prompt + max_tokens, capped at max_model_len
    blocks_needed: int  # KV blocks at that length, every group together
    num_blocks: int  # KV blocks in the pool
    blocks_per_group: tuple[int, ...] = ()  # each group's share of blocks_needed
    group_windows: tuple[int | None, ...] = ()  # each group's sliding window (None: full attention)
    block_size: int = 0  # tokens per KV block

    @property
    def empty(self) -> bool:
        return self.num_prompt_tokens == 0

    @property
    def no_room_to_generate(self) -> bool:
        return self.num_prompt_tokens >= self.max_model_len

    @property
    def exceeds_pool(self) -> bool:
        """It could never finish: at its longest its groups together need more blocks than the pool."""
        return self.blocks_needed > self.num_blocks

    @property
    def per_group(self) -> str:
        """What each group needs, for messages ("" with one full-attention group: nothing to add).
        E.g. '66 in the full-attention group, 33 in each of 5 sliding-window groups (window 512)'."""
        if self.group_windows in ((), (None,)):
            return ""
        parts: dict[tuple[int | None, int], int] = {}
        for window, blocks in zip(self.group_windows, self.blocks_per_group):
            parts[(window, blocks)] = parts.get((window, blocks), 0) + 1
        words = []
        for (window, blocks), count in sorted(parts.items(), key=lambda p: (p[0][0] is not None, p[0][0] or 0)):
            kind = "full-attention" if window is None else "sliding-window"
            tail = "" if window is None else f" (window {window})"
            if count == 1:
                words.append(f"{blocks} in the {kind} group{tail}")
            else:
                words.append(f"{blocks} in each of {count} {kind} groups{tail}")
        return ", ".join(words)


def prompt_fit(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int,
               kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
               max_in_flight_tokens: int | None = None) -> PromptFit:
    """`kv_cache_groups`: the model's groups (None: one full-attention group);
    `max_in_flight_tokens` (tokens scheduled but not yet settled, `kv_cache_groups.max_in_flight_tokens`)
    sizes a sliding group's cap and is required with one."""
    final_len = min(num_prompt_tokens + max_tokens, max_model_len)
    groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec((0,))]
    if max_in_flight_tokens is None and any(g.sliding_window is not None for g in groups):
        raise ValueError("prompt_fit with a sliding-window KV cache group needs max_in_flight_tokens")
    # The last sampled token is never fed back, so the KV holds at most final_len - 1 tokens.
    per_group = tuple(g.max_blocks_per_request(final_len - 1, block_size, max_in_flight_tokens or 0, max_model_len)
                      for g in groups)
    return PromptFit(num_prompt_tokens, max_model_len, final_len, sum(per_group), num_blocks, per_group,
                     tuple(g.sliding_window for g in groups), block_size)


# vLLM's input processor's words for an empty prompt (vLLM's tests match "decoder prompt cannot be empty").
EMPTY_PROMPT = "The decoder prompt cannot be empty"


@dataclass(frozen=True)
class PromptRefusal:
    """Why a request can never run: the message (vLLM's wording) and the request field to blame."""

    message: str
    param: str  # "prompt" or "max_tokens"


def prompt_refusal(fit: PromptFit, *, pooling: bool = False, max_tokens: int | None = None,
                   max_tokens_in_context: bool = False) -> PromptRefusal | None:  # fmt: skip
    """The first reason `fit`'s request can never run, or None. `pooling`: a prefill-only request, which may
    fill the whole context. `max_tokens_in_context`: also refuse a `max_tokens` past the context (the OpenAI
    server does, as vLLM's serving layer; the offline LLM and the scheduler let such a request stop at
    max_model_len, as vLLM's LLM)."""
    n_prompt, max_len = fit.num_prompt_tokens, fit.max_model_len
    if fit.empty:
        return PromptRefusal(EMPTY_PROMPT, "prompt")
    if pooling:
        if n_prompt > max_len:
            return PromptRefusal(f"This model's maximum context length is {max_len} tokens. However, your request "
                                 f"has {n_prompt} input tokens. Please reduce the length of the input.", "prompt")
    elif fit.no_room_to_generate and n_prompt == max_len:
        # vLLM's words (its input processor's _validate_model_input), which its tests match, then tokenloom's
        # (which callers match on); one message whichever front end refuses it.
        return PromptRefusal(f"The decoder prompt (length {n_prompt}) plus the number of requested output tokens "
                             f"(at least 1) is longer than the maximum model length of {max_len}. Make sure that "
                             "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                             f"output tokens). This model's maximum context length is {max_len} tokens, and your "
                             f"request has {n_prompt} input tokens, which leaves no room to generate. Please "
                             "reduce the length of the input.", "prompt")
    elif fit.no_room_to_generate:
        # vLLM 0.32's renderer (renderers/params.py, _token_len_check), whichever front end refuses it.
        return PromptRefusal(f"This model's maximum context length is {max_len} tokens. However, your prompt "
                             f"contains {n_prompt} input tokens, which exceeds this limit even without any output "
                             "tokens. Please reduce the length of the input prompt.", "prompt")
    if max_tokens_in_context and max_tokens is not None and n_prompt + max_tokens > max_len:
        return PromptRefusal(f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                             f"{max_len} tokens and your request has {n_prompt} input tokens "
                             f"({max_tokens} > {max_len} - {n_prompt}).", "max_tokens")
    if fit.exceeds_pool:
        # vLLM's start-up wording ("To serve at least one request with the model's max seq len ..."), for this
        # request: vLLM checks the pool once for max_model_len, tokenloom per request.
        groups_text = f" ({fit.per_group})" if fit.per_group else ""
        return PromptRefusal(
            f"To serve this request at its longest ({fit.final_len - 1} tokens of KV: {n_prompt} prompt + "
            f"{fit.final_len - 1 - n_prompt} generated), {fit.blocks_needed} KV-cache blocks are needed"
            f"{groups_text}, which is larger than the available KV cache ({fit.num_blocks} blocks of "
            f"{fit.block_size} tokens). Please lower max_tokens or the prompt length.", "max_tokens")
    return None


def max_model_len_that_fits(num_blocks: int, block_size: int, max_model_len: int,
                            kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
                            max_in_flight_tokens: int | None = None) -> int:
    """The largest max_model_len (at most `max_model_len`) one request of which fits the pool, every
    group counted as vLLM's start-up check does (cdiv(max_model_len, block_size) blocks for a full
    group, its cap for a sliding one); 0 if not even 1 fits. vLLM's `estimate_max_model_len`: a binary
    search, since a sliding group's cap itself depends on max_model_len."""
    groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec((0,))]
    in_flight = max_in_flight_tokens or 0

    def fits(length: int) -> bool:
        return sum(g.max_blocks_per_request(length, block_size, in_flight, length) for g in groups) <= num_blocks

    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def resolve_max_model_len(config: EngineConfig, model_max_len: int, default: int,
                          key: str = "max_position_embeddings") -> int:
    """The engine's max_model_len, resolved once at construction (EngineCoreHost; the simulator the same way):
    --max-model-len, else `default`; never past the model's context. The scheduler config is then built with
    it (its own checks run there). `key`: what the context comes from, named when it is the sliding window
    (disable_sliding_window caps the context there, as vLLM's derived max_model_len)."""
    max_model_len = config.max_model_len or default
    if max_model_len > model_max_len:
        why = (": its sliding_window, which disable_sliding_window caps the context at (vLLM's derived "
               "max_model_len)") if key == "sliding_window" else ""
        raise ConfigError(f"max_model_len={max_model_len} is larger than the model's context length "
                          f"({model_max_len}{why})")
    return max_model_len


def sched_max_len_default(config: EngineConfig, model_max_len: int, pool_tokens: int) -> int:
    """The model's context length, capped so the default stays workable on a small KV pool (`pool_tokens`:
    the longest request the pool holds, max_model_len_that_fits)."""
    sched = config.scheduler or SchedulerConfig()
    cap = min(model_max_len, _DEFAULT_MAX_MODEL_LEN, pool_tokens)
    if not sched.enable_chunked_prefill:
        cap = min(cap, sched.token_budget_ceiling)
    return max(cap, 2)
