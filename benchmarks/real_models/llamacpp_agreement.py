"""Greedy tokens of tokenloom's GGUF paths against llama.cpp's on the same file and prompts, with the
controls that say why they part.

The 8 chat prompts of quant_quality.py are rendered with tokenloom's chat template into token ids;
each engine continues the same ids greedily for `--max-tokens` (llama-server's /completion with
`return_tokens`, one slot, `-t --threads`, an f32 KV cache; tokenloom in float32). `--defaults` runs both
as a user gets them instead: tokenloom's `--dtype auto` (bf16 on a CPU with AVX512-BF16 or AMX: bf16
activations between layers, a bf16 KV cache), llama.cpp's f16 KV cache (the `--f32-copy` control stays
float32 with an f32 KV cache on both: it is the float-arithmetic reference). Both run past the end of the
answer the same way: llama-server's `ignore_eos` bans every end-of-generation token (its logit bias
-inf for the vocabulary's EOG set, which its response lists), while tokenloom's (vLLM's) only keeps
going after sampling one, so tokenloom gets a -100 logit bias on that same set. Reported per prompt:
the common prefix length with llama.cpp of tokenloom's quantized (`gguf`) and dequantized (`none`)
paths, and at the first differing token the top-1 margin (logprob of the engine's own token minus
that of the other engine's token) of each side: a margin far below the two engines' logprob spread
is a near-tie.

Controls, each optional:
* `--self-check`: llama.cpp against itself, its default (`-fa auto`: flash attention on CPU) and
  `-fa off` (the plain softmax attention), the same weights and int8 activation rounding: how far
  llama.cpp follows its own greedy tokens when only the float summation order changes.
* `--f32-copy FILE`: the same weights dequantized to F32 by llama.cpp itself, so that llama.cpp
  multiplies float activations (no int8 rounding; its rope, norms and attention unchanged), against
  tokenloom's dequantized path on that copy. Made with `$LB/llama-quantize --allow-requantize --pure
  --output-tensor-type f32 --token-embedding-type f32 IN.gguf OUT.gguf F32`.

Both of llama.cpp's and tokenloom's quantized paths round every linear's input to int8 (ggml: per 32
with an fp16 scale for Q4_0/Q5_0/Q8_0 weights, per 256 for the K-quants; tokenloom: per 32, float
scale — ggml's rule was tried and measured no closer, docs/performance.md "ggml's activation
rounding"), and a float difference of one ulp moves some of those roundings, so two implementations
of the quantized arithmetic drift apart by about the rounding noise itself (docs/performance.md,
"Greedy agreement with llama.cpp"). `logprob_gap` per prompt (the mean |difference| of the two
engines' logprobs of the shared token over the common prefix) measures how far apart they are.

    .venv/bin/python benchmarks/real_models/llamacpp_agreement.py [MODEL.gguf] \\
        --llama-server ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-server [--self-check] \\
        [--f32-copy F32.gguf] [--llama-arg=-nr] [--json out.json]

`--llama-arg=-nr` (llama.cpp's `--no-repack`) where ggml's AMX kernels are built but the kernel does
not grant the AMX tile state (the server then dies with SIGILL at the first matrix product).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.* and tokenloom
from benchmarks.quant.quant_quality import CHATS, common_prefix  # noqa: E402
from benchmarks.real_models.multi_stream import free_port, wait_ready  # noqa: E402

TOP_N = 5  # logprobs kept per generated token, for the margins at a divergence


@dataclass
class Greedy:
    """One engine's greedy continuation of one prompt: its tokens and, per token, the top-N logprobs."""

    tokens: list[int]
    top: list[dict[int, float]]


