"""The registry of tool parsers by `--tool-call-parser` name: vLLM's ToolParserManager, its methods and their
behaviour, so a vLLM plugin registers itself here the same way (`@ToolParserManager.register_module("name")`
in the file `--tool-parser-plugin` names)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from tokenloom.server.tool_parsers.base import ToolParser


def _names(name: str | list[str] | None, default: str) -> list[str]:
    if name is None:
        return [default]
    if isinstance(name, str):
        return [name]
    if isinstance(name, list) and all(isinstance(n, str) for n in name):
        return name
    raise TypeError("module_name must be str, list[str], or None.")


class ToolParserManager:
    """Parsers registered eagerly (the class) or lazily (module path and class name, imported on first use)."""

    tool_parsers: dict[str, type[ToolParser]] = {}
    lazy_parsers: dict[str, tuple[str, str]] = {}  # name -> (module_path, class_name)

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name in cls.tool_parsers:
            return cls.tool_parsers[name]
        if name in cls.lazy_parsers:
            return cls._load_lazy_parser(name)
        raise KeyError(f"Tool parser '{name}' not found.")

    @classmethod
    def _load_lazy_parser(cls, name: str) -> type[ToolParser]:
        module_path, class_name = cls.lazy_parsers[name]
        parser_cls = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolParser)):
            raise TypeError(f"{class_name} in {module_path} is not a ToolParser subclass.")
        cls.tool_parsers[name] = parser_cls
        return parser_cls

    @classmethod
    def register_lazy_module(cls, name: str, module_path: str, class_name: str) -> None:
        cls.lazy_parsers[name] = (module_path, class_name)

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type[ToolParser] | None = None
                        ) -> type[ToolParser] | Callable[[type[ToolParser]], type[ToolParser]]:
        """Register `module` now, or (as a decorator) the decorated class, lazily by its module and name."""
        if not isinstance(force, bool):
            raise TypeError(f"force must be a boolean, but got {type(force)}")
        if module is not None:
            if not (isinstance(module, type) and issubclass(module, ToolParser)):
                raise TypeError(f"module must be subclass of ToolParser, but got {type(module)}")
            for n in _names(name, module.__name__):
                if not force and n in cls.tool_parsers:
                    raise KeyError(f"{n} is already registered at {cls.tool_parsers[n].__module__}")
                cls.tool_parsers[n] = module
            return module

        def decorator(obj: type[ToolParser]) -> type[ToolParser]:
            for n in _names(name, obj.__name__):
                cls.lazy_parsers[n] = (obj.__module__, obj.__name__)
            return obj

        return decorator

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(set(cls.tool_parsers) | set(cls.lazy_parsers))

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import a user's parsers (`--tool-parser-plugin`): an importable module's name, else a Python file's
        path (vLLM's order); its parsers register themselves as it loads. ValueError: neither loads (vLLM
        logs that and goes on; here the server does not start on a plugin it could not read)."""
        try:
            importlib.import_module(plugin_path)
            return
        except ModuleNotFoundError:
            pass
        path = Path(plugin_path)
        if not path.is_file():
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} is neither an importable module nor a file")
        module_name = path.stem
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        # In sys.modules before it runs, so the decorator's lazy entry (module_name, class) imports it again.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} failed to load: {exc!r}") from exc
