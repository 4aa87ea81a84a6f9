"""Argument values a model wrote as text, typed by the tool's JSON schema (vLLM: tool_parsers/utils.py,
extract_types_from_schema and coerce_to_schema_type, same rules).

Formats such as Qwen3-Coder's XML write every argument as bare text (`<parameter=days>\n3\n</parameter>`); the
tool's `parameters` schema says whether that is the string "3" or the number 3. Anything that does not fit a
type the schema allows stays the model's string, and nothing becomes a value JSON cannot hold (inf, NaN).
"""

from __future__ import annotations

import json
import math
from typing import Any

_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
    "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
    "float": "number", "float32": "number", "float64": "number", "double": "number",
    "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array",
}
# The order types are tried in: the first that takes the text wins ("string" takes anything).
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_VALUE_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "array"), (dict, "object"))


def extract_types_from_schema(schema: Any) -> list[str]:
    """Every type a schema allows: `type` (a name or a list), the types of its `enum` values, and those of
    its anyOf / oneOf / allOf branches; ["string"] when it says none."""
    if not isinstance(schema, dict):
        return ["string"]
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            types.add("null" if value is None else _enum_value_type(value))
    for branch in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(branch), list):
            for choice in schema[branch]:
                types.update(extract_types_from_schema(choice))
    return list(types) if types else ["string"]


def _enum_value_type(value: Any) -> str:
    for python_type, json_type in _ENUM_VALUE_TYPES:  # bool before int: True is an int too
        if isinstance(value, python_type):
            return json_type
    return "string"


def _is_json_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_json_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_is_json_finite(v) for v in value.values())
    return True


def _as_type(value: str, json_type: str) -> tuple[bool, Any]:
    """(whether `value` reads as `json_type`, the value it reads as)."""
    if json_type == "null":
        return value.lower() == "null", None
    if json_type == "string":
        return True, value
    if json_type == "integer":
        try:
            return True, int(value)
        except ValueError:
            return False, None
    if json_type == "number":
        try:
            number = float(value)
        except ValueError:
            return False, None
        if not math.isfinite(number):
            return False, None
        return True, int(number) if number == int(number) else number
    if json_type == "boolean":
        lowered = value.lower().strip()
        if lowered in ("true", "1", "false", "0"):
            return True, lowered in ("true", "1")
        return False, None
    if json_type in ("object", "array"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return False, None
        return _is_json_finite(parsed), parsed
    return False, None


def coerce_to_schema_type(value: str, schema_type: str | list[str]) -> Any:
    """The model's text `value` as the first of the allowed types it reads as; a type tokenloom does not know
    falls back to the text as JSON, and anything else stays the text."""
    names = [schema_type] if isinstance(schema_type, str) else schema_type
    allowed = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in names}
    for json_type in _TYPE_PRIORITY:
        if json_type in allowed:
            ok, typed = _as_type(value, json_type)
            if ok:
                return typed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _is_json_finite(parsed) else value


def coerce_arguments(args: dict[str, Any], properties: dict[str, Any]) -> bool:
    """Type `args` (in place) by the tool's `properties`, into nested objects and arrays; whether anything
    changed (vLLM's ParserEngine._coerce_dict)."""
    changed = False
    for key, value in args.items():
        schema = properties.get(key)
        if isinstance(schema, dict):
            typed, value_changed = _coerce_value(value, schema)
            if value_changed:
                args[key] = typed
                changed = True
    return changed


def _coerce_value(value: Any, schema: dict[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        typed = coerce_to_schema_type(value, extract_types_from_schema(schema))
        return typed, typed is not value
    if isinstance(value, dict):
        nested = schema.get("properties")
        return value, isinstance(nested, dict) and coerce_arguments(value, nested)
    if isinstance(value, list):
        items = schema.get("items")
        if not isinstance(items, dict):
            return value, False
        changed = False
        for i, item in enumerate(value):
            typed, item_changed = _coerce_value(item, items)
            if item_changed:
                value[i], changed = typed, True
        return value, changed
    typed = coerce_to_schema_type(json.dumps(value, ensure_ascii=False), extract_types_from_schema(schema))
    if type(typed) is not type(value) or typed != value:
        return typed, True
    return value, False
