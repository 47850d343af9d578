"""`clozemath data stats`: what segmentation (and, later, each objective) makes of a dataset split."""

from __future__ import annotations

import json
import statistics
from typing import Any

from clozemath.config import MethodConfig
from clozemath.data.objectives import objective_counts
from clozemath.data.segment import equation_units, segment_solution
from clozemath.data.sources import Problem, load_problems


def segmentation_stats(problems: list[Problem]) -> dict[str, Any]:
    """Equations per solution, solutions without any, groups (multi-line displays, systems) and units of F."""
    equations: list[int] = []
    units: list[int] = []
    groups = grouped_equations = 0
    for problem in problems:
        segments = segment_solution(problem.dataset, problem.solution)
        solution_units = equation_units(segments)
        equations.append(sum(len(unit) for unit in solution_units))
        units.append(len(solution_units))
        groups += sum(1 for segment_ids in solution_units if segments[segment_ids[0]].group is not None)
        grouped_equations += sum(segment.group is not None for segment in segments if segment.kind == "equation")
    return {
        "problems": len(problems),
        "equations": _distribution(equations),
        "solutions_without_equations": equations.count(0),
        "groups": {"count": groups, "equations": grouped_equations},
        "units": _distribution(units),
    }


def split_stats(dataset: str, split: str, path: str | None = None) -> dict[str, Any]:
    """Everything `clozemath data stats` reports on one split, one entry per concern."""
    problems = load_problems(dataset, split, path)
    stats: dict[str, Any] = {"dataset": dataset, "split": split, **segmentation_stats(problems)}
    stats["samples"] = objective_counts(problems, lm_share=MethodConfig.model_fields["lm_share"].default, seed=0)
    return stats


def print_stats(dataset: str, split: str, path: str | None, as_json: bool) -> None:
    stats = split_stats(dataset, split, path)
    print(json.dumps(stats, indent=2) if as_json else _table(stats))


def _distribution(per_solution: list[int]) -> dict[str, float | int]:
    """Total, mean, median and max over solutions (0 for an empty split)."""
    if not per_solution:
        return {"total": 0, "mean": 0.0, "median": 0, "max": 0}
    return {
        "total": sum(per_solution),
        "mean": round(statistics.fmean(per_solution), 3),
        "median": statistics.median(per_solution),
        "max": max(per_solution),
    }


def _table(stats: dict[str, Any]) -> str:
    """One `name  value` line per number; nested entries are named `outer inner` (`equations mean`)."""
    rows: list[tuple[str, Any]] = []
    for key, value in stats.items():
        if isinstance(value, dict):
            rows.extend((f"{key} {inner}", number) for inner, number in value.items())
        else:
            rows.append((key, value))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.replace('_', ' '):<{width}}  {value}" for name, value in rows)
