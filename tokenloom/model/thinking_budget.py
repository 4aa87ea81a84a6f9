"""`thinking_token_budget` (vLLM 0.32's SamplingParams field, its ThinkingBudgetStateHolder in
vllm/v1/sample/thinking_budget_state.py): a request may think at most that many tokens; then the reasoning
parser's end string (`</think>`) is forced, one token a step, and the model answers.

Thinking is what follows the last start string (`<think>`) that no end string closed: in the prompt (the chat
template opened it, as DeepSeek-R1's and the Qwen3 -Thinking templates do: the prompt's tokens after it count
too) or in the output (the model wrote it). The step whose thinking already holds `budget` tokens samples the end
string's first token instead; its other tokens follow, one per step. After the end (forced or the model's own),
a new start string opens a new budget. Forcing is vLLM's: the token's logit is set to 1e9 after the penalties,
so greedy and random sampling both take it.

One tracker per request, in the runner that samples it; it reads the request's tokens incrementally (the runner's
own list, prompt + outputs), so a step costs only its new tokens. Speculative decoding is refused with a budget
(the engine's input processor), so one token is read per step.
"""

from __future__ import annotations

from collections.abc import Sequence


def _last_index(tokens: Sequence[int], pattern: Sequence[int]) -> int:
    """Where `pattern` last starts in `tokens`, or -1."""
    n = len(pattern)
    if not n:
        return -1
    for i in range(len(tokens) - n, -1, -1):
        if list(tokens[i:i + n]) == list(pattern):
            return i
    return -1


def _ends_with(tokens: Sequence[int], end: int, pattern: Sequence[int]) -> bool:
    """Whether tokens[:end] ends with `pattern`."""
    n = len(pattern)
    return 0 < n <= end and list(tokens[end - n:end]) == list(pattern)


class ThinkingBudget:
    """One request's budget. `start_ids` / `end_ids`: the reasoning parser's start and end strings as tokens."""

    def __init__(self, budget: int, start_ids: Sequence[int], end_ids: Sequence[int], token_ids: Sequence[int],
                 num_prompt_tokens: int) -> None:
        self.budget = budget
        self.start_ids = tuple(start_ids)
        self.end_ids = tuple(end_ids)
        self.forcing: int | None = None  # the position in end_ids forced next, while the end is being forced
        prompt = token_ids[:num_prompt_tokens]
        last_start, last_end = _last_index(prompt, self.start_ids), _last_index(prompt, self.end_ids)
        self.in_think = last_start > last_end
        self.count = num_prompt_tokens - (last_start + len(self.start_ids)) if self.in_think else 0
        self.read = num_prompt_tokens  # tokens read so far

    def forced_token(self, token_ids: Sequence[int]) -> int | None:
        """The token this step must sample (an end-string token), or None: the new tokens read first."""
        for end in range(self.read + 1, len(token_ids) + 1):
            self._read(token_ids, end)
        self.read = len(token_ids)
        if self.forcing is None and self.in_think and self.count >= self.budget:
            self.forcing = 0
        return self.end_ids[self.forcing] if self.forcing is not None else None

    def _read(self, token_ids: Sequence[int], end: int) -> None:
        """Token `end - 1`, the last of token_ids[:end]."""
        if self.forcing is not None:
            if token_ids[end - 1] == self.end_ids[self.forcing]:
                self.forcing += 1
                if self.forcing == len(self.end_ids):
                    self.forcing, self.in_think, self.count = None, False, 0
            return  # (a token other than the forced one would be forced again)
        if _ends_with(token_ids, end, self.end_ids):
            self.in_think, self.count = False, 0
        elif _ends_with(token_ids, end, self.start_ids):
            self.in_think, self.count = True, 0
        elif self.in_think:
            self.count += 1
