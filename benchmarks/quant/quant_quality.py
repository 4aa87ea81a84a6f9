"""What int8 (W8A8) and gguf cost in quality: perplexity and greedy agreement against the run dtype.

    .venv/bin/python benchmarks/quant/quant_quality.py [--tokens 1024] [--text FILE ...] [--out result.json]
        [--methods none,int8-nosmooth,int8,gguf] [--model FILE.gguf] [--greedy-method int8]

`gguf` (`--quantization gguf`) keeps the GGUF's quantized weights and quantizes activations to int8
per 32 on the fly; "none" is the same file dequantized to --dtype, so the difference is what the
quantized kernels cost (the weights' own quantization is in both).

Perplexity: each text is fed through tokenloom's own runner one token per step, each step a new
request that reuses the blocks its predecessor wrote (a prefix-cache hit in the scheduler's terms),
so every position's next-token logits come from the engine's real forward path. Default texts (none
of them the calibration text): the GPL-3 and Artistic licences as Debian ships them, and the Python
standard library's textwrap.py (code). One 1,024-token text moves by 1-2 % under any tiny
perturbation of an int8 model, hence several. Greedy agreement: 8 chat prompts x 64 tokens through
LLM.chat, compared with the unquantized run token by token.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import time
from pathlib import Path

import torch

from tokenloom.bench.quality import perplexity
from tokenloom.engine.llm import LLM
from tokenloom.model.loader import load_model, resolve_model_path
from tokenloom.model.quant import calibration_token_ids
from tokenloom.model.runner import ModelRunner
from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.sampling_params import SamplingParams

CHATS = [
    "Which city is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for writing clean Python code.",
    "Why is the sky blue?",
]
DEFAULT_TEXTS = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/Artistic"),
                 Path(textwrap.__file__)]
BLOCK = 16


def greedy_chats(quantization: str | None, dtype: str, model: str | None = None) -> list[list[int]]:
    llm = LLM(model, dtype=dtype, quantization=quantization)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS],
                    SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--text", type=Path, nargs="+", default=DEFAULT_TEXTS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-chats", action="store_true")
    ap.add_argument("--methods", default="none,int8-nosmooth,int8")
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--greedy-method", default="int8", help="the method the greedy chats compare with none")
    args = ap.parse_args()

    tok = load_tokenizer(args.model)
    texts = {p.name: tok.encode(p.read_text())[: args.tokens] for p in args.text}
    path = resolve_model_path(args.model)
    loaded = load_model(path, torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    calibration = calibration_token_ids(tok, loaded.config.max_position_embeddings)
    all_configs = {"none": (None, None), "int8 (no smoothing)": ("int8", None), "int8": ("int8", calibration),
                   "gguf": ("gguf", None)}
    names = {"int8-nosmooth": "int8 (no smoothing)"}
    configs = {names.get(m, m): all_configs[names.get(m, m)] for m in args.methods.split(",")}
    result: dict = {"texts": [str(p) for p in args.text], "tokens": {n: len(t) for n, t in texts.items()},
                    "dtype": args.dtype, "perplexity": {}, "change_pct": {}}
    longest = max(len(t) for t in texts.values())
    for name, (quant, calib) in configs.items():
        t0 = time.perf_counter()
        model = load_model(path, quantized=True) if quant == "gguf" else loaded
        runner = ModelRunner(model, block_size=BLOCK, num_blocks=-(-longest // BLOCK) + 1, dtype=args.dtype,
                             device="cpu", quantization=quant, calibration_token_ids=calib)
        result["perplexity"][name] = {n: perplexity(runner, t) for n, t in texts.items()}
        shown = "  ".join(f"{n} {p:7.3f}" for n, p in result["perplexity"][name].items())
        print(f"perplexity {name:20s} {shown}   ({time.perf_counter() - t0:.1f} s)", flush=True)
    base = result["perplexity"]["none"]
    for name, ppls in result["perplexity"].items():
        change = {n: 100 * (p / base[n] - 1) for n, p in ppls.items()}
        change["mean"] = sum(change.values()) / len(change)
        result["change_pct"][name] = change
        print(f"  {name:20s} " + "  ".join(f"{n} {c:+6.2f} %" for n, c in change.items()))

    if not args.skip_chats:
        ref = greedy_chats("none", args.dtype, args.model)  # the dequantized model
        got = greedy_chats(args.greedy_method, args.dtype, args.model)
        prefixes = [common_prefix(a, b) for a, b in zip(ref, got)]
        same = sum(a == b for a, b in zip(ref, got))
        result["greedy"] = {"identical": same, "prompts": len(CHATS), "common_prefix": prefixes,
                            "lengths": [len(a) for a in ref]}
        print(f"greedy chats: {same}/{len(CHATS)} identical, common prefix {prefixes} of {[len(a) for a in ref]}")
        for chat, a, b in zip(CHATS, ref, got):
            if a != b:
                print(f"  {chat}\n    {args.dtype}: {tok.decode(a)!r}\n    {args.greedy_method}: {tok.decode(b)!r}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
