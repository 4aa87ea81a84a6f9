"""Imports go downward only: a lower room never imports a higher one (parsed, nothing is imported).

    envs < reasoning < config, sampling_params < core < distributed, sample < model, router < engine < server, workload
    < bench, sim < explore

Rooms on the same level do not import each other either (bench and sim share tokenloom/workload,
as vLLM's benchmarks share datasets.py). tokenloom/cli.py collects every room's commands by name
and sits above them all. tokenloom/core (and config, sampling_params) never import torch: the
scheduler must run, be replayed and be tested without it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenloom"

LEVELS = {
    "tokenloom.envs": -1,  # every environment variable, read in one place: imports nothing of tokenloom
    "tokenloom.process_exit": -0.9,  # leaving a process without the interpreter's teardown: imports nothing
    "tokenloom.exceptions": -0.8,  # the error a refused request raises (vLLM's VLLMValidationError): imports nothing
    "tokenloom.cpu_isa": -0.5,  # TOKENLOOM_CPU_ISA's caps: read by tokenloom/__init__.py before torch loads
    "tokenloom.parser_registry": -0.5,  # the name registry both parser managers share: imports nothing of tokenloom
    "tokenloom.metric_buckets": -0.5,  # vLLM's Prometheus bucket families: config checks, metrics build; no imports
    "tokenloom.tasks": -0.6,  # vLLM's task names and its refusal of the removed ones: imports only the error type
    "tokenloom.reasoning": -0.3,  # reasoning parsers: the server splits outputs, the engine's grammar gate waits
    "tokenloom": 0, "tokenloom.config": 0, "tokenloom.sampling_params": 0,
    "tokenloom.pooling_params": 0.1,  # a pooling request's parameters: their output_kind is the sampling params' kind
    "tokenloom.inputs": 0,  # vLLM's prompt TypedDicts: what the engine takes in, beside the params
    "tokenloom.logprobs": 0,  # vLLM's Logprob / FlatLogprobs: what the engine hands back, beside the params
    "tokenloom.core": 1, "tokenloom.spec_decode": 1,
    "tokenloom.lora": 1.5,  # LoRA adapters: torch arithmetic and files, below the model room that hooks them in
    "tokenloom.distributed": 1.5,  # process groups and collectives: torch, but below the model that calls them
    "tokenloom.sample": 1.5,  # vLLM's custom logits processor interface: torch, below the sampler that runs them
    "tokenloom.model": 2, "tokenloom.router": 2, "tokenloom.kv_transfer": 2,
    "tokenloom.engine": 3,
    "tokenloom.server": 4, "tokenloom.workload": 4,
    "tokenloom.bench": 5, "tokenloom.sim": 5,
    "tokenloom.explore": 6,
    "tokenloom.cli": 7,
    "tokenloom.__main__": 8,  # `python -m tokenloom`: runs tokenloom/cli.py
}  # fmt: skip
NO_TORCH = ("tokenloom.exceptions", "tokenloom.tasks", "tokenloom.config", "tokenloom.sampling_params",
            "tokenloom.pooling_params", "tokenloom.envs", "tokenloom.cpu_isa", "tokenloom.core", "tokenloom.inputs",
            "tokenloom.logprobs", "tokenloom.reasoning", "tokenloom.parser_registry", "tokenloom.metric_buckets")


def room(module: str) -> str:
    """tokenloom.core.scheduler -> tokenloom.core; tokenloom.config -> tokenloom.config."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement, in functions and TYPE_CHECKING blocks too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if target == "tokenloom"]
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What is wrong with one module's imports, as 'module:line imports X (why)'."""
    here = room(module)
    found = []
    for line, target in imports(source, module, is_package):
        top = target.split(".")[0]
        if top == "torch" and here in NO_TORCH:
            found.append(f"{module}:{line} imports torch ({here} must run without it)")
        if top != "tokenloom" or target == "tokenloom":
            continue
        there = room(target)
        if there == here or there not in LEVELS:
            continue
        if LEVELS[there] >= LEVELS[here]:
            kind = "a higher" if LEVELS[there] > LEVELS[here] else "a same-level"
            found.append(f"{module}:{line} imports {target} ({kind} room: {here} may only import below it)")
    return found


def package_modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def test_every_room_is_known() -> None:
    rooms = {room(module) for module, _ in package_modules()}
    assert rooms <= set(LEVELS), f"give these rooms a level in LEVELS: {sorted(rooms - set(LEVELS))}"


