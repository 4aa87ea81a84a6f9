"""Constrained requests with n-gram speculation: deterministic counts (greedy), no wall clock.

For the JSON-schema prompts of tests/test_structured_spec_decode.py, run once without and once with
n-gram drafts and print: identical output (yes/no), drafts proposed / accepted and the acceptance
rate. (Engine step counts are not printed: they include the empty steps spent waiting for the grammars
to compile, which depend on the machine.) Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/structured/structured_spec_acceptance.py [--k 4]
"""

from __future__ import annotations

import argparse

from tests.test_structured_spec_decode import PROMPTS, _params
from tokenloom import LLM


def run(speculative_config: dict | None) -> tuple[list[list[int]], object]:
    llm = LLM(max_model_len=512, speculative_config=speculative_config)
    outs = llm.generate(PROMPTS, [_params(i, temperature=0.0) for i in range(len(PROMPTS))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.scheduler.spec_decoding_totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    plain_ids, _ = run(None)
    spec_ids, totals = run(ngram)
    tokens = sum(len(t) for t in plain_ids)
    print(f"requests {len(PROMPTS)}, output tokens {tokens}, identical output: {plain_ids == spec_ids}")
    rate = totals.num_accepted_tokens / max(totals.num_draft_tokens, 1)
    print(f"drafts (k={args.k}): {totals.num_drafts} proposals, {totals.num_draft_tokens} tokens, "
          f"{totals.num_accepted_tokens} accepted ({rate:.0%})")


if __name__ == "__main__":
    main()
