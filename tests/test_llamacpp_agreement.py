"""benchmarks/real_models/llamacpp_agreement.py: the harness that compares greedy tokens with llama.cpp.

Its first version compared tokenloom's `ignore_eos` (vLLM's: keep going after sampling an EOS) with
llama-server's (ban every end-of-generation token), so on 4 of the 8 Qwen2.5 0.5B prompts the "first
divergence" was tokenloom ending the answer where llama.cpp could not (docs/performance.md, "Greedy
agreement with llama.cpp"). Checked here on the shipped model: the ban the harness gives tokenloom
keeps every EOG token out and changes nothing before the answer's end; and the per-prompt margins.
"""

from __future__ import annotations

from benchmarks.real_models.llamacpp_agreement import Greedy, compare, tokenloom_greedy
from tokenloom.model.paths import default_model_path
from tokenloom.model.tokenizer import load_tokenizer


def test_banned_eog_tokens_continue_the_answer_as_llamacpp_does() -> None:
    path = str(default_model_path())
    tok = load_tokenizer(path)
    eos = tok.eos_token_id
    # Two short-answer prompts: SmolLM2's first token for the second is a near-tie ("The" over "Le" by
    # 0.01 nats on a VNNI build, "Le" on an AVX2 one, whose answer runs longer), so which answer ends
    # first depends on the CPU; the test needs one that ends, on any CPU.
    questions = ("What is 2+2? Answer with a number only.", "Which city is the capital of France?")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    # Each alone: on the quantized path a prompt's greedy tokens can change with the prompts batched beside it.
    for prompt in prompts:
        free, = tokenloom_greedy(path, "gguf", [prompt], 48, banned=[])
        if eos in free.tokens:
            break
    assert eos in free.tokens, "a short answer ends within 48 tokens: the ban below is exercised"
    end = free.tokens.index(eos)
    banned, = tokenloom_greedy(path, "gguf", [prompt], 48, banned=[eos])
    assert eos not in banned.tokens and len(banned.tokens) == 48
    assert banned.tokens[:end] == free.tokens[:end]  # the same answer up to where it ended
    assert banned.tokens[end] != eos and len(banned.top) == 48


def test_compare_reports_prefix_and_both_margins() -> None:
    ours = [Greedy([1, 2, 3], [{1: -0.1}, {2: -0.5, 7: -0.9}, {3: -0.2}]),
            Greedy([4, 5], [{4: -0.1}, {5: -0.3, 9: -2.0}])]
    theirs = [Greedy([1, 7, 3], [{1: -0.2}, {7: -0.6, 2: -0.8}, {3: -0.1}]),
              Greedy([4, 6], [{4: -0.1}, {6: -0.2}])]  # 5 is outside llama.cpp's top-N there
    r = compare(ours, theirs)
    assert r["common_prefix"] == [1, 1]
    assert r["margin_first"] == [0.4, None]  # ours: -0.5 - (-0.9); 6 is not in our top-N either
    assert r["margin_llamacpp"] == [0.2, None]
    assert r["logprob_gap"] == [0.1, 0.0]  # the shared first token: |-0.1 - -0.2|, |-0.1 - -0.1|
    same = compare([ours[0]], [ours[0]])
    assert same == {"common_prefix": [3], "margin_first": [None], "margin_llamacpp": [None], "logprob_gap": [0.0]}
