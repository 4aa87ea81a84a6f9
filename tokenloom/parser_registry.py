"""The registry behind vLLM's ToolParserManager and ReasoningParserManager (tokenloom/server/tool_parsers/manager.py,
tokenloom/reasoning/abs_reasoning_parsers.py): parser classes by name, registered now (the class) or lazily (its
module path and class name, imported on first use: a plugin's decorator registers this way, so an engine process
that imported the same plugin finds it by name too). Each manager keeps vLLM's method and attribute names and
its own lookup error; what they share is here. Imports nothing of tokenloom (the reasoning room, below config,
and the server both use it)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar


class ParserRegistry:
    """Subclasses set `base` (the parser class every entry must subclass), `registered` (their own dict, under
    vLLM's attribute name too) and `lazy_parsers` (name -> (module path, class name))."""

    base: ClassVar[type]
    registered: ClassVar[dict[str, Any]]
    lazy_parsers: ClassVar[dict[str, tuple[str, str]]]

    @classmethod
    def _lookup(cls, name: str) -> Any | None:
        """The class registered under `name` (importing a lazy one now), None when nothing is."""
        if name in cls.registered:
            return cls.registered[name]
        if name in cls.lazy_parsers:
            return cls._load_lazy_parser(name)
        return None

    @classmethod
    def _load_lazy_parser(cls, name: str) -> Any:
        module_path, class_name = cls.lazy_parsers[name]
        parser_cls = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(parser_cls, type) and issubclass(parser_cls, cls.base)):
            raise TypeError(f"{class_name} in {module_path} is not a {cls.base.__name__} subclass.")
        cls.registered[name] = parser_cls
        return parser_cls

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(set(cls.registered) | set(cls.lazy_parsers))

    @classmethod
    def register_lazy_module(cls, name: str, module_path: str, class_name: str) -> None:
        cls.lazy_parsers[name] = (module_path, class_name)

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type | None = None) -> type | Callable[[type], type]:
        """Register `module` now, or (module None) decorate a class: `@Manager.register_module("my_parser")`,
        registered lazily by its module path and name, as vLLM does."""
        if not isinstance(force, bool):
            raise TypeError(f"force must be a boolean, but got {type(force)}")
        if module is not None:
            if not (isinstance(module, type) and issubclass(module, cls.base)):
                raise TypeError(f"module must be subclass of {cls.base.__name__}, but got {type(module)}")
            for n in registry_names(name, module.__name__):
                if not force and n in cls.registered:
                    raise KeyError(f"{n} is already registered at {cls.registered[n].__module__}")
                cls.registered[n] = module
            return module

        def decorator(obj: type) -> type:
            for n in registry_names(name, obj.__name__):
                cls.lazy_parsers[n] = (obj.__module__, obj.__name__)
            return obj

        return decorator


def registry_names(name: str | list[str] | None, default: str) -> list[str]:
    """vLLM's register_module names: one, several, or (None) the class's own."""
    if name is None:
        return [default]
    if isinstance(name, str):
        return [name]
    if isinstance(name, list) and all(isinstance(n, str) for n in name):
        return name
    raise TypeError("module_name must be str, list[str], or None.")
