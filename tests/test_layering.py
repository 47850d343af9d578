"""The layering DEVELOPMENT.md promises: `clozemath/` (the science) imports neither Ray nor `ray_jobs/` nor the command
line; no module imports one that imports it back (directly or through others); the floors config < data < tasks <
eval < ray_jobs < command line are never climbed; and the schema (`clozemath/config.py`) loads without a registry."""

from __future__ import annotations

import ast
import subprocess
import sys
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


FLOORS = (
    ("clozemath.config", "clozemath.errors", "clozemath.registry", "clozemath.safe_yaml"),
    ("clozemath.data", "clozemath.files"),
    ("clozemath.tasks",),
    ("clozemath.eval",),
    ("ray_jobs",),
    ("clozemath_cli",),
)
"""From the lowest floor up; a module imports only from its own floor and those below (modules of no floor, such as
`clozemath.model` or `clozemath.plan`, may sit between them)."""


def floor(module: str) -> int | None:
    for level, prefixes in enumerate(FLOORS):
        if any(module == prefix or module.startswith(f"{prefix}.") for prefix in prefixes):
            return level
    return None


def test_no_module_imports_from_a_higher_floor() -> None:
    climbs = [
        f"{name} -> {other}"
        for name, others in import_graph().items() if floor(name) is not None
        for other in sorted(others) if floor(other) is not None and floor(other) > floor(name)
    ]
    assert not climbs, "imports that climb a floor: " + "; ".join(climbs)


def test_the_families_import_only_data_files_and_errors() -> None:
    allowed = ("clozemath.data", "clozemath.files", "clozemath.errors", "clozemath.registry", "clozemath.tasks")
    for name, others in import_graph().items():
        if floor(name) == floor("clozemath.tasks"):
            outside = sorted(o for o in others if not any(o == a or o.startswith(f"{a}.") for a in allowed))
            assert not outside, f"{name} imports {outside}"


def test_the_schema_loads_no_registry() -> None:
    """`clozemath.config` imports no clozemath module but the errors, and loading it loads none of the registries
    (evaluation sets, training sets, decodings, objectives) nor what they pull in (GSM-Symbolic, math-verify)."""
    assert import_graph()["clozemath.config"] <= {"clozemath.errors"}
    code = "import sys, clozemath.config; print(' '.join(m for m in sys.modules if m.startswith('clozemath')))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert set(loaded.stdout.split()) <= {"clozemath", "clozemath.config", "clozemath.errors"}, loaded.stdout


def test_the_processes_that_load_no_model_import_no_peft() -> None:
    """peft takes 5-10 s to import on 2 cores. The driver (`ray_jobs.grid`), each trial's process (the same module)
    and Ray Train's controller (`ray_jobs.train`, the workers' loop's module) load no model: a `clozemath run` once
    paid it in each of them, one after another, before a worker started."""
    code = "import sys, ray_jobs.grid, ray_jobs.train; print(sorted(m for m in ('peft', 'deepspeed') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
