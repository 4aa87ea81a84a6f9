"""Structured outputs per request, tokenloom or vLLM's CPU build on the same batch (issue 18's comparison).

32 chat prompts (SmolLM2's template) asking for a person as JSON, greedy, up to 48 tokens, float32, in one
generate call: free, then constrained by a JSON schema (and the reverse order in the second round). Run
each engine in its own venv:

    .venv/bin/python benchmarks/structured/structured_vs_vllm.py --engine tokenloom
    (cd /tmp && $ANCHORS/vllm-venv/bin/python /path/to/benchmarks/structured/structured_vs_vllm.py --engine vllm \
        --model $ANCHORS/smollm2-hf-fp32)

($ANCHORS: the anchors' directory, $TOKENLOOM_ANCHORS_DIR, by default ~/.cache/tokenloom-anchors; the vLLM side
runs under vLLM's python, so it is told the model by --model.)
"""

from __future__ import annotations

import argparse
import json
import os
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
PROMPTS = [f"<|im_start|>user\nDescribe person number {i} as JSON with name, age and city.<|im_end|>\n"
           "<|im_start|>assistant\n" for i in range(32)]


def make_engine(engine: str, model: str | None):
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        if model is None:
            raise SystemExit("--engine vllm needs --model: an HF dir of SmolLM2-135M-Instruct (the anchors' "
                             "smollm2-hf-fp32)")
        llm = LLM(model=model, dtype="float32", max_model_len=2048)
        run = llm.generate
    else:
        from tokenloom import LLM, SamplingParams
        from tokenloom.sampling_params import StructuredOutputsParams

        kwargs = {"model": model} if model else {}  # else tokenloom's default model
        llm = LLM(**kwargs, max_model_len=2048, dtype="float32")

        def run(prompts, params):
            return llm.generate(prompts, params, use_tqdm=False)
    free = SamplingParams(temperature=0, max_tokens=48)
    constrained = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return run, free, constrained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["tokenloom", "vllm"], required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="HF model dir (tokenloom: default model if omitted; vLLM: required)")
    args = ap.parse_args()
    run, free, constrained = make_engine(args.engine, args.model)
    run(PROMPTS[:2], constrained)  # warm-up (grammar backend, first compile)
    run(PROMPTS[:2], free)
    result: dict[str, list[dict]] = {"free": [], "constrained": []}
    for r in range(args.rounds):
        order = [("free", free), ("constrained", constrained)]
        for name, params in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            outs = run(PROMPTS, params)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            result[name].append({"s": round(seconds, 3), "tokens": tokens})
    print(json.dumps({"engine": args.engine, **result}))


if __name__ == "__main__":
    main()
