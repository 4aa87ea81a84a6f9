"""The seeds' worked examples as explorer presets, each with a note on what it shows.

Where a seed's simplified model uses a configuration vLLM rejects (max_num_batched_tokens <
max_num_seqs), the preset as written is kept, so the page shows the rejection, and a valid variant
next to it shows the same phenomenon (the variants are those of tests/test_scheduler_seeds.py).
"""

from __future__ import annotations

from typing import Any

_B_GE_M = (
    "vLLM requires max_num_batched_tokens (B) >= max_num_seqs (M): every running sequence needs at least "
    "one token per step. The seed's simplified page model does not check this."
)

PRESETS: list[dict[str, Any]] = [
    {
        "id": "table3-b16",
        "title": "Table 3 · B=16 (M=16)",
        "note": "Seed 000, Table 3, middle row: D=10 running decodes, a 24-token prompt, budget B=16. Running "
        "requests go first: the 10 decodes take 10 tokens, the prefill gets the 6 left, so 24/6 = 4 steps. "
        "The seed uses M=32, which breaks B >= M; M=16 is still more than D, so nothing else changes.",
        "knobs": {"D": 10, "P": 24, "B": 16, "M": 16},
    },
    {
        "id": "table3-b32",
        "title": "Table 3 · B=32 (M=32)",
        "note": "Table 3, last row: with B=32 the prefill gets 22 tokens in the first step and the last 2 in "
        "the next.",
        "knobs": {"D": 10, "P": 24, "B": 32, "M": 32},
    },
    {
        "id": "table3-b8-seed",
        "title": "Table 3 · B=8, M=32 (as in the seed: invalid)",
        "note": "Table 3, first row, as the seed writes it. " + _B_GE_M + " The next preset shows the same "
        "phenomenon with a valid configuration.",
        "knobs": {"D": 10, "P": 24, "B": 8, "M": 32},
    },
    {
        "id": "table3-b8-valid",
        "title": "Table 3 · B=8 row, valid variant (B=10, M=10)",
        "note": "The B=8 row's point within vLLM's rules: the running decodes use the whole budget, the "
        "prefill gets 0 tokens every step and never completes. (With B=8 < D=10 the seed also has 2 decodes "
        "left out; a valid config cannot show that, since B >= M >= the number running.)",
        "knobs": {"D": 10, "P": 24, "B": 10, "M": 10},
    },
    {
        "id": "table3-b16-seed",
        "title": "Table 3 · B=16, M=32 (as in the seed: invalid)",
        "note": "Table 3's middle row and group A as the seed writes them. " + _B_GE_M,
        "knobs": {"D": 10, "P": 24, "B": 16, "M": 32},
    },
    {
        "id": "group-a",
        "title": "Group A · shared budget",
        "note": "Seed 000, group A: D=10, P=24, B=16, decode first, chunked on. 6 tokens a step for the "
        "prefill, done in 4 steps. (M=16 instead of the seed's 32, to keep B >= M.)",
        "knobs": {"D": 10, "P": 24, "B": 16, "M": 16},
    },
    {
        "id": "group-b",
        "title": "Group B · budget eaten by decodes",
        "note": "Seed 000, group B: D=16, P=24, B=16. The decodes take all 16 tokens, the prefill gets 0 every "
        "step: it never completes. Valid configs force M = B = D here (B >= M >= D >= B); with M=16 the "
        "max_num_seqs limit would also hold the prefill back, but the budget runs out first, as in vLLM's "
        "waiting loop (`while token_budget > 0`), so the step is bound by the budget.",
        "knobs": {"D": 16, "P": 24, "B": 16, "M": 16},
    },
    {
        "id": "chunked-off",
        "title": "Chunked prefill off: break, not cut",
        "note": "D=10, P=24, B=32 with chunked prefill off: the prompt does not fit the 22 tokens left, so "
        "admission stops (a break, not a skip) and 22 tokens of budget stay idle every step. Chunked off "
        "also needs B >= max_model_len, hence max_model_len=32.",
        "knobs": {"D": 10, "P": 24, "B": 32, "M": 32, "chunked": False, "max_model_len": 32},
    },
    {
        "id": "timeline-001",
        "title": "Seed 001 §4 · three-request timeline",
        "note": "Budget 6, prefill chunk cap 4 (long_prefill_token_threshold), running first then FCFS. "
        "A(prompt 4, output 2) and B(8, 3) arrive at step 0, C(3, 2) at step 1. The seed's schedule: "
        "{A:4,B:2}, {A:1,B:4,C:1}, {B:2,C:2}, {B:1,C:1}, {B:1}: 19 tokens, P+G-1 per request.",
        "knobs": {
            "scenario": "requests", "B": 6, "M": 4, "threshold": 4, "block_size": 4, "num_blocks": 64,
            "max_model_len": 64, "steps": 12,
            "requests": [
                {"id": "A", "arrival_step": 0, "prompt_len": 4, "max_tokens": 2},
                {"id": "B", "arrival_step": 0, "prompt_len": 8, "max_tokens": 3},
                {"id": "C", "arrival_step": 1, "prompt_len": 3, "max_tokens": 2},
            ],
        },  # fmt: skip
    },
    {
        "id": "kv-preemption",
        "title": "KV pool runs out: preemption",
        "note": "The token budget is not the only limit. 8 decodes (12-token prompts) and a 32-token prompt share "
        "a pool of 48 blocks of 4 tokens. The prompt completes in step 5, but every context grows a token a step: "
        "at step 8 allocate_slots finds no free block and the last of running (the newest request, p) is "
        "preempted: blocks freed, progress reset, back to waiting. A step that preempts admits nobody, and a "
        "preempted request is readmitted only when its whole sequence fits again, so the pool keeps shrinking "
        "the batch: d7, d6, d5 follow.",
        "knobs": {"D": 8, "C": 12, "P": 32, "B": 32, "M": 16, "block_size": 4, "num_blocks": 48, "steps": 24},
    },
]

DEFAULT_PRESET = "table3-b16"
