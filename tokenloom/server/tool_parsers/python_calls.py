"""Python-call syntax → tool calls, the helpers of vLLM's pythonic parsers (tool_parsers/utils.py:
get_parameter_value, handle_single_tool, make_valid_python, compute_tool_delta), ported as they are.

A call's arguments are keyword arguments whose values are Python literals (plus JSON's null / true /
false); they become a JSON object (json.dumps, vLLM's spacing). Anything else (a positional argument,
a variable, an expression) is not a tool call.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from tokenloom.server.tool_parsers.messages import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


class UnexpectedAstError(Exception):
    """The text is Python, but not a list of tool calls with literal arguments."""


_JSON_NAME_LITERALS = {"null": None, "true": True, "false": False}


def get_parameter_value(val: ast.expr) -> Any:
    if isinstance(val, ast.Constant):
        # bytes, Ellipsis and complex numbers are constants without a JSON form.
        if val.value is None or isinstance(val.value, (str, int, float)):
            return val.value
        raise UnexpectedAstError("Tool call arguments must be JSON values")
    if isinstance(val, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in val.keys):
            raise UnexpectedAstError("Dict tool call arguments must have literal keys")
        return {k.value: get_parameter_value(v) for k, v in zip(val.keys, val.values)}  # type: ignore[union-attr]
    if isinstance(val, (ast.List, ast.Tuple, ast.Set)):
        # JSON has no tuple or set: both become lists (source order).
        return [get_parameter_value(v) for v in val.elts]
    if isinstance(val, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in val.values):
        return "".join(str(part.value) for part in val.values)  # type: ignore[attr-defined]
    if isinstance(val, ast.Name) and val.id in _JSON_NAME_LITERALS:
        return _JSON_NAME_LITERALS[val.id]
    if isinstance(val, ast.UnaryOp) and isinstance(val.op, (ast.USub, ast.UAdd)):
        operand = get_parameter_value(val.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(val.op, ast.USub) else operand
        raise UnexpectedAstError("Tool call arguments must be literals")
    raise UnexpectedAstError("Tool call arguments must be literals")


def _dotted_name(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise UnexpectedAstError("Invalid tool call name")
    parts.append(node.id)
    return ".".join(reversed(parts))


def handle_single_tool(call: ast.Call) -> ToolCall:
    """One call node → an OpenAI tool call (a dotted name `a.b(...)` stays dotted)."""
    if not isinstance(call.func, (ast.Name, ast.Attribute)):
        raise UnexpectedAstError("Invalid tool call name")
    name = _dotted_name(call.func)
    arguments = {kw.arg: get_parameter_value(kw.value) for kw in call.keywords}
    return ToolCall(function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def _is_escaped(text: str, index: int) -> bool:
    backslashes = 0
    j = index - 1
    while j >= 0 and text[j] == "\\":
        backslashes += 1
        j -= 1
    return backslashes % 2 == 1


def make_valid_python(text: str) -> tuple[str, str] | None:
    """(text with its open brackets and quotes closed, what was added), or None when the text stops
    where no closing makes sense yet (mid-name, after `=` or `:`, mid-key). Raises UnexpectedAstError
    for mismatched brackets."""
    stack: list[str] = []
    for index, char in enumerate(text):
        if stack and stack[-1] in {"'", '"'}:  # inside a string only its closing quote counts
            if char == stack[-1] and not _is_escaped(text, index):
                stack.pop()
            continue
        if char in {"[", "(", "{"}:
            stack.append(char)
        elif char == "]":
            if not stack or stack.pop() != "[":
                raise UnexpectedAstError("Mismatched square brackets")
        elif char == ")":
            if not stack or stack.pop() != "(":
                raise UnexpectedAstError("Mismatched parentheses")
        elif char == "}":
            if not stack or stack.pop() != "{":
                raise UnexpectedAstError("Mismatched curly braces")
        elif char in {"'", '"'}:
            stack.append(char)

    text = text.rstrip()
    if text.endswith("=") or text.endswith(":"):
        return None
    if stack and stack[-1] == "{":
        trailing = text[: text.rfind("{")]
        if trailing.count(":") <= trailing.count(","):
            return None
    if stack and stack[-1] == "(":
        trailing = text[: text.rfind("(")]
        if trailing.count("=") <= trailing.count(","):
            return None
    if text.endswith(","):
        text = text[:-1]
    if stack and stack[-1] == "[" and not text.endswith("[") and not text.endswith(")"):
        return None

    closing = {"[": "]", "(": ")", "{": "}", "'": "'", '"': '"'}
    added = "".join(closing[c] for c in reversed(stack))
    candidate = text + added
    # Shapes the counting above misses: a dict cut mid-key closes into a set or does not parse.
    try:
        module = ast.parse(candidate)
    except SyntaxError:
        return None
    if not module.body:
        return None
    if "}" in added and any(isinstance(node, ast.Set) for node in ast.walk(module)):
        return None
    return candidate, added


def compute_tool_delta(previously_sent_args: str, new_call: ToolCall, index: int,
                       withheld_suffix: str) -> DeltaToolCall | None:
    """The delta for call `index`: its announcement with the arguments so far (the first time), then
    only the new argument text; `withheld_suffix` (what JSON completion added) is never sent."""
    new_call_args = new_call.function.arguments
    if withheld_suffix:
        if not new_call_args.endswith(withheld_suffix):
            raise ValueError(f"Tool call arguments '{new_call_args}' do not end with expected withheld "
                             f"suffix '{withheld_suffix}'")
        new_call_args = new_call_args[: -len(withheld_suffix)]
    if not previously_sent_args:
        return DeltaToolCall(index=index, id=new_call.id, type="function",
                             function=DeltaFunctionCall(name=new_call.function.name, arguments=new_call_args))
    arg_diff = new_call_args[len(previously_sent_args):]
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arg_diff)) if arg_diff else None
