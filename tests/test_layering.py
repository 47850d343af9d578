"""The layering the README promises: `clozemath/` (the science) imports neither Ray nor `ray_jobs/` nor the command
line, and no module imports one that imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("clozemath", "ray_jobs", "clozemath_cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module the file imports, at its top or inside a function (a lazy import is an import too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    return {name: {other for other in imported(path) if other in files and other != name}
            for name, path in files.items()}


def test_the_science_imports_no_ray_and_no_orchestration() -> None:
    for path in (ROOT / "clozemath").rglob("*.py"):
        outside = {name for name in imported(path) if name.split(".")[0] in ("ray", "ray_jobs", "clozemath_cli")}
        assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}"


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from `start` back to itself, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for other in graph[name]:
            if other == start:
                return [*path, start]
            if other not in seen:
                seen.add(other)
                stack.append((other, [*path, other]))
    return None


def test_no_import_loops() -> None:
    graph = import_graph()
    loops = [loop for name in sorted(graph) if (loop := cycle_through(graph, name))]
    assert not loops, "import loops: " + "; ".join(" -> ".join(loop) for loop in loops)
