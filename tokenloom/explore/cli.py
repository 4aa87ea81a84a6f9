"""`tokenloom explore`: registered by this package, collected by tokenloom/cli.py."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("explore", help="a local web page: move scheduler knobs, watch the real scheduler step by step")
    e.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0: any free port)")
    e.set_defaults(func=_explore)


def _explore(args: argparse.Namespace) -> int:
    from tokenloom.explore.server import serve

    serve(args.port)
    return 0
