"""Engine options for the command line, derived from the config dataclasses (tokenloom/config.py).

Shared by generate, chat, serve, bench and simulate. Flag names are vLLM's (`--scheduling-policy`),
help text, choices and defaults come from each field's `knob(...)`: a new knob needs no edit here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from tokenloom.config import EngineArg, engine_args, engine_config_from_kwargs, parse_bytes

__all__ = ["add_engine_args", "engine_config_from_args", "engine_kwargs_from_args", "parse_bytes", "cli_type"]

_GROUPS = {"engine": "engine", "scheduler": "scheduler", "cache": "KV cache",
           "parallel": "data parallel (docs/data_parallel.md)"}


def cli_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser whose ValueError argparse reports with its message (not just 'invalid value')."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_engine_arg(group: Any, a: EngineArg, *, field_default: bool = False) -> None:
    """One knob as a flag. Engine-level knobs show their default; scheduler and cache knobs default to
    None ("not given") so the config's own default applies, and their help says what it is."""
    default = a.default if (field_default or a.section == "engine") else None
    text = a.help.replace("%", "%%")
    if (default is None or field_default) and a.default not in (None, "", []) and a.kind != "bool":
        text += f" (default: {a.default})"
    kwargs: dict[str, Any] = {"default": default, "help": text, "dest": a.name}
    if a.kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
        kwargs["help"] += f" (default: {'on' if a.default else 'off'})"
    elif a.nargs is not None:
        kwargs["nargs"] = a.nargs
        kwargs["type"] = cli_type(a.parse)
    elif a.choices is not None:
        kwargs["choices"] = list(a.choices)
    else:
        kwargs["type"] = cli_type(a.parse)
        if a.kind == "json":
            kwargs["metavar"] = "JSON"
    group.add_argument(a.flag, *a.flags, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True, *,
                    only: Iterable[str] | None = None, simulated: bool = False,
                    field_defaults: bool = False) -> None:  # fmt: skip
    """Add the engine's flags, grouped as engine / scheduler / KV cache.

    only: just these knobs (by name); simulated: just the knobs the simulator models;
    field_defaults: every flag defaults to its config default (for commands without a config layer).
    """
    if with_model:
        parser.add_argument("model", nargs="?", default=None,
                            help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    wanted = set(only) if only is not None else None
    groups: dict[str, Any] = {}
    for a in engine_args():
        if (wanted is not None and a.name not in wanted) or (simulated and not a.simulated):
            continue
        if a.section not in groups:
            groups[a.section] = parser.add_argument_group(_GROUPS[a.section])
        add_engine_arg(groups[a.section], a, field_default=field_defaults)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments the command line gave (None: not given)."""
    return {a.name: getattr(args, a.name) for a in engine_args() if getattr(args, a.name, None) is not None}


def engine_config_from_args(args: argparse.Namespace):
    return engine_config_from_kwargs(model=getattr(args, "model", None), **engine_kwargs_from_args(args))
