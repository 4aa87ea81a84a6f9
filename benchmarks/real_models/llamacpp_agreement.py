"""Greedy tokens of tokenloom's quantized GGUF path against llama.cpp's on the same file and prompts.

`--quantization gguf` multiplies the file's blocks by activations quantized to int8 per 32, as
ggml's CPU backend does, so its greedy continuation should follow llama.cpp's far longer than the
dequantized float path does (which differs from both by the activation rounding). The 8 chat
prompts of quant_quality.py are rendered with tokenloom's chat template into token ids; each
engine continues the same ids greedily for `--max-tokens` (llama-server's /completion with
`return_tokens`, one slot, `-t --threads`, an f32 KV cache like ours). Reported per prompt: the
common prefix length with llama.cpp of the gguf path and of the dequantized path.

    .venv/bin/python benchmarks/real_models/llamacpp_agreement.py [MODEL.gguf] \\
        --llama-server ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-server [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.* and tokenloom
from benchmarks.quant.quant_quality import CHATS, common_prefix  # noqa: E402
from benchmarks.real_models.multi_stream import free_port, wait_ready  # noqa: E402


def llamacpp_tokens(binary: str, model: str, prompts: list[list[int]], max_tokens: int,
                    threads: int) -> list[list[int]]:
    port = free_port()
    proc = subprocess.Popen([binary, "-m", model, "-t", str(threads), "-np", "1", "-c", "2048", "--port", str(port),
                             "-ctk", "f32", "-ctv", "f32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        outs = []
        for ids in prompts:
            body = json.dumps({"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                               "return_tokens": True, "cache_prompt": False,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                outs.append(json.loads(r.read())["tokens"])
        return outs
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def tokenloom_tokens(model: str, quantization: str, prompts: list[list[int]],
                     max_tokens: int) -> list[list[int]]:
    from tokenloom.engine.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", quantization=quantization)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.model.loader import resolve_model_path
    from tokenloom.model.tokenizer import load_tokenizer

    model = str(resolve_model_path(a.model))
    tok = load_tokenizer(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHATS]
    theirs = llamacpp_tokens(a.llama_server, model, prompts, a.max_tokens, a.threads)
    rows = {}
    for name, quant in (("gguf", "gguf"), ("dequantized", "none")):
        ours = tokenloom_tokens(model, quant, prompts, a.max_tokens)
        rows[name] = [common_prefix(o, t) for o, t in zip(ours, theirs)]
    for i, c in enumerate(CHATS):
        print(f"{c[:44]:44s}  gguf {rows['gguf'][i]:3d}  dequantized {rows['dequantized'][i]:3d}  of {a.max_tokens}")
    summary = {"model": Path(model).name, "max_tokens": a.max_tokens,
               **{f"{k}_common_prefix": v for k, v in rows.items()},
               **{f"{k}_identical": sum(n == a.max_tokens for n in v) for k, v in rows.items()}}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
