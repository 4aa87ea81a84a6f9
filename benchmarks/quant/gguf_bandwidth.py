"""Where the batch-1 GGUF decode step stands against the memory bus: bytes streamed per second.

Loads a GGUF with `--quantization gguf`'s weights (the 8-row layouts), then times, on the engine's
threads, alternating within each round:
- `step`: FusedDecoder.step at batch 1 (positions 16..143, bf16 KV cache), layer weights / time;
- `gemv`: the same layers' linears alone, one gguf_linear_packed call each (no norms, attention,
  barriers), their bytes / time; `gemv Q4_K` etc.: those of one GGML type alone;
- `sum`: torch's sum over those bytes (int64 view): what a plain read of them gets;
- `head`: the LM head (`output.weight`, else the tied embedding; its 8-row copy) right after the
  layers' bytes were read, so it comes from DRAM as it does in a real step.

    .venv/bin/python benchmarks/quant/gguf_bandwidth.py FILE.gguf [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGMLQuantizationType as Q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from tokenloom.model.execution_plan import with_engine_prefetch
    from tokenloom.model.fused_decode import decoder_from_weights
    from tokenloom.model.gguf_kernels import gguf_kernels
    from tokenloom.model.gguf_weights import GGUFLinear, GGUFWeight, load_gguf_quantized
    from tokenloom.model.rotary import rope_inv_freq

    torch.set_num_threads(a.threads)
    k = gguf_kernels()
    if k is None:
        raise SystemExit("GGUF kernels unavailable")
    with_engine_prefetch(k)
    config, weights = load_gguf_quantized(a.model)
    dec = decoder_from_weights(k, config, weights)
    n_layers, hkv, d, bs = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16
    kv = torch.zeros(n_layers, 2, hkv, 16, bs, d, dtype=torch.bfloat16)
    dec.set_kv_caches([kv[i, 0] for i in range(n_layers)], [kv[i, 1] for i in range(n_layers)])
    freqs = torch.outer(torch.arange(256).float(), rope_inv_freq(config))
    cos, sin = freqs.cos().to(torch.bfloat16).contiguous(), freqs.sin().to(torch.bfloat16).contiguous()
    table = torch.arange(16, dtype=torch.int32)[None]
    out = torch.empty(1, config.hidden_size)

    lins = []
    for i in range(n_layers):
        p, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for names in ([p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"], [p + "o_proj.weight"],
                      [m + "gate_proj.weight", m + "up_proj.weight"], [m + "down_proj.weight"]):
            ws = [weights[n] for n in names]
            if all(isinstance(w, GGUFWeight) for w in ws):
                lins.append(GGUFLinear.from_weights(ws, [None] * len(ws), k))
    layer_bytes = torch.cat([p.data.flatten() for lin in lins for p in lin.parts])
    xs = {n: torch.randn(1, n) for n in {lin.in_features for lin in lins}}
    outs = [torch.empty(1, lin.out_features) for lin in lins]
    # The LM head: output.weight where the file has one (Qwen2.5 1.5B: Q6_K), else the tied embedding.
    emb = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    head = emb.repacked(k) if isinstance(emb, GGUFWeight) else None
    logits = torch.empty(1, config.vocab_size)

    def step() -> None:
        for pos in range(16, 144):
            dec.step(out, torch.tensor([5]), torch.tensor([pos]), torch.tensor([pos]), table, cos, sin)

    def gemv() -> None:
        for lin, o in zip(lins, outs):
            col = 0
            for p in lin.parts:
                n = p.shape[0]
                if p.packed8:
                    k.gguf_linear_packed(o[:, col : col + n], xs[lin.in_features], p.data, p.qtype, None)
                else:
                    k.gguf_linear(o[:, col : col + n], xs[lin.in_features], p.data, p.qtype, None)
                col += n

    # The same GEMVs split by GGML type (Q4_K_M files mix Q4_K and Q6_K): which kernel streams slower.
    by_type: dict[str, list[tuple]] = {}
    for lin, o in zip(lins, outs):
        col = 0
        for p in lin.parts:
            by_type.setdefault(Q(p.qtype).name, []).append((p, xs[lin.in_features], o[:, col : col + p.shape[0]]))
            col += p.shape[0]

    def gemv_of(parts: list[tuple]) -> None:
        for p, x, o in parts:
            if p.packed8:
                k.gguf_linear_packed(o, x, p.data, p.qtype, None)
            else:
                k.gguf_linear(o, x, p.data, p.qtype, None)

    def read() -> None:
        layer_bytes.view(torch.int64).sum()

    def timed(f, reps: int = 1) -> float:
        t0 = time.perf_counter()
        f()
        return (time.perf_counter() - t0) / reps

    nbytes = layer_bytes.numel()
    res: dict[str, list[float]] = {"step": [], "gemv": [], **{f"gemv {t}": [] for t in by_type}, "sum": [], "head": []}
    sizes = {f"gemv {t}": sum(p.data.numel() for p, _, _ in parts) for t, parts in by_type.items()}
    step()  # warm-up
    for _ in range(a.rounds):
        res["step"].append(timed(step, 128))
        res["gemv"].append(min(timed(gemv) for _ in range(20)))
        for t, parts in by_type.items():
            res[f"gemv {t}"].append(min(timed(lambda ps=parts: gemv_of(ps)) for _ in range(20)))
        res["sum"].append(min(timed(read) for _ in range(20)))
        if head is not None and head.packed8:
            hs = []
            for _ in range(10):
                read()  # the layers' bytes push the head out of the caches, as a real step does
                hs.append(timed(lambda: k.gguf_linear_packed(logits, out, head.data, head.qtype, None)))
            res["head"].append(min(hs))
    head_bytes = head.data.numel() if head is not None else 0
    print(f"{a.model}: layer weights {nbytes / 1e6:.1f} MB, LM head {head_bytes / 1e6:.1f} MB, {a.threads} threads")
    for name, vals in res.items():
        if not vals:
            continue
        t = statistics.median(vals)
        size = head_bytes if name == "head" else sizes.get(name, nbytes)
        what = "decoder step, batch 1 (median)" if name == "step" else "best of 20 / 10 (median of rounds)"
        print(f"  {name:10s} {t * 1e3:7.3f} ms  {size / t / 1e9:5.1f} GB/s   {what}")


if __name__ == "__main__":
    main()
