"""Which engine's greedy tokens a float64 reference of the same dequantized weights follows.

Reads the tokens `llamacpp_agreement.py --tokens-out` wrote (each engine's greedy continuation of the
same prompt ids), and runs transformers' own model over the GGUF (dequantized by gguf-py at load,
the architecture's HF implementation, then cast to float64) once per engine and prompt on prompt +
continuation. Teacher forcing gives, at every generated position, the float64 argmax after that
engine's prefix: the first position where it differs from the engine's token is where float64
greedy decoding would have left that engine, and the float64 logprob gap between its own choice and
the engine's token there says how near a tie it was.

    .venv/bin/python benchmarks/real_models/float64_reference.py TOKENS.json [--engines gguf,llamacpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tokenloom


def follows(model: torch.nn.Module, prompt: list[int], tokens: list[int],
            banned: list[int]) -> tuple[int, float | None]:
    """(positions float64 greedy shares with `tokens`, the float64 gap at the first one it does not).
    `banned` (the EOG tokens the engines' ignore_eos kept out) never wins the argmax here either."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].double()
    lp = logits.log_softmax(-1)
    best = lp.index_fill(-1, torch.tensor(banned, dtype=torch.long), float("-inf")).argmax(-1)
    for i, t in enumerate(tokens):
        if int(best[i]) != t:
            return i, round(float(lp[i, best[i]] - lp[i, t]), 4)
    return len(tokens), None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", help="the JSON of llamacpp_agreement.py --tokens-out")
    ap.add_argument("--engines", default=None, help="comma-separated (default: every engine in the file)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    run = json.loads(Path(a.tokens).read_text())
    path = Path(run["model"])
    engines = a.engines.split(",") if a.engines else [k for k in run if k not in ("model", "prompts", "banned_eog")]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to(torch.float64).eval()
    summary: dict[str, object] = {"model": path.name}
    for engine in engines:
        rows = [follows(model, p, t, run["banned_eog"]) for p, t in zip(run["prompts"], run[engine])]
        summary[f"{engine}_float64_prefix"] = [n for n, _ in rows]
        summary[f"{engine}_float64_gap"] = [g for _, g in rows]
        summary[f"{engine}_float64_identical"] = sum(n == len(t) for (n, _), t in zip(rows, run[engine]))
        print(f"{engine:16s} float64 greedy follows it for {[n for n, _ in rows]} tokens; "
              f"float64 gaps there {[g for _, g in rows]}", flush=True)
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
