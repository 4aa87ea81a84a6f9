"""An input-grounded workload: prompts whose answer largely copies the prompt ("repeat / rewrite /
fix this code"), built from functions of CPython's standard library shipped in
tokenloom/data/grounded_snippets.json. N-gram speculation shines here: the continuation of the output
is usually in the prompt.
"""

from __future__ import annotations

import json
from importlib import resources

TASKS = (
    "Repeat the following Python function exactly, character for character, with no explanation.",
    "Rewrite the following Python function exactly as it is, keeping every line, and add nothing else.",
    "Copy this code into your answer unchanged, inside a python code block.",
)


def load_snippets() -> list[dict]:
    data = json.loads(resources.files("tokenloom.data").joinpath("grounded_snippets.json").read_text())
    return data["snippets"]


def grounded_messages(num: int, offset: int = 0) -> list[list[dict[str, str]]]:
    """`num` chat conversations (one user turn each), cycling over snippets and task wordings."""
    snippets = load_snippets()
    out = []
    for i in range(offset, offset + num):
        snippet = snippets[i % len(snippets)]
        task = TASKS[(i // len(snippets)) % len(TASKS)]
        out.append([{"role": "user", "content": f"{task}\n\n```python\n{snippet['text']}\n```"}])
    return out
