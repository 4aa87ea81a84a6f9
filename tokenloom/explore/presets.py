"""Worked examples of iteration-level scheduling as explorer presets, each with a note on what it shows.

Most are one scenario: D requests already decoding and one P-token prompt arriving, sharing a
token budget B per step with chunked prefill on (vLLM's default: running requests first, the
prompt gets what is left; vLLM docs, "Optimization and Tuning", Chunked Prefill). Varying B shows
the trade-off between prefill speed and decode latency. Some textbook versions of these examples
use a budget smaller than max_num_seqs (M), which vLLM rejects; those presets are kept as
written, so the page shows the rejection, with a valid variant next to them that shows the same
effect (the variants are those of tests/test_scheduler_seeds.py).
"""

from __future__ import annotations

from typing import Any

_B_GE_M = (
    "vLLM requires max_num_batched_tokens (B) >= max_num_seqs (M): every running sequence needs at least "
    "one token per step, so this configuration is rejected."
)

PRESETS: list[dict[str, Any]] = [
    {
        "id": "budget-16",
        "title": "10 decodes + a 24-token prompt · B=16",
        "note": "D=10 running decodes and a 24-token prompt share a budget of B=16 tokens a step. Running "
        "requests go first: the 10 decodes take 10 tokens, the prefill gets the 6 left, so 24/6 = 4 steps. "
        "M=16 (not less than D), so max_num_seqs holds nothing back.",
        "knobs": {"D": 10, "P": 24, "B": 16, "M": 16},
    },
    {
        "id": "budget-32",
        "title": "10 decodes + a 24-token prompt · B=32",
        "note": "The same with B=32: the prefill gets 22 tokens in the first step and the last 2 in "
        "the next.",
        "knobs": {"D": 10, "P": 24, "B": 32, "M": 32},
    },
    {
        "id": "budget-8-invalid",
        "title": "B=8 with M=32 (invalid)",
        "note": "A budget smaller than the number of running decodes, with M=32. " + _B_GE_M + " The next "
        "preset shows the same effect with a valid configuration.",
        "knobs": {"D": 10, "P": 24, "B": 8, "M": 32},
    },
    {
        "id": "budget-8-valid",
        "title": "Decodes take the whole budget (B=10, M=10)",
        "note": "What a budget of 8 would show, within vLLM's rules: the running decodes use the whole budget, "
        "the prefill gets 0 tokens every step and never completes. (With B=8 < D=10, 2 decodes would also be "
        "left out; a valid config cannot show that, since B >= M >= the number running.)",
        "knobs": {"D": 10, "P": 24, "B": 10, "M": 10},
    },
    {
        "id": "decodes-leave-one-token",
        "title": "Decodes leave the prompt 1 token a step (B=11, M=11)",
        "note": "D=10 decodes and B=11: under vLLM's rules the 24-token prompt gets the one token they leave, "
        "so its first token comes after 24 steps; behind hundreds of decodes an 8k-token document waits "
        "hundreds of steps the same way (vLLM issues #14003, #57413). The next preset bounds that wait.",
        "knobs": {"D": 10, "P": 24, "B": 11, "M": 11, "steps": 28},
    },
    {
        "id": "bounded-prefill-wait",
        "title": "The same with a bounded wait (wait bound 2 steps, chunk 4)",
        "note": "tokenloom's opt-in --max-prefill-wait-steps 2 --min-prefill-chunk 4: once the prompt has waited "
        "more than 2 steps it gets 4 tokens a step ahead of the decodes, so its prefill is done after 9 steps "
        "instead of 24. The cost is visible in the decode column: 3 of the 10 decodes skip each of those 5 steps "
        "(policy_actions in the step trace says why).",
        "knobs": {"D": 10, "P": 24, "B": 11, "M": 11, "steps": 28, "wait_steps": 2, "min_chunk": 4},
    },
    {
        "id": "slo-budget",
        "title": "B=32 with an ITL target of 16 tokens a step (SLO budget)",
        "note": "tokenloom's opt-in --target-itl-ms, here at 1 ms a token, so a 16 ms target is 16 tokens a step: "
        "with B=32 the prompt would get 22 tokens in its first step (the budget-32 preset), making that step "
        "3.2x as long as a decode-only one for all 10 decodes. The controller keeps each step to 16 tokens "
        "while decodes run, so the prompt gets 6 a step and its prefill takes 4 steps instead of 2: "
        "time to first token traded for inter-token latency (policy.slo_budget in the step trace says why).",
        "knobs": {"D": 10, "P": 24, "B": 32, "M": 32, "itl_target": 16},
    },
    {
        "id": "budget-16-m32-invalid",
        "title": "B=16 with M=32 (invalid)",
        "note": "The B=16 example with M=32, as it is often written. " + _B_GE_M,
        "knobs": {"D": 10, "P": 24, "B": 16, "M": 32},
    },
    {
        "id": "group-a",
        "title": "Shared budget: the prefill advances",
        "note": "D=10, P=24, B=16, decode first, chunked on: 6 tokens a step for the prefill, done in 4 steps. "
        "Decodes never stall behind the prompt, which is what chunked prefill buys.",
        "knobs": {"D": 10, "P": 24, "B": 16, "M": 16},
    },
    {
        "id": "group-b",
        "title": "Budget eaten by decodes",
        "note": "D=16, P=24, B=16. The decodes take all 16 tokens, the prefill gets 0 every "
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
        "id": "three-requests",
        "title": "Three requests, step by step",
        "note": "Budget 6, prefill chunk cap 4 (long_prefill_token_threshold), running first then FCFS. "
        "A(prompt 4, output 2) and B(8, 3) arrive at step 0, C(3, 2) at step 1. The schedule: "
        "{A:4,B:2}, {A:1,B:4,C:1}, {B:2,C:2}, {B:1,C:1}, {B:1}: 19 tokens, P+G-1 per request (the first "
        "output token comes with the last prompt chunk). Requests join and leave the batch between steps: "
        "iteration-level scheduling, as in the Orca paper (Yu et al., OSDI 2022).",
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

DEFAULT_PRESET = "budget-16"