def llamacpp_greedy(binary: str, model: str, prompts: list[list[int]], max_tokens: int, threads: int,
                    extra: list[str], kv_f32: bool = True) -> tuple[list[Greedy], list[int]]:
    """llama.cpp's greedy continuations, and its end-of-generation tokens (those `ignore_eos` banned).
    `kv_f32`: an f32 KV cache (else llama.cpp's default, f16)."""
    port = free_port()
    kv = ["-ctk", "f32", "-ctv", "f32"] if kv_f32 else []
    proc = subprocess.Popen([binary, "-m", model, "-t", str(threads), "-np", "1", "-c", "2048", "--port", str(port),
                             *kv, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        outs = []
        for ids in prompts:
            # n_probs without post_sampling_probs: the softmax of the raw logits, before top_k = 1.
            body = json.dumps({"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                               "n_probs": TOP_N, "return_tokens": True, "cache_prompt": False,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            top = [{p["id"]: p["logprob"] for p in step["top_logprobs"]} for step in out["completion_probabilities"]]
            outs.append(Greedy(out["tokens"], top))
        # ignore_eos adds a logit bias of -inf (JSON null) per EOG token to the request's settings.
        eog = [b["token"] for b in out["generation_settings"]["logit_bias"] if b["bias"] is None]
        return outs, eog
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def tokenloom_greedy(model: str, quantization: str, prompts: list[list[int]], max_tokens: int,
                     banned: list[int], dtype: str = "float32", kv_cache_dtype: str = "auto") -> list[Greedy]:
    from tokenloom.engine.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_N,
                            logit_bias={t: -100.0 for t in banned})
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        if set(c.token_ids) & set(banned):  # -100 is vLLM's floor for a bias; it must have been enough
            raise RuntimeError(f"tokenloom sampled a banned end-of-generation token: {c.token_ids}")
        res.append(Greedy(list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]))
    del llm
    return res


def margin(side: Greedy, i: int, other_token: int) -> float | None:
    """Logprob of `side`'s own token at step i minus that of `other_token` there; None when the other
    token is outside side's top-N (then the margin exceeds that of its N-th token)."""
    if other_token not in side.top[i]:
        return None
    return round(side.top[i][side.tokens[i]] - side.top[i][other_token], 4)


def logprob_gap(ours: Greedy, theirs: Greedy, n: int) -> float | None:
    """Mean |difference| of the two engines' logprobs of the shared greedy token over the first n
    (common) steps: how close the two computations are, a continuous measure where the identical
    count only moves at near-ties. None when n is 0."""
    if n == 0:
        return None
    return round(sum(abs(ours.top[i][ours.tokens[i]] - theirs.top[i][ours.tokens[i]]) for i in range(n)) / n, 5)


def compare(ours: list[Greedy], theirs: list[Greedy]) -> dict[str, list]:
    prefix, ours_margin, theirs_margin, gap = [], [], [], []
    for a, b in zip(ours, theirs):
        n = common_prefix(a.tokens, b.tokens)
        prefix.append(n)
        diverged = n < min(len(a.tokens), len(b.tokens))
        ours_margin.append(margin(a, n, b.tokens[n]) if diverged else None)
        theirs_margin.append(margin(b, n, a.tokens[n]) if diverged else None)
        gap.append(logprob_gap(a, b, n))
    return {"common_prefix": prefix, "margin_first": ours_margin, "margin_llamacpp": theirs_margin,
            "logprob_gap": gap}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-arg", action="append", default=[], help="an extra llama-server argument (repeatable)")
    ap.add_argument("--self-check", action="store_true", help="also llama.cpp -fa off against its default")
    ap.add_argument("--f32-copy", default=None, help="the same weights as an F32 GGUF (see the docstring)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens-out", default=None, help="every engine's tokens, for float64_reference.py")
    ap.add_argument("--defaults", action="store_true",
                    help="both engines as a user runs them: tokenloom's --dtype auto (bf16 where the CPU has "
                         "AVX512-BF16 or AMX), llama.cpp's f16 KV cache (else float32 and an f32 KV cache on both)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="tokenloom's --kv-cache-dtype (float16: llama.cpp's default cache's roundings)")
    a = ap.parse_args()
    dtype = "auto" if a.defaults else "float32"
    from tokenloom.model.loader import resolve_model_path
    from tokenloom.model.tokenizer import load_tokenizer

    model = str(resolve_model_path(a.model))
    tok = load_tokenizer(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHATS]

    def llamacpp(path: str, *extra: str, kv_f32: bool = not a.defaults) -> list[Greedy]:
        return llamacpp_greedy(a.llama_server, path, prompts, a.max_tokens, a.threads, [*a.llama_arg, *extra],
                               kv_f32=kv_f32)[0]

    theirs, eog = llamacpp_greedy(a.llama_server, model, prompts, a.max_tokens, a.threads, a.llama_arg,
                                  kv_f32=not a.defaults)
    runs = {"llamacpp": theirs}
    for name, quant in (("gguf", "gguf"), ("dequantized", "none")):
        runs[name] = tokenloom_greedy(model, quant, prompts, a.max_tokens, eog, dtype, a.kv_cache_dtype)
    rows = {name: compare(runs[name], runs["llamacpp"]) for name in ("gguf", "dequantized")}
    if a.self_check:
        runs["llamacpp_fa_off"] = llamacpp(model, "-fa", "off")
        rows["llamacpp_fa_off"] = compare(runs["llamacpp_fa_off"], runs["llamacpp"])
    if a.f32_copy:  # the float-arithmetic control: float32 and an f32 KV cache on both, --defaults or not
        runs["llamacpp_f32"] = llamacpp(a.f32_copy, kv_f32=True)
        runs["dequantized_f32"] = tokenloom_greedy(a.f32_copy, "none", prompts, a.max_tokens, eog, "float32")
        rows["f32_copy"] = compare(runs["dequantized_f32"], runs["llamacpp_f32"])
    if a.tokens_out:
        Path(a.tokens_out).write_text(json.dumps({"model": model, "prompts": prompts, "banned_eog": eog,
                                                  **{k: [g.tokens for g in v] for k, v in runs.items()}}))
    for i, c in enumerate(CHATS):
        cells = "  ".join(f"{k} {r['common_prefix'][i]:3d} ({r['margin_first'][i]} / {r['margin_llamacpp'][i]})"
                          for k, r in rows.items())
        print(f"{c[:40]:40s}  {cells}")
    summary = {"model": Path(model).name, "max_tokens": a.max_tokens, "llama_args": a.llama_arg, "banned_eog": eog,
               "defaults": a.defaults, "tokenloom_dtype": dtype, "tokenloom_kv_cache_dtype": a.kv_cache_dtype,
               **{f"{k}_identical": sum(n == a.max_tokens for n in r["common_prefix"]) for k, r in rows.items()},
               **{f"{k}_{field}": v for k, r in rows.items() for field, v in r.items()}}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
