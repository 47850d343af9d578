"""GSM-Symbolic: instances of Apple's templates, from a safe expression evaluator (an AST whitelist, never eval/exec).

A template is a JSON file. `question_annotated` holds the question with `{var, default}` placeholders, then
`#init:` (one `- targets = expression` line per variable; a `$` before a name only marks it numeric),
`#conditions:` (boolean expressions) and `#answer: expression`. `answer_annotated` is a GSM8K solution with
`{expression}` placeholders and `<<calculator>>` annotations, ending `#### {expression}`.

Semantics:
- An `#init` value that is a collection (`range(...)`, a list, a pool) is drawn from uniformly; `sample(xs, k)`
  draws k distinct values for k targets; a `(label, number)` pair is a number that the question shows as its label.
- Draws are rejected until every condition holds. A condition is checked as soon as its variables are drawn and a
  failure restarts the whole draw; once a template proves expensive, the combinations of independently drawn
  variables that meet the conditions among them are tabulated and drawn from. Either way the instances follow the
  distribution of plain rejection sampling.
- Each instance's `####` answer must equal its `#answer`; five released templates break that and are fixed here
  (TEMPLATE_FIXES).
- Arithmetic is exact: integers and Fractions; float literals are read as exact decimals and `/` gives a Fraction,
  so `int(...)` in the solution and in `#answer` agree. Results show as decimals; `Fraction(a, b)` and the
  fraction pools show as `a/b`; word-valued pool entries (`twice`, `a third`, `four`) show their words in the
  question and their number in the solution.

The package, in the order its modules build on each other: `values` (exact numbers, number words, pools),
`functions` (the functions and operators expressions may use), `compiler` (whitelisted AST -> closures),
`template` (reading a template), `sampler` (drawing instances); this module: variants, problems, files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from clozemath.data.gsm_symbolic.sampler import Instance, generate
from clozemath.data.gsm_symbolic.template import Template, load_template
from clozemath.data.sources import DATA_DIR_ENV, Problem
from clozemath.errors import ClozeMathError
from clozemath.files import atomic_writer


Variant = Literal["symbolic", "p1", "p2"]

DATASETS: dict[str, str] = {"symbolic": "gsm_symbolic", "p1": "gsm_p1", "p2": "gsm_p2"}


def templates_folder(variant: str, templates_dir: str | Path | None = None) -> Path:
    """`<templates_dir>/<variant>/`, by default under `$CLOZEMATH_DATA_DIR/gsm_symbolic/templates/`."""
    if variant not in DATASETS:
        raise ClozeMathError(f"unknown GSM-Symbolic variant '{variant}' (known: {', '.join(DATASETS)})")
    if templates_dir is None:
        root = os.environ.get(DATA_DIR_ENV)
        if not root:
            raise ClozeMathError(f"no templates folder: set {DATA_DIR_ENV} or pass a templates folder")
        templates_dir = Path(root) / "gsm_symbolic" / "templates"
    folder = Path(templates_dir) / variant
    if not folder.is_dir():
        raise ClozeMathError(f"{folder}: no such templates folder")
    return folder


def load_templates(variant: str, templates_dir: str | Path | None = None) -> list[Template]:
    folder = templates_folder(variant, templates_dir)
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise ClozeMathError(f"{folder}: no *.json templates")
    return [load_template(path) for path in paths]


def problem_id(dataset: str, instance: Instance) -> str:
    return f"{dataset}-{instance.template}-{instance.index}"


def to_problem(instance: Instance, dataset: str) -> Problem:
    return Problem(problem_id(dataset, instance), dataset, "test", instance.question, instance.answer, instance.gold)


def _check_count(per_template: int) -> None:
    if per_template < 1:
        raise ClozeMathError(f"per_template must be at least 1, got {per_template}")


def instances(
    variant: Variant, per_template: int, seed: int, templates_dir: str | Path | None = None
) -> list[Problem]:
    """`per_template` seeded instances of every template of a variant, as test Problems (`gsm_p1-0007-2`)."""
    _check_count(per_template)
    templates = load_templates(variant, templates_dir)
    dataset = DATASETS[variant]
    return [
        to_problem(instance, dataset) for template in templates for instance in generate(template, per_template, seed)
    ]


@dataclass(frozen=True)
class Written:
    path: Path
    templates: int
    instances: int
    draws: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"wrote {self.instances} instances of {self.templates} templates to {self.path} in {self.seconds:.1f} s "
            f"({self.instances / max(self.seconds, 1e-9):.0f} instances/s, {self.draws / self.instances:.1f} "
            f"draws per instance)"
        )


def write_jsonl(
    variant: Variant,
    per_template: int,
    seed: int,
    out: str | Path,
    templates_dir: str | Path | None = None,
    progress: bool = True,
) -> Written:
    """Instances as JSONL rows (question, answer, id, template, instance), with a progress bar on stderr."""
    _check_count(per_template)
    templates = load_templates(variant, templates_dir)
    dataset = DATASETS[variant]
    out = Path(out)
    started = time.perf_counter()
    count = draws = 0
    with atomic_writer(out) as handle:  # a template failing midway leaves an earlier `out` as it was
        for template in tqdm(templates, desc=f"gsm-{variant}", unit="template", file=sys.stderr, disable=not progress):
            for instance in generate(template, per_template, seed):
                row = {"id": problem_id(dataset, instance), "template": instance.template,
                       "instance": instance.index, "question": instance.question, "answer": instance.answer}
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += 1
                draws += instance.draws
    return Written(out, len(templates), count, draws, time.perf_counter() - started)
