"""`tokenloom replay TRACE.json -o STEPS.json`: the scheduler alone over a trace (no torch)."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="run the scheduler alone over a trace and print its decisions per step")
    p.add_argument("trace", help="TRACE.json: {config, requests}")
    p.add_argument("-o", "--output", help="write STEPS.json here (default: stdout)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tokenloom.core.replay import replay_file

    result = replay_file(args.trace, args.output)
    if args.output is None:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        s = result["summary"]
        print(
            f"{s['num_steps']} steps, {s['total_scheduled_tokens']} tokens, "
            f"{s['num_preemptions']} preemptions, {len(s['rejected'])} rejected -> {args.output}"
        )
    return 0
