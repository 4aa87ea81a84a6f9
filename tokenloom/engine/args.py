"""Engine options for the command line, derived from the config dataclasses (tokenloom/config.py).

Shared by generate, chat, serve, bench and simulate. Flag names are vLLM's (`--scheduling-policy`),
help text, choices and defaults come from each field's `knob(...)`: a new knob needs no edit here.
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Callable, Iterable
from dataclasses import field, make_dataclass
from typing import Any

from tokenloom.config import EngineArg, EngineConfig, engine_args, engine_config_from_kwargs, parse_bytes

__all__ = ["add_engine_args", "engine_config_from_args", "engine_kwargs_from_args", "parse_bytes", "cli_type",
           "EngineArgs", "AsyncEngineArgs"]

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
        if a.nargs == "?":  # the bare flag (vLLM's `--hf-token` alone: the token `hf auth login` stored)
            kwargs["const"] = a.const
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


# vLLM's EngineArgs / AsyncEngineArgs ----------------------------------------------------------------------
class _EngineArgsMethods:
    """What vLLM's EngineArgs does besides holding the arguments: read them from a command line, make the
    engine's config. The fields are made from the config's knobs (below), so a new knob needs no edit here."""

    model: str | None

    def engine_kwargs(self) -> dict[str, Any]:
        """The arguments given (None: not given, the config's default applies)."""
        return {a.name: getattr(self, a.name) for a in engine_args() if getattr(self, a.name) is not None}

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig these arguments make (vLLM's create_engine_config); a bad value is a ConfigError
        naming it."""
        return engine_config_from_kwargs(model=self.model, **self.engine_kwargs())

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's: the engine's flags (and `--model`) on `parser`, which is returned."""
        parser.add_argument("--model", default=None,
                            help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
        add_engine_args(parser, with_model=False)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Any:
        """The arguments a parser made by add_cli_args read (unknown attributes of `args` are ignored)."""
        return cls(model=getattr(args, "model", None), **engine_kwargs_from_args(args))


def _engine_args_fields() -> list[tuple[str, Any, Any]]:
    # Engine knobs default to their value; scheduler and cache knobs to None ("not given", as on the command
    # line), so that their config's own default applies, which may depend on other knobs.
    fields_ = [("model", "str | None", field(default=None))]
    for a in engine_args():
        default = a.default if a.section == "engine" else None
        if isinstance(default, list | dict):  # a fresh copy per instance (hf_overrides' {}, vLLM's default)
            fields_.append((a.name, Any, field(default_factory=functools.partial(copy.deepcopy, default))))
        else:
            fields_.append((a.name, Any, field(default=default)))
    return fields_


# vLLM's EngineArgs: every engine argument by vLLM's name, e.g. EngineArgs(model=..., max_num_seqs=8); a dataclass,
# so vLLM's `LLM(**dataclasses.asdict(engine_args))` works as in vLLM's examples.
EngineArgs = make_dataclass("EngineArgs", _engine_args_fields(), bases=(_EngineArgsMethods,), kw_only=True,
                            namespace={"__module__": __name__})
EngineArgs.__doc__ = ("vLLM's EngineArgs: the engine's arguments by vLLM's names (tokenloom/config.py's knobs), "
                      "given to LLMEngine.from_engine_args / AsyncLLM.from_engine_args or LLM(**asdict(args)).")
# vLLM's AsyncEngineArgs adds front-end logging switches; tokenloom's front end takes the same arguments.
AsyncEngineArgs = make_dataclass("AsyncEngineArgs", [], bases=(EngineArgs,), kw_only=True,
                                 namespace={"__module__": __name__})
AsyncEngineArgs.__doc__ = "vLLM's AsyncEngineArgs (the same arguments as EngineArgs), for AsyncLLM.from_engine_args."
