"""How the library's modules depend on each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ganpipe"


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: The library's modules and the stages' entry points, by dotted name.
LIBRARY = {module_name(p): p for p in PACKAGE.rglob("*.py")}
ENTRY_POINTS = {module_name(p, ROOT): p for p in (ROOT / "stages").glob("*.py")}


def imported_at_import_time(path: Path, known: set[str]) -> set[str]:
    """ganpipe modules that ``path`` imports at module level, ``if TYPE_CHECKING`` blocks
    included (a cycle there is one for a reader and for a type checker)."""
    found = set()
    statements = list(ast.parse(path.read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If):
            statements += node.body + node.orelse
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known}


def test_the_library_has_no_import_cycle():
    graph = {name: imported_at_import_time(path, set(LIBRARY)) for name, path in LIBRARY.items()}
    graph = {name: {dep for dep in deps if dep != "ganpipe"} for name, deps in graph.items()}
    assert "ganpipe.runstate" in graph["ganpipe.loop"]  # the walk sees imports
    done, path = set(), []

    def visit(name: str) -> None:
        if name in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(name) :])} -> {name}")
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


#: Library modules a narrowly-depending stage may import without listing them in dvc.yaml,
#: because they cannot change the bytes it writes: messages, atomic file writes and the params
#: schema (the values are params.yaml's, which DVC tracks key by key); for prepare, which runs
#: no torch, also the CPU pins (it reads only the CPU count: how many threads decode and hash).
NOT_COMPUTING = {
    "prepare": {"ganpipe.errors", "ganpipe.files", "ganpipe.params", "ganpipe.cpu"},
    "featurenet": {"ganpipe.errors", "ganpipe.files", "ganpipe.params"},
}


def library_closure(entry: Path) -> set[str]:
    """The ganpipe modules that ``entry`` imports at import time, directly or through others
    (``stages._cli`` too; ``from ganpipe.x import y`` reaches ``ganpipe.x``, and a package's
    ``__init__``)."""
    modules = {**LIBRARY, **ENTRY_POINTS}
    found: set[str] = set()
    todo = [entry]
    while todo:
        for name in imported_at_import_time(todo.pop(), set(modules)):
            parts = name.split(".")
            for end in range(1, len(parts) + 1):  # the packages on the way: ganpipe.data...
                module = ".".join(parts[:end])
                if module in modules and module not in found:
                    found.add(module)
                    todo.append(modules[module])
    return found & set(LIBRARY)


@pytest.mark.parametrize("stage", sorted(NOT_COMPUTING))
def test_a_stage_that_lists_its_library_modules_lists_every_one_that_computes(stage):
    """prepare and featurenet name the library modules they depend on one by one (so that a
    change elsewhere in ganpipe does not rebuild the data or retrain the ruler): each module
    they import that can change their bytes must be among them (``exact`` chooses the Adam
    kernel of the feature network, for one), or DVC serves outputs of other code as cached."""
    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["deps"]
    covered = [ROOT / dep for dep in deps]
    modules = library_closure(ROOT / "stages" / f"{stage}.py") - NOT_COMPUTING[stage] - {"ganpipe"}
    assert "ganpipe.data.store" in modules  # the walk sees the stage's imports
    missing = sorted(
        name
        for name in modules
        if not any(LIBRARY[name] == c or c in LIBRARY[name].parents for c in covered)
    )
    assert missing == [], f"dvc.yaml's {stage} stage does not depend on {missing}"
