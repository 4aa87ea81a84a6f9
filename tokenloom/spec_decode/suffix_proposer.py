"""Suffix decoding (arXiv 2411.04975), decision for decision vLLM 0.32's SuffixDecodingProposer
(vllm/v1/spec_decode/suffix_decoding.py) over the same library, arctic-inference's
SuffixDecodingCache (an optional extra: `make test` installs it; see SUFFIX_INSTALL_HINT).

The cache keeps a suffix tree per active request over its prompt (the "local" tree) and one global
tree over the outputs of up to `max_cached_requests` requests (FIFO eviction), live ones included.
A draft is the likeliest continuation of the request's last `max_tree_depth` tokens in either tree
(the higher-scoring of the two), as long as each token's frequency estimate is at least
`min_token_prob` and the draft is at most `max_spec_factor` x the matched length. So a request can
copy what *another* request generated, which the n-gram proposer (own context only) cannot.

vLLM's bookkeeping, reproduced here because it decides which outputs the trees hold:
- a request enters the cache (`start_request` with its prompt) at the first step it samples in;
  only the tokens it samples from then on are added (`add_active_response`);
- after each step, every active request that was *not scheduled* in that step is stopped (vLLM
  removes unscheduled requests from its persistent batch): its local tree is dropped; its output
  stays in the global tree until the request is started again, which first evicts that output
  (so a request skipped for one step, or preempted, restarts from its prompt and new tokens);
- nothing is proposed for a request that sampled nothing (a prefill chunk) or is at max_model_len,
  and a draft is at most min(K, max_model_len - num_tokens - 1) tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenloom.config import SUFFIX_INSTALL_HINT, ConfigError


def load_suffix_cache_class():
    """arctic-inference's SuffixDecodingCache, or a clear error saying how to install it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as exc:
        raise ConfigError(
            "speculative_config.method: Arctic Inference is required for suffix decoding "
            f"({exc}). Install it: {SUFFIX_INSTALL_HINT}"
        ) from exc
    return SuffixDecodingCache


class SuffixProposer:
    """The runner's suffix-decoding proposer. Same seam as NgramProposer: `add_request` (a new or
    resumed request: its whole sequence and prompt length), `append_tokens` (tokens it sampled),
    `remove_request`, `reset`, and after sampling `propose(req_ids, batch_req_ids=...)` for the
    requests that sampled, `batch_req_ids` being every request scheduled in the step."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float, max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_model_len = max_model_len
        self._cache_class = load_suffix_cache_class()
        self.cache = self._cache_class(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.tokens: dict[str, list[int]] = {}  # prompt + accepted outputs (vLLM's token_ids_cpu row)
        self.num_prompt_tokens: dict[str, int] = {}
        self._new: dict[str, list[int]] = {}  # tokens sampled since the last propose

    @classmethod
    def from_config(cls, spec_config, max_model_len: int) -> SuffixProposer:
        return cls(spec_config.num_speculative_tokens, spec_config.suffix_decoding_max_tree_depth,
                   spec_config.suffix_decoding_max_cached_requests, spec_config.suffix_decoding_max_spec_factor,
                   spec_config.suffix_decoding_min_token_prob, max_model_len)

    # The per-request token rows ------------------------------------------------------------
    def add_request(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int | None = None) -> None:
        self.tokens[req_id] = [int(t) for t in token_ids[: self.max_model_len]]
        self.num_prompt_tokens[req_id] = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self._new.pop(req_id, None)

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        row = self.tokens.get(req_id)
        if row is None:
            return
        m = min(len(token_ids), self.max_model_len - len(row))
        if m > 0:
            row.extend(int(t) for t in token_ids[:m])
        # vLLM adds the step's sampled ids to the cache whole (its row is capped, the tree is not).
        self._new.setdefault(req_id, []).extend(int(t) for t in token_ids)

    def remove_request(self, req_id: str) -> None:
        """The runner dropped the request (finished, aborted, preempted). vLLM's proposer stops it at
        its next propose (it is no longer in the batch); its output stays in the global tree."""
        self.tokens.pop(req_id, None)
        self.num_prompt_tokens.pop(req_id, None)
        self._new.pop(req_id, None)
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)

    def reset(self) -> None:
        """Forget every request and every cached output (a new engine run on the same runner)."""
        self.tokens.clear()
        self.num_prompt_tokens.clear()
        self._new.clear()
        self.cache = self._cache_class(max_tree_depth=self.max_tree_depth,
                                       max_cached_requests=self.max_cached_requests)

    # Proposing -------------------------------------------------------------------------------
    def propose(self, req_ids: Sequence[str], k: int | None = None,
                batch_req_ids: Iterable[str] | None = None) -> list[list[int]]:
        """Drafts for each request in `req_ids` (those that sampled this step; empty: none); `k`
        lowers the draft bound for this call. Then stops the active requests outside the batch."""
        k = self.k if k is None else min(k, self.k)
        cache = self.cache
        drafts: list[list[int]] = []
        for req_id in req_ids:
            new = self._new.pop(req_id, None)
            row = self.tokens.get(req_id)
            if not new or row is None:  # sampled nothing: a prefill chunk (vLLM skips it)
                drafts.append([])
                continue
            num_tokens = len(row)
            if num_tokens >= self.max_model_len:
                drafts.append([])
                continue
            if req_id not in cache.active_requests:
                if req_id in cache.cached_requests:
                    cache.evict_cached_response(req_id)  # restart: its earlier output goes
                cache.start_request(req_id, row[: self.num_prompt_tokens[req_id]])
            cache.add_active_response(req_id, new)
            pattern = row[max(0, num_tokens - self.max_tree_depth) : num_tokens]
            draft = cache.speculate(
                req_id,
                pattern,
                max_spec_tokens=min(k, self.max_model_len - num_tokens - 1),
                max_spec_factor=self.max_spec_factor,
                min_token_prob=self.min_token_prob,
            )
            drafts.append(list(draft.token_ids))
        batch = set(req_ids if batch_req_ids is None else batch_req_ids)
        for req_id in [r for r in cache.active_requests if r not in batch]:
            cache.stop_request(req_id)
        return drafts
