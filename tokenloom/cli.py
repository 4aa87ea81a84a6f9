"""`tokenloom` command line: one sub-command per job, each registered by the room that owns it."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

# (module, function) pairs; each function takes the sub-parsers object and adds its commands.
# Imported lazily so `tokenloom replay` never pays for importing torch.
_COMMAND_GROUPS = [
    "tokenloom.core.replay_cli",
    "tokenloom.engine.cli",
    "tokenloom.server.cli",
    "tokenloom.bench.cli",
    "tokenloom.sim.cli",
    "tokenloom.explore.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom", description="LLM inference with iteration-level scheduling (vLLM V1 style)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_GROUPS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that room is not built yet
                continue
            raise
        module.register(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """argparse's parse_args, except that an unknown flag is reported with the usage of the (sub-)command
    it was given to (`tokenloom serve --prot 1` shows serve's usage, not the list of commands), and that
    vLLM's dotted form of a JSON flag is read (expand_dotted_args)."""
    args, extra = parser.parse_known_args(expand_dotted_args(sys.argv[1:] if argv is None else list(argv)))
    if extra:
        command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def expand_dotted_args(argv: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser rule for JSON flags: `--pooler-config.task token_embed` (or `=token_embed`,
    `--speculative-config.num_speculative_tokens 4`, nested keys by more dots) sets one field of that flag's
    JSON object; every such field of a flag is gathered into one `--flag '{...}'`, added after the other
    arguments. A value is read as JSON when it is JSON, else as text."""
    out: list[str] = []
    fields: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, has_value, inline = arg.partition("=")
        flag, dot, path = name.partition(".")
        if not (arg.startswith("--") and dot and path and flag.count(".") == 0):
            out.append(arg)
            i += 1
            continue
        if not has_value and i + 1 >= len(argv):
            raise SystemExit(f"tokenloom: error: argument {name}: expected a value")
        text = inline if has_value else argv[i + 1]
        i += 1 if has_value else 2
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = fields.setdefault(flag, {})
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    for flag, value in fields.items():
        out += [flag, json.dumps(value)]
    return out


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest sub-command parser that `args` selected (`bench throughput`: the throughput parser)."""
    while True:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(args, action.dest, None)
                if name in action.choices:
                    parser = action.choices[name]
                    break
        else:
            return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenloom {args.command}: error: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `tokenloom` program (its console script, `python -m tokenloom`): main(), then leave without the
    interpreter's teardown (tokenloom/process_exit.py), which for a command that imported torch would keep
    the shell, or a supervisor stopping `tokenloom serve`, waiting another second after the work is done."""
    from tokenloom.process_exit import exit_without_teardown

    exit_without_teardown(main())


if __name__ == "__main__":
    entry()