def test_no_module_imports_a_higher_or_sibling_room() -> None:
    found = []
    for module, path in package_modules():
        found += violations(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_checker_sees_upward_sibling_relative_and_torch_imports() -> None:
    assert violations("from tokenloom.engine.llm_engine import LLMEngine\n", "tokenloom.core.scheduler")
    assert violations("def f():\n    from tokenloom.sim import simulate\n", "tokenloom.bench.sweep")
    assert violations("from ..explore import server\n", "tokenloom.sim.cli")
    assert violations("from tokenloom import server\n", "tokenloom.model.runner")
    assert violations("import torch\n", "tokenloom.core.block_pool")
    assert not violations("from tokenloom.core.request import Request\nimport torch\n", "tokenloom.model.runner")
    assert not violations("from . import datasets\n", "tokenloom.workload", is_package=True)


def module_level_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The tokenloom modules one module imports when it is imported: module-level statements only (an
    import inside a function is a deliberate deferral, one under `if` a TYPE_CHECKING or optional one)."""
    out: set[str] = set()
    for node in ast.parse(source).body:
        body = node.body if isinstance(node, ast.Try) else [node]
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                targets = {name for _, name in imports(ast.unparse(stmt), module, is_package)}
                out |= targets
                if isinstance(stmt, ast.ImportFrom):  # `from tokenloom.server import structured`: the module
                    out |= {f"{t}.{alias.name}" for t in targets for alias in stmt.names}
    return out & known


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle_inside_a_room() -> None:
    """Within a room too, modules import each other one way (issue 31: server/structured.py and
    tool_grammar.py imported each other, one of them from inside a function to dodge the circle)."""
    modules = package_modules()
    known = {name for name, _ in modules}
    graph = {name: module_level_imports(path.read_text(), name, path.name == "__init__.py", known)
             for name, path in modules}
    assert import_cycles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def runtime_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The tokenloom modules one module imports at run time: module-level imports and those deferred
    into functions (a deferral still runs, it only hides a circle), not those under `if TYPE_CHECKING:`
    (never executed). A `from package import name` counts the submodule when `name` is one."""
    tree = ast.parse(source)
    type_only = {id(stmt) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                 ast.unparse(node.test) for sub in node.body for stmt in ast.walk(sub)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in type_only:
            targets = {name for _, name in imports(ast.unparse(node), module, is_package)}
            if isinstance(node, ast.ImportFrom):
                targets |= {f"{t}.{alias.name}" for t in targets for alias in node.names}
            for target in targets:
                while target and target not in known:  # tokenloom.model.layers.RMSNorm -> tokenloom.model.layers
                    target = target.rpartition(".")[0]
                if target and target != module:
                    out.add(target)
    return out


def room_import_graph(room_name: str, sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of the same room it imports at run time; `sources`: module -> (source, is package)."""
    known = set(sources)
    return {name: {t for t in runtime_imports(src, name, pkg, known) if room(t) == room_name}
            for name, (src, pkg) in sources.items() if room(name) == room_name}


def test_no_import_circle_inside_the_model_room_even_through_deferred_imports() -> None:
    """Issue 30 item 7: the model room's modules import one way even counting imports deferred into a
    function. llama.py used to import its families (tokenloom/model/models/) and smoothquant.py inside
    functions while both imported llama.py at module level: now the blocks are layers.py, the families
    are named by models/registry.py, and the model (decoder_model.py) sits above both."""
    sources = {name: (path.read_text(encoding="utf-8"), path.name == "__init__.py") for name, path in package_modules()}
    assert import_cycles(room_import_graph("tokenloom.model", sources)) == []


def test_no_import_circle_inside_any_room_even_through_deferred_imports() -> None:
    """Issue 31: every room imports one way, deferred imports included. The engine room had one: the
    clients' factory (make_client, then in core_client.py) imported the data-parallel and Ray clients
    inside a function while both imported core_client, and the Ray executor took `import_ray` from the
    Ray engine module; the factory now sits above the clients (engine/clients.py), and `import_ray` and
    `EngineStartError` in leaves (engine/ray_utils.py, engine/exceptions.py)."""
    sources = {name: (path.read_text(encoding="utf-8"), path.name == "__init__.py") for name, path in package_modules()}
    circles = {r: import_cycles(room_import_graph(r, sources)) for r in sorted({room(n) for n in sources})}
    assert {r: c for r, c in circles.items() if c} == {}


def test_the_deferred_circle_check_sees_the_old_model_room_circle() -> None:
    """The shapes of the old llama.py, models/qwen3.py and smoothquant.py: the deferred imports close
    the circle, the TYPE_CHECKING one does not count."""
    sources = {
        "tokenloom.model.llama": ("import torch\n"
                                  "def decoder_layer_class(a):\n    import tokenloom.model.models\n"
                                  "def load(m):\n    from tokenloom.model.smoothquant import quantize_model\n", False),
        "tokenloom.model.models": ("from tokenloom.model.llama import DECODER_LAYERS\n"
                                   "from tokenloom.model.models.qwen3 import Qwen3DecoderLayer\n", True),
        "tokenloom.model.models.qwen3": ("from tokenloom.model.llama import LlamaDecoderLayer\n", False),
        "tokenloom.model.smoothquant": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from tokenloom.model.llama import LlamaModel\n", False),
    }
    graph = room_import_graph("tokenloom.model", sources)
    assert graph["tokenloom.model.smoothquant"] == set()  # a type-only import never runs
    assert import_cycles(graph) == [["tokenloom.model.llama", "tokenloom.model.models",
                                     "tokenloom.model.models.qwen3"]]
    alone = {"tokenloom.model.layers": ("import torch\n", False)}
    assert import_cycles(room_import_graph("tokenloom.model", alone)) == []
