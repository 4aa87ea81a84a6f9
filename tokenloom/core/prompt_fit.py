"""Whether a request can ever be served: the one check behind the scheduler's RequestRejected and the
API server's HTTP 400 (each caller words the answer its own way, the server with vLLM's wording)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenloom.core.kv_cache_manager import cdiv


@dataclass(frozen=True)
class PromptFit:
    num_prompt_tokens: int
    max_model_len: int
    final_len: int  # the longest the request can grow: prompt + max_tokens, capped at max_model_len
    blocks_needed: int  # KV blocks at that length
    num_blocks: int  # KV blocks in the pool

    @property
    def empty(self) -> bool:
        return self.num_prompt_tokens == 0

    @property
    def no_room_to_generate(self) -> bool:
        return self.num_prompt_tokens >= self.max_model_len

    @property
    def exceeds_pool(self) -> bool:
        """It could never finish: at its longest it needs more blocks than the whole pool."""
        return self.blocks_needed > self.num_blocks


def prompt_fit(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int,
               num_blocks: int, blocks_for_tokens: Callable[[int], int] | None = None) -> PromptFit:  # fmt: skip
    """`blocks_for_tokens`: blocks a sequence of n tokens holds (default cdiv(n, block_size); the
    scheduler passes its KV manager's, which counts every KV cache group of a hybrid model)."""
    final_len = min(num_prompt_tokens + max_tokens, max_model_len)
    # The last sampled token is never fed back, so the KV holds at most final_len - 1 tokens.
    blocks_needed = blocks_for_tokens(final_len - 1) if blocks_for_tokens else cdiv(final_len - 1, block_size)
    return PromptFit(num_prompt_tokens, max_model_len, final_len, blocks_needed, num_blocks)
