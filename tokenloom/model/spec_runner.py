"""The runner's side of speculative decoding: which rows of the flattened batch verify drafts, how
their logits become tokens, and the proposer (n-gram or suffix decoding) fed with each request's
accepted tokens.

A request scheduled with d drafts (SchedulerOutput.scheduled_spec_decode_tokens) contributes
`num_scheduled_tokens` rows ending in its last accepted token followed by the d drafts; the KV of
every row is written (a rejected draft's slot is simply overwritten by the next step), and its last
1 + d rows are output rows: their logits verify the drafts (tokenloom/model/rejection_sampler.py).
After sampling, vLLM's runner proposes the next drafts for every request that sampled
(`propose_draft_token_ids`); the engine core collects them with `take_draft_token_ids()` and hands
them to the scheduler (vLLM's EngineCore.post_step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenloom.config import SpeculativeConfig
from tokenloom.core.outputs import SampleLogprobs
from tokenloom.model.rejection_sampler import RejectionSampler, VerifyRequest, greedy_accept
from tokenloom.model.sampler import GrammarRows, SamplingRow, all_plain_greedy, apply_grammar_bitmask
from tokenloom.spec_decode.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from tokenloom.spec_decode.ngram_proposer import NgramProposer


def verification_input_ids(token_ids: Sequence[int], start: int, num_tokens: int, drafts: Sequence[int]) -> list[int]:
    """The scheduled rows' input ids: known tokens from `start`, then the drafts (a placeholder
    draft, -1, is fed as token 0: its row's output is never used)."""
    known = token_ids[start : start + num_tokens - len(drafts)]
    return [*known, *(t if t >= 0 else 0 for t in drafts)]


@dataclass
class DraftTokenIds:
    req_ids: list[str]
    draft_token_ids: list[list[int]]


class SpecDecodeRunner:
    """Proposer + rejection sampler, owned by the ModelRunner when speculative decoding is on."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.proposer: NgramProposer | SuffixProposer = make_proposer(config, max_model_len)
        self.rejection_sampler = RejectionSampler()
        self._drafts: DraftTokenIds | None = None
        # Each request's drafts proposed after the last step it sampled in, from its tokens then:
        # what fills its placeholder drafts under async scheduling (the scheduler never sees them).
        self._latest: dict[str, list[int]] = {}

    # Request rows of the proposer --------------------------------------------------------------
    def add_request(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int | None = None) -> None:
        self.proposer.add_request(req_id, token_ids, num_prompt_tokens)

    def remove_request(self, req_id: str) -> None:
        self.proposer.remove_request(req_id)
        self._latest.pop(req_id, None)

    def reset(self) -> None:
        self.proposer.reset()
        self._drafts = None
        self._latest.clear()

    # Sampling ---------------------------------------------------------------------------------
    def sample(self, logits_fn, rows: list[SamplingRow], drafts: list[list[int]], kernels, return_logits: bool,
               grammar: GrammarRows | None = None
               ) -> tuple[list[list[int]], list[list[SampleLogprobs] | None] | None, torch.Tensor]:
        """Tokens per request from its 1 + d output rows. `logits_fn(fp32)` gives the logits; the
        grammar bitmask (a row per constrained output row) is applied to them first, as vLLM does
        before its rejection sampler, so every draft is verified against grammar-masked targets."""
        reqs = [VerifyRequest(row, d) for row, d in zip(rows, drafts)]
        if not return_logits and kernels is not None and all_plain_greedy(rows):
            logits = logits_fn(False)
            if grammar is not None:
                apply_grammar_bitmask(logits, grammar)
            target = kernels.argmax_rows(logits)
            nan_rows = target < 0
            if bool(nan_rows.any()):
                target[nan_rows] = logits[nan_rows].float().argmax(dim=-1)
            return greedy_accept(target.tolist(), reqs), None, logits
        logits = logits_fn(True)
        if grammar is not None:
            apply_grammar_bitmask(logits, grammar)
        out = self.rejection_sampler(logits, reqs)
        return out.token_ids, out.logprobs, logits

    # Proposing --------------------------------------------------------------------------------
    def propose(self, sampled: dict[str, list[int]], batch_req_ids: Sequence[str] | None = None) -> None:
        """Append each request's new tokens to its row and propose drafts for the requests that
        sampled this step (vLLM proposes nothing for a request that sampled nothing). `batch_req_ids`:
        every request scheduled in the step (the suffix proposer stops the others, as vLLM's)."""
        req_ids = [rid for rid, toks in sampled.items() if toks]
        for rid in req_ids:
            self.proposer.append_tokens(rid, sampled[rid])
        batch = req_ids if batch_req_ids is None else batch_req_ids
        drafts = self.proposer.propose(req_ids, batch_req_ids=batch)
        self._drafts = DraftTokenIds(req_ids, drafts) if req_ids else None
        if self._drafts is not None:
            self._latest.update(zip(req_ids, self._drafts.draft_token_ids))

    def latest_drafts(self, req_id: str) -> list[int]:
        """The drafts proposed for a request after the last step it sampled in ([] if none)."""
        return self._latest.get(req_id, [])

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> NgramProposer | SuffixProposer:
    """The proposer of `config.method`: vLLM's NgramProposer or SuffixDecodingProposer."""
    if config.method == "suffix":
        return SuffixProposer.from_config(config, max_model_len)
    # Imported here: it imports numba (~0.5 s), which a server without n-gram drafts never needs.
    from tokenloom.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer.from_config(config, max_model_len)
