"""How the library's modules depend on each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ganpipe"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imported_at_import_time(path, set(paths)) for name, path in paths.items()}
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
