"""A seeded request run again on one engine, where the second run's prompt is a prefix-cache hit (issue 32).

What docs/reliability.md ("Seeded requests and prefix-cache hits") promises, pinned: in float32 the hit
gives the cold run's tokens, and its logprobs exactly when the hit leaves two or more prompt tokens to
compute (a prefill chunk, the path the cold prefill took); when it leaves one, that token runs the decode
path (another attention kernel, a one-row GEMM) and the logprobs move by float32 rounding only. In
bfloat16 nothing is promised beyond a bound: the two paths round differently (vLLM documents the same:
no reproducibility across cache states without its GPU-only batch-invariant mode).
"""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams

BLOCK = 4
# Each prompt is 12 tokens of whole blocks (the hit) plus a tail the hit leaves to compute; they share
# no block, so each one's first run is cold.
ONE_TOKEN_TAIL = [(7 * j) % 190 + 5 for j in range(13)]
THREE_TOKEN_TAIL = [(11 * j) % 190 + 3 for j in range(15)]
# bfloat16, the default model: first-token logprobs of the hit within this of the cold run's. Measured on
# an AMX Xeon: 0.057 (one-token tail) and 0.10 (three-token tail) with the CPU kernels, 0.056 / 0.059 on
# the torch path; ~0.05 in issue 32's note. One wrong KV block in the hit changes the top-5 tokens.
BF16_BOUND = 0.3
TEXT = ("The history of the city begins with a small settlement on the river, where fishermen and traders met "
        "every spring to exchange salt, grain and stories. Over the centuries the market grew into a town.")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def _cold_then_hit(llm: LLM, prompt: list[int], max_tokens: int = 6):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=max_tokens, logprobs=5)
    cold, hit = (llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for _ in range(2))
    hit_len = (len(prompt) - 1) // llm.llm_engine.cache_config.block_size * llm.llm_engine.cache_config.block_size
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens == hit_len, "the second run must be a cache hit"
    return cold.outputs[0], hit.outputs[0]


def _max_logprob_gap(a: dict, b: dict) -> float:
    """Over the top-5 tokens both runs report (the fifth and sixth of a flat random model may swap
    places in bfloat16); at least three must be common."""
    common = set(a) & set(b)
    assert len(common) >= 3, (a, b)
    return max(abs(a[t].logprob - b[t].logprob) for t in common)


def _engine(tiny_dir, dtype: str) -> LLM:
    return LLM(str(tiny_dir), dtype=dtype, block_size=BLOCK, num_blocks=64, enable_prefix_caching=True,
               max_num_seqs=4)


def test_float32_hit_equals_the_cold_run(tiny_dir) -> None:
    llm = _engine(tiny_dir, "float32")
    cold, hit = _cold_then_hit(llm, THREE_TOKEN_TAIL)
    assert hit.token_ids == cold.token_ids
    # A prefill chunk either way: the same numbers, to the bit, at every position.
    assert [{t: lp.logprob for t, lp in d.items()} for d in hit.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in cold.logprobs]

    cold, hit = _cold_then_hit(llm, ONE_TOKEN_TAIL)
    assert hit.token_ids == cold.token_ids
    # The last prompt token alone runs the decode path: float32 rounding, nothing more.
    assert max(_max_logprob_gap(a, b) for a, b in zip(cold.logprobs, hit.logprobs)) < 1e-4


def test_bfloat16_hit_stays_within_the_documented_bound() -> None:
    # The default model: its peaked distributions show a wrong KV block (a random tiny model's flat ones
    # hardly move); weights dequantized, the path the bf16 note was seen on.
    llm = LLM(dtype="bfloat16", quantization="none", block_size=16, kv_cache_memory=64 << 20,
              enable_prefix_caching=True, max_num_seqs=4)
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) >= 36
    for prompt in (ids[:33], ids[1:36]):  # a hit of 32 leaves one token, then three (no block shared)
        cold, hit = _cold_then_hit(llm, prompt, max_tokens=1)
        # Only the prefill's logprobs are comparable: a seeded draw may part at a near-tie after them.
        assert _max_logprob_gap(cold.logprobs[0], hit.logprobs[0]) <= BF16_BOUND
