"""Row counts the pre-packed GEMMs run at: the runner pads to them (tokenloom/model/linear.py) and the
cost model charges them (core/cost_model.py). Torch-free and at the bottom so both can import it; the
simulator's profile fingerprint covers this file with tokenloom/model (sim/profile.py)."""

from __future__ import annotations


def packed_rows(m: int) -> int:
    """The row count a pre-packed GEMM runs at for m rows: m itself up to 16, then the next of 8 steps
    per octave (at most 12.5 % padding; 128, 256, 2048 ... are exact).

    oneDNN builds and caches one primitive per input shape, each holding JIT code and a scratchpad
    that grows with the rows (0.7-4 MiB here); with exact shapes a server that sees every row count
    up to max_num_batched_tokens fills its 1,024-entry cache: RSS grew by ~850 MiB over 10,000 requests.
    Buckets bound the shapes to ~90 per weight up to 8,192 rows.
    """
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step
