"""Multi-LoRA throughput: a W1-shaped load spread over 4 adapters + the base model, against base only
(docs/lora.md). Issue 34's goal: >= 0.8x the base-only throughput.

Rounds alternate the two modes (the order flips each round) in one process, each mode on its own
engine built once: `base` = an engine without LoRA serving every request on the base model; `lora` =
an engine with --enable-lora --max-loras 4 serving the same requests spread round-robin over four
adapters and the base (one request in five on the base). W1-style = --requests requests at t=0,
prompts 64-512 tokens (seeded), --tokens outputs each (ignore_eos); the figure is output tokens/s
over the wall time of LLM.generate.

The adapters are random rank-r PEFT adapters on every target (q/k/v/o/gate/up/down), written here
in PEFT's file layout from the model's own shapes (no peft or HF checkpoint needed, so the GGUF
default model works): the arithmetic is the same as a trained adapter's.

    PYTHONPATH=$PWD flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/lora/lora_throughput.py --rounds 3
    PYTHONPATH=$PWD flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/lora/lora_throughput.py \
        --dtype float32 --quantization none --rounds 3 --json docs/figures/lora_w1_fp32.json

The machine may be shared: compare the modes within a round. Each round also records the process's
CPU seconds per mode (`cpu_ratio` = base CPU s / LoRA CPU s: the throughput ratio were the machine
the engine's alone; with two threads it includes their spinning, so read it with OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloom.engine.llm import LLM
from tokenloom.lora.request import LoRARequest
from tokenloom.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, config, rank: int, seed: int, b_scale: float = 0.01) -> Path:
    """A random PEFT LoRA adapter for a model of `config` (tokenloom's ModelConfig); `b_scale`: the
    spread of B's entries (how far the adapter moves the model)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none"}))
    return out


def w1_prompts(n: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(64, 512))]} for _ in range(n)]


def run(llm: LLM, prompts: list[dict], params: SamplingParams, loras: list | None) -> tuple[float, float]:
    """Output tokens/s over the wall time, and the CPU seconds this process spent (all its threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="default: auto (a quantized GGUF stays gguf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    common = dict(dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False)
    base = LLM(args.model, **common)
    lora = LLM(args.model, **common, enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    config = lora.llm_engine.model_config
    tmp = Path(tempfile.mkdtemp(prefix="tokenloom-lora-bench-"))
    adapters = [LoRARequest(f"adapter{i}", i, str(write_adapter(tmp / f"a{i}", config, args.rank, seed=i)))
                for i in range(1, 5)]
    prompts = w1_prompts(args.requests, config.vocab_size, seed=20251129)
    loras = [adapters[i % 5] if i % 5 < 4 else None for i in range(args.requests)]  # 4 adapters + base
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    run(base, prompts[:2], params, None)  # warm-up: kernels, oneDNN primitives, the adapters' first load
    run(lora, prompts[:5], params, loras[:5])
    rounds = []
    for r in range(args.rounds):
        order = ["base", "lora"] if r % 2 == 0 else ["lora", "base"]
        got = {}
        for mode in order:
            got[mode], got[f"{mode}_cpu_s"] = (run(base, prompts, params, None) if mode == "base"
                                               else run(lora, prompts, params, loras))
        got["ratio"] = got["lora"] / got["base"]
        got["cpu_ratio"] = got["base_cpu_s"] / got["lora_cpu_s"]
        rounds.append(got)
        print(f"round {r}: base {got['base']:.1f} tok/s, 4 adapters + base {got['lora']:.1f} tok/s, "
              f"ratio {got['ratio']:.3f}; CPU s base {got['base_cpu_s']:.2f}, lora {got['lora_cpu_s']:.2f}, "
              f"ratio {got['cpu_ratio']:.3f}", flush=True)
    summary = {"base_tok_s": statistics.median(x["base"] for x in rounds),
               "lora_tok_s": statistics.median(x["lora"] for x in rounds),
               "ratio_median": statistics.median(x["ratio"] for x in rounds),
               "cpu_ratio_median": statistics.median(x["cpu_ratio"] for x in rounds)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
