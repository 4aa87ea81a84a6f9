"""Write the input-grounded workload (tokenloom/workload/grounded.py: "repeat / rewrite / copy this
function" chats over CPython stdlib functions) as a serving workload JSONL: the chat template applied
by the default model's tokenizer, prompt token ids, Poisson arrivals, greedy to EOS or max_tokens.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spec_decode/grounded_workload.py --num 12 --rate 0.25 \
        --out grounded_w2.jsonl
    # then, e.g., serving latency with and without n-gram drafts:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/serving/serve_ab.py --a= \\
        --b="-sc '{\"method\":\"ngram\",\"num_speculative_tokens\":4,\"prompt_lookup_max\":4}'" \\
        --labels off,ngram --rounds 2 -- --dataset-name jsonl --dataset-path grounded_w2.jsonl
"""

from __future__ import annotations

import argparse

from tokenloom.model.tokenizer import load_tokenizer
from tokenloom.workload.datasets import BenchRequest, arrival_times, write_jsonl
from tokenloom.workload.grounded import grounded_messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=12, help="requests")
    ap.add_argument("--rate", type=float, default=0.25, help="requests per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="always max_tokens outputs (for engines that force it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = load_tokenizer(None)
    arrivals = arrival_times(args.num, args.rate, seed=args.seed)
    reqs = []
    for i, (conv, t) in enumerate(zip(grounded_messages(args.num), arrivals)):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        reqs.append(BenchRequest(id=f"grounded-{i}", prompt=ids, prompt_len=len(ids),
                                 max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, arrival_s=t))
    write_jsonl(reqs, args.out)
    print(f"{args.out}: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
          f"last arrival {reqs[-1].arrival_s:.1f} s")


if __name__ == "__main__":
    main()
