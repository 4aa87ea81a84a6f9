"""The fused decode step (the fused decoder, fused_decode.py) over an unquantized model's float32 / bf16
weights against the per-op path: hidden states / logits close, the same greedy text, and the
fallbacks (prefill, mixed steps, more than `max_rows` rows, the packed bf16 KV layout) unchanged.

float32 keeps its layer weights plain for the fused step only with TOKENLOOM_FUSED_FLOAT=1 (oneDNN
packs them otherwise); bf16 takes the step wherever oneDNN cannot pack bf16 (AVX2 without
avx_ne_convert) or packing is off, so the bf16 cases turn packing off to run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_gguf_decode import count_fused_runs
from tests.test_model_runner import BLOCK, Tiny, new_req, prompt, step
from tests.tiny_models import make_tiny_hf_model
from tokenloom.model.fused_decode import BF16, DENSE, linear_parts
from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.model.loader import load_model

kernels = gguf_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="GGUF kernels unavailable (no compiler)")


# --------------------------------------------------------------------------- the dense kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scalar", [False, True])
def test_dense_kernel_matches_matmul(dtype: torch.dtype, scalar: bool) -> None:
    """dense_linear (the decoder's float / bf16 range kernel) against x @ w.T + b: 4-row blocks with
    a row tail, K with an 8- and a scalar tail, every M from 1 to 9 (pairs and a single row)."""
    g = torch.Generator().manual_seed(0)
    kernels.set_force_scalar(scalar)
    try:
        for n, k in ((7, 5), (61, 37), (130, 96), (576, 64)):
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g)
            for m in range(1, 10):
                x = torch.randn(m, k, generator=g)
                out = torch.empty(m, n)
                kernels.dense_linear(out, x, w, b if m % 2 else None)
                want = x.double() @ w.double().T + (b.double() if m % 2 else 0)
                torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4 * k**0.5)
    finally:
        kernels.set_force_scalar(False)


def test_dense_kernel_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError, match="float or bf16"):
        kernels.dense_linear(torch.empty(1, 4), torch.randn(1, 8), torch.randn(4, 8).half(), None)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.dense_linear(torch.empty(1, 4), torch.randn(1, 7), torch.randn(4, 8), None)


def test_dense_parts_share_the_weights() -> None:
    """The decoder holds the model's own tensors: float32 and bf16 weights are not copied."""
    for dtype, kind in ((torch.float32, DENSE), (torch.bfloat16, BF16)):
        w = torch.randn(16, 8).to(dtype)
        data, t, _, packed = linear_parts(None, w, None)[0]
        assert (data.data_ptr(), data.dtype, t, packed) == (w.data_ptr(), dtype, kind, False)


# --------------------------------------------------------------------------- the model's step


_CASES = {
    "llama": dict(arch="llama", tie=False),
    "qwen2-tied": dict(arch="qwen2", tie=True),  # q/k/v biases, a tied LM head
}


@pytest.fixture(scope="module", params=list(_CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), seed=3, **_CASES[request.param])
    return Tiny(hf=None, loaded=load_model(path, torch.float32))


def _runner(tiny: Tiny, dtype: str, fused: bool, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        m.setenv("TOKENLOOM_FUSED_FLOAT", "1")
        m.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "8" if fused else "0")
        runner = tiny.runner(dtype=dtype, path="kernels")
    model = runner.model
    assert (model.fused_step is not None) == fused
    calls = count_fused_runs(model) if fused else {"n": 0}
    return runner, calls


def _decode(runner, reqs: dict[str, tuple[list[int], list[int]]], steps: int) -> list[torch.Tensor]:
    """Prefill every request (one step), then `steps` decode steps of all of them with their own
    greedy tokens; the logits [R, V] of each step, rows in request order."""
    logits = []
    out = runner.execute_model(step({r: len(p) for r, (p, _) in reqs.items()},
                                    new=[new_req(r, p, blocks) for r, (p, blocks) in reqs.items()]),
                               return_logits=True)
    logits.append(torch.stack([runner.last_logits[runner.last_logits_index[r]] for r in reqs]))
    lengths = {r: len(p) for r, (p, _) in reqs.items()}
    for _ in range(steps):
        out = runner.execute_model(step({r: 1 for r in reqs}, cached=[(r, [], lengths[r]) for r in reqs]),
                                   return_logits=True)
        assert all(len(out.sampled_token_ids[out.req_id_to_index[r]]) == 1 for r in reqs)
        for r in reqs:
            lengths[r] += 1
        logits.append(torch.stack([runner.last_logits[runner.last_logits_index[r]] for r in reqs]))
    return logits


def _requests(n: int, length: int = 9, steps: int = 4) -> dict[str, tuple[list[int], list[int]]]:
    per = (length + steps) // BLOCK + 1
    # Blocks handed out in reverse so each block table really is followed.
    return {f"r{i}": (prompt(100 + i, length + i % 3), list(range(per * (n - i) - 1, per * (n - i - 1) - 1, -1)))
            for i in range(n)}


# bf16: the fused step keeps activations in float32 between ops where the per-op path rounds them
# to bf16, so the two differ by bf16 rounding (both are bf16 weights); float32 only by summation order.
TOL = {"float32": 2e-4, "bfloat16": 0.06}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fused_step_matches_per_op(tiny: Tiny, dtype: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _requests(rows)
    fused, calls = _runner(tiny, dtype, True, monkeypatch)
    per_op, _ = _runner(tiny, dtype, False, monkeypatch)
    got, want = _decode(fused, reqs, 4), _decode(per_op, reqs, 4)
    assert calls["n"] == 4  # every decode step, not the prefill
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)  # the prefill ran per op in both
    for g, w in zip(got[1:], want[1:]):
        scale = w.abs().max().item()
        assert (g - w).abs().max().item() < TOL[dtype] * scale, (g - w).abs().max().item() / scale


def test_more_rows_than_the_step_takes_run_per_op(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """9 decode rows (one more than max_rows) and a mixed prefill + decode step take the per-op path,
    with the same logits as a runner without the fused step."""
    reqs = _requests(9)
    fused, calls = _runner(tiny, "float32", True, monkeypatch)
    per_op, _ = _runner(tiny, "float32", False, monkeypatch)
    for got, want in zip(_decode(fused, reqs, 2), _decode(per_op, reqs, 2)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert calls["n"] == 0
    # Mixed: one decode beside a new prompt's prefill.
    pa, pb = prompt(7, 6), prompt(8, 5)
    outs = []
    for runner in (fused, per_op):
        runner.execute_model(step({"A": 6}, new=[new_req("A", pa, [90, 91])]))
        runner.execute_model(step({"A": 1, "B": 5}, new=[new_req("B", pb, [92, 93])], cached=[("A", [], 6)]),
                             return_logits=True)
        outs.append(runner.last_logits.clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
    assert calls["n"] == 0


def test_packed_kv_layout_falls_back(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused step reads only the plain KV layout: with the kernels' packed bf16 layout on (the
    runner's choice on AVX512-BF16 CPUs; forced here), a decode step goes to the per-op path, whose
    first call (the embedding, stubbed to stop there) shows it."""
    fused, calls = _runner(tiny, "bfloat16", True, monkeypatch)
    reqs = _requests(2)
    fused.execute_model(step({r: len(p) for r, (p, _) in reqs.items()},
                             new=[new_req(r, p, blocks) for r, (p, blocks) in reqs.items()]))
    fused.model.attn_backend.kv_packed = True

    class PerOp(Exception):
        pass

    def embed(ids: torch.Tensor) -> torch.Tensor:
        raise PerOp

    monkeypatch.setattr(fused.model, "embed", embed)
    with pytest.raises(PerOp):
        fused.execute_model(step({r: 1 for r in reqs}, cached=[(r, [], len(p)) for r, (p, _) in reqs.items()]))
    assert calls["n"] == 0


def test_old_switch_name_still_works(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_FUSED_FLOAT", "1")
    monkeypatch.setenv("TOKENLOOM_GGUF_FUSED_ROWS", "0")
    assert tiny.runner(dtype="float32", path="kernels").model.fused_step is None
    monkeypatch.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "nine")
    with pytest.raises(ValueError, match="TOKENLOOM_FUSED_DECODE_ROWS"):
        tiny.runner(dtype="float32", path="kernels")


def test_bf16_lm_head_kernel(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain bf16 LM head (oneDNN cannot pack it, or packing is off) runs the dense kernel: the
    logits match F.linear's to bf16 rounding, in float32 also for the greedy path (`fp32=False`: the kernel's
    fp32 sums, not rounded to bf16)."""
    monkeypatch.setenv("TOKENLOOM_PACKED_LINEAR", "0")
    model = tiny.runner(dtype="bfloat16", path="kernels").model
    assert model.head_kernels is not None
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    want = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    got = model.compute_logits(hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.compute_logits(hidden, fp32=False), got)
    assert tiny.runner(dtype="float32", path="kernels").model.head_kernels is None


# --------------------------------------------------------------------------- the default model

CHATS = [[{"role": "user", "content": c}] for c in (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three uses of a paperclip.")]


_GREEDY_CHATS: dict[tuple[str, bool], list[list[int]]] = {}  # the bf16 test reuses the float32 test's runs


def _greedy_chats(monkeypatch: pytest.MonkeyPatch, dtype: str, fused: bool) -> list[list[int]]:
    if (dtype, fused) not in _GREEDY_CHATS:
        _GREEDY_CHATS[dtype, fused] = _run_greedy_chats(monkeypatch, dtype, fused)
    return _GREEDY_CHATS[dtype, fused]


def _run_greedy_chats(monkeypatch: pytest.MonkeyPatch, dtype: str, fused: bool) -> list[list[int]]:
    from tokenloom import LLM, SamplingParams

    with monkeypatch.context() as m:
        m.setenv("TOKENLOOM_FUSED_FLOAT", "1" if fused else "0")
        m.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "8" if fused else "0")
        llm = LLM(dtype=dtype, quantization="none")  # the float model: the default keeps the GGUF blocks
    model = llm.llm_engine.runner.model
    assert (model.fused_step is not None) == fused
    if fused:  # every sequence decodes in the fused step (4 rows a step)
        calls = count_fused_runs(model)
    outs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    if fused:
        assert calls["n"] >= 20
    return [list(o.outputs[0].token_ids) for o in outs]


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_default_model_greedy_fp32_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the fused step (plain weights, our kernel) and the per-op path (oneDNN packed) differ
    only in summation order; 4 chat prompts x 32 greedy tokens come out identical."""
    fused = _greedy_chats(monkeypatch, "float32", True)
    assert fused == _greedy_chats(monkeypatch, "float32", False)


def test_default_model_greedy_bf16_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: the fused step keeps activations float32 where the per-op path rounds them to bf16
    between ops, so greedy text parts after a while (measured on an AVX2 CPU, 4 chat prompts x 32
    tokens: first divergence at tokens 8, 28, 11, never). The fused step must stay at least as close
    to the float32 model's text as the per-op path. Where both bf16 runs prefill alike (oneDNN cannot
    pack bf16, so both run F.linear on plain weights) they must also agree for the first 4 tokens of
    every prompt; where it can (AVX512-BF16), the per-op run's packed bf16 GEMMs round differently
    from the first token on (measured there: per-op vs float32 parts at token 0 on one prompt, the
    fused step at 8)."""
    from tokenloom.model.linear import packing_enabled

    fused = _greedy_chats(monkeypatch, "bfloat16", True)
    per_op = _greedy_chats(monkeypatch, "bfloat16", False)
    fp32 = _greedy_chats(monkeypatch, "float32", False)
    firsts = [_first_divergence(a, b) for a, b in zip(fused, per_op)]
    vs_fp32 = {name: [_first_divergence(a, b) for a, b in zip(run, fp32)] for name, run in
               (("fused", fused), ("per-op", per_op))}
    print("bf16 fused vs per-op: first divergence per prompt", firsts, "; vs float32:", vs_fp32)
    if not packing_enabled(torch.device("cpu"), torch.bfloat16):
        assert min(firsts) >= 4, firsts
    assert sum(vs_fp32["fused"]) >= sum(vs_fp32["per-op"]), vs_fp32


@pytest.fixture(scope="module")
def tiny_d64(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 query heads on 2 kv heads, 64 wide: the grouped attention kernel's shape (head_dim 64 or 128)."""
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("d64"), arch="llama", seed=5, head_dim=64))


@pytest.mark.parametrize("kvd", ["auto", "float16", "bfloat16", "int8"])
def test_grouped_decode_attention_is_per_head_attention_to_the_bit(tiny_d64: str, kvd: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused decode step hands a work item all query heads of a kv head (each key tile read, and
    converted from an int8 or 16-bit cache, once for them) when that splits evenly over the threads, else
    one head: on one thread a step of the tiny model runs grouped, on three per head. The logits of every
    decode step are the same to the bit either way."""
    from pathlib import Path

    from tokenloom.model.runner import ModelRunner

    loaded = load_model(Path(tiny_d64), torch.float32)
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads, loaded.config.head_dim) == (4, 2, 64)
    reqs = _requests(1, length=40, steps=6)
    logits = {}
    threads = torch.get_num_threads()
    monkeypatch.setenv("TOKENLOOM_FUSED_FLOAT", "1")
    for n in (1, 3):
        runner = ModelRunner(loaded, block_size=BLOCK, num_blocks=64, dtype="float32", device="cpu",
                             cpu_kernels=True, kv_cache_dtype=kvd)
        calls = count_fused_runs(runner.model)
        torch.set_num_threads(n)
        try:
            logits[n] = _decode(runner, reqs, 6)
        finally:
            torch.set_num_threads(threads)
        assert calls["n"] == 6
    for a, b in zip(logits[1][1:], logits[3][1:]):
        assert torch.equal(a, b)
