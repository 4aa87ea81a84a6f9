"""An opt-in policy that drafts less when drafting does not pay (tokenloom's own; off by default,
then every decision is vLLM's).

Verifying d drafts costs d extra rows in the step's batch, whether they are accepted or not. That is
nearly free while the step is bound by reading the weights (few rows) and costs its full share once
the batch is compute-bound (many rows): vLLM users see n-gram speculation slow serving down at high
concurrency (vllm#19254, #6494). The policy trims each request's drafts after the proposer ran:

* batch cap: at most `adaptive_max_batch_tokens` verification rows per step in all, shared evenly
  among the requests that will decode (K_eff = cap // num_decoding - 1, at most K, maybe 0);
* acceptance gate: a request whose running acceptance estimate (an exponential average of
  accepted / drafted over its verifications) is under `adaptive_min_acceptance` drafts nothing; while
  it does not draft its estimate drifts back toward the prior, so it tries again now and then (the
  text it copies may start later in the output).

Trimming a proposal to k tokens gives exactly what the proposer returns for k (the tokens that
follow the match), so the policy never changes which tokens are drafted, only how many.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenloom.config import SpeculativeConfig

_PRIOR = 0.5  # acceptance assumed for a request never verified
_ALPHA = 0.3  # weight of the newest verification in the running estimate
_RECOVERY = 0.01  # per step without drafts, this share of the gap to the prior comes back


class AdaptiveDraftPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = int(config.num_speculative_tokens or 0)
        self.min_acceptance = float(config.adaptive_min_acceptance)
        self.max_batch_tokens = int(config.adaptive_max_batch_tokens)
        self.acceptance: dict[str, float] = {}

    def observe(self, per_request: dict[str, list[int]]) -> None:
        """A step's verification results: {request: [drafts scheduled, accepted]}."""
        for rid, (drafted, accepted) in per_request.items():
            if drafted <= 0:
                continue
            est = self.acceptance.get(rid, _PRIOR)
            self.acceptance[rid] = (1 - _ALPHA) * est + _ALPHA * (accepted / drafted)

    def num_drafts(self, num_decoding: int) -> int:
        """Drafts per request allowed by the batch cap with `num_decoding` requests decoding."""
        if num_decoding <= 0:
            return self.k
        return max(0, min(self.k, self.max_batch_tokens // num_decoding - 1))

    def trim(self, req_ids: Iterable[str], drafts: list[list[int]], num_decoding: int) -> list[list[int]]:
        cap = self.num_drafts(num_decoding)
        out: list[list[int]] = []
        for rid, d in zip(req_ids, drafts):
            est = self.acceptance.get(rid, _PRIOR)
            if est < self.min_acceptance:
                self.acceptance[rid] = est + _RECOVERY * (_PRIOR - est)
                out.append([])
            else:
                out.append(d[:cap])
        return out

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.acceptance.pop(rid, None)
