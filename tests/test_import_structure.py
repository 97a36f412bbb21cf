"""The package's imports keep the house of docs/architecture.md §2: no circle, nothing upward.

Every ``import`` and ``from ... import`` in ``src/radixserve`` counts, wherever it stands: at
module level, inside a function, or under ``if TYPE_CHECKING:`` (a type-only import still ties
two modules together, and it is how circles hid before). The walk reads the files with ``ast``
and imports nothing.

Layers, lowest first: a module may import its own layer and the layers below it, never one
above. Inside ``managers/``, the server process's side (``tokenizer/``) and the scheduler's side
(``scheduler/``) never import each other, and the shared plumbing at the top of ``managers/``
imports neither (except the launcher, which spawns them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "radixserve"

# Longest prefix wins. Same rank: allowed both ways (the circle check still applies).
LAYERS: dict[str, int] = {
    "radixserve.envs": 0,
    "radixserve.finish_reason": 0,
    "radixserve.version": 0,
    "radixserve.startup_gc": 0,
    "radixserve.cache_files": 0,  # a lock and a source digest for the on-disk caches
    "radixserve.gguf_cache": 0,  # keeps what a GGUF file's metadata gives (needs only envs)
    "radixserve.server_args": 0,
    "radixserve.sampling": 1,
    "radixserve.distributed": 1,
    "radixserve.mem_cache": 1,
    "radixserve.forward_batch": 2,
    "radixserve.layers": 3,
    "radixserve.model_registry": 4,
    "radixserve.model_config": 4,
    "radixserve.gguf_file": 4,  # a GGUF file's metadata as a config (model_config reads it)
    "radixserve.tokenizer_loader": 4,
    "radixserve.model_executor": 5,
    "radixserve.lora": 5,
    "radixserve.constrained": 5,
    "radixserve.sessions": 5,
    "radixserve.speculative": 5,
    "radixserve.managers": 6,
    "radixserve.server": 7,
    "radixserve.registry_choices": 7,
    "radixserve.engine": 8,
    "radixserve.cli": 9,
    "radixserve.__main__": 10,
    "radixserve": 10,  # the package face: lazily hands out Engine and ServerArgs
}

# (importer prefix, imported prefix) pairs that must never meet, whatever their layers.
APART = [
    ("radixserve.managers.tokenizer", "radixserve.managers.scheduler"),
    ("radixserve.managers.scheduler", "radixserve.managers.tokenizer"),
    ("radixserve.managers.detokenizer_manager", "radixserve.managers.scheduler"),
    ("radixserve.managers.detokenizer_manager", "radixserve.managers.tokenizer"),
    ("radixserve.managers.io_struct", "radixserve.managers.scheduler"),
    ("radixserve.managers.io_struct", "radixserve.managers.tokenizer"),
    ("radixserve.managers.child_process", "radixserve.managers.launcher"),
]


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module (or package) of ours that ``name`` lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _import_statements(module: str):
    """Each import of ``module`` as ``(node, base)``: ``base`` is the absolute module a
    ``from ... import`` names (relative imports resolved), None for a plain ``import``."""
    path, is_package = MODULES[module]
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield node, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            yield node, base


def _imports(module: str) -> set[str]:
    found: set[str | None] = set()
    for node, base in _import_statements(module):
        if base is None:
            found.update(_resolve(a.name) for a in node.names if a.name.startswith(PACKAGE))
        elif base == PACKAGE or base.startswith(PACKAGE + "."):
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else _resolve(base))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


GRAPH = {module: _imports(module) for module in MODULES}


def _missing(module: str) -> list[str]:
    """The modules of ours that ``module`` imports by a name that is not a module of ours (a
    file moved away, its importer not updated: it would fail only when that import runs)."""
    missing = []
    for node, base in _import_statements(module):
        names = [a.name for a in node.names] if base is None else [base]
        missing += [n for n in names if n.split(".")[0] == PACKAGE and n not in MODULES]
    return missing


def _layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    circles.append(sorted(members))
    return circles


def test_the_walk_sees_the_package():
    assert len(MODULES) > 100
    assert "radixserve.forward_batch" in GRAPH["radixserve.model_executor.model_runner"]
    # a type-only import counts: schedule_batch names ForwardBatch under TYPE_CHECKING or not
    assert "radixserve.forward_batch" in GRAPH["radixserve.managers.scheduler.schedule_batch"]


def test_every_import_names_a_module_that_exists():
    missing = {m: _missing(m) for m in MODULES}
    assert not {m: names for m, names in missing.items() if names}


def test_every_module_has_a_layer():
    for module in MODULES:
        assert _layer(module) >= 0


def test_no_import_circle():
    circles = _circles(GRAPH)
    described = [
        " <-> ".join(c) + ": " + "; ".join(
            f"{a} -> {b}" for a in c for b in sorted(GRAPH[a]) if b in c
        )
        for c in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{a} (layer {_layer(a)}) -> {b} (layer {_layer(b)})"
        for a, targets in GRAPH.items() for b in sorted(targets) if _layer(b) > _layer(a)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


@pytest.mark.parametrize("importer, imported", APART)
def test_processes_sides_stay_apart(importer, imported):
    crossing = [
        f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
        if (a == importer or a.startswith(importer + "."))
        and (b == imported or b.startswith(imported + "."))
    ]
    assert not crossing, "\n".join(crossing)


def test_the_checker_finds_a_circle_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _layer("radixserve.layers.linear") < _layer("radixserve.managers.scheduler.scheduler")
