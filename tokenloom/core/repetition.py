"""vLLM's repetition detection (SamplingParams.repetition_detection): a request whose output ends in the
same N-gram `min_count` times in a row stops, finish_reason "repetition" (vLLM's check_sequence_repetition,
v1/core/sched/utils.py).

The scheduler asks after each output token it appends (so a step's accepted drafts are checked one by one,
and async scheduling's tokens as they land), once the request has its min_tokens. Only the output's tail
is read: at most max_pattern_size * min_count tokens, whatever the output's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.sampling_params import RepetitionDetectionParams

# The request's stop_reason when it ends this way (vLLM's).
REPETITION_STOP_REASON = "repetition_detected"


def check_sequence_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """True when the last `n` tokens repeat `params.min_count` times back to back, for some pattern length
    n from min_pattern_size (0: 1) to max_pattern_size, shortest first; off (False) when max_pattern_size is
    0 or min_count below 2."""
    shortest = max(params.min_pattern_size, 1)
    longest, count = params.max_pattern_size, params.min_count
    if longest <= 0 or count < 2 or shortest > longest:
        return False
    for length in range(shortest, longest + 1):
        if length * count > len(token_ids):
            return False  # every longer pattern needs more tokens still
        if _tail_repeats(token_ids, length, count):
            return True
    return False


def _tail_repeats(token_ids: Sequence[int], length: int, count: int) -> bool:
    """The last `length` tokens equal each of the `count - 1` blocks of `length` tokens before them."""
    end = len(token_ids)
    tail = token_ids[end - length:end]
    return all(token_ids[end - length * (k + 1):end - length * k] == tail for k in range(1, count))
