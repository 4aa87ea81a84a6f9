"""The registry of tool parsers by `--tool-call-parser` name: vLLM's ToolParserManager, its methods and their
behaviour, so a vLLM plugin registers itself here the same way (`@ToolParserManager.register_module("name")`
in the file `--tool-parser-plugin` names)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from tokenloom.parser_registry import ParserRegistry
from tokenloom.server.tool_parsers.base import ToolParser


class ToolParserManager(ParserRegistry):
    """Parsers registered eagerly (the class) or lazily (module path and class name, imported on first use)."""

    base = ToolParser
    tool_parsers: dict[str, type[ToolParser]] = {}
    registered = tool_parsers  # vLLM's attribute name, the registry's dict
    lazy_parsers: dict[str, tuple[str, str]] = {}  # name -> (module_path, class_name)

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        parser_cls = cls._lookup(name)
        if parser_cls is None:
            raise KeyError(f"Tool parser '{name}' not found.")
        return parser_cls

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
