"""GSM-Symbolic (Mirzadeh et al. 2024): GSM8K's questions as templates; its three evaluation sets, graded and
prompted as GSM8K is.

`gsm_symbolic` and `gsm_p1` (one added clause) are instantiated from the templates (`per_template` seeded instances
of each); `gsm_p2` (two added clauses) is Apple's released instances, or instantiated like the others with `generate`.
"""

from __future__ import annotations

from dataclasses import replace

from clozemath.data.gsm_symbolic import Variant, instances, templates_folder
from clozemath.data.sources import Problem, fingerprint
from clozemath.tasks.base import EvalSource, StoredDataset, Task
from clozemath.tasks.gsm8k import GSM8K
from clozemath.tasks.harness import numeric_match


def _released(name: str, source: EvalSource) -> bool:
    """Apple released P2's instances; the other sets exist only as templates."""
    return name == "gsm_p2" and not source.generate


def _variant_set(name: str, title: str, variant: Variant) -> Task:
    released = StoredDataset(name)

    def problems(source: EvalSource) -> list[Problem]:
        if _released(name, source):
            return released.problems(source)
        return instances(variant, source.per_template, source.seed, source.path)

    def identity(source: EvalSource) -> str:
        if _released(name, source):
            return released.identity(source)
        folder = templates_folder(variant, source.path)
        return f"{folder.resolve()} {fingerprint(sorted(folder.glob('*.json')))}"

    return replace(GSM8K, name=name, title=title, problems=problems, identity=identity, harness_match=numeric_match)


GSM_SYMBOLIC = _variant_set("gsm_symbolic", "GSM-Sym", "symbolic")
GSM_P1 = _variant_set("gsm_p1", "GSM-P1", "p1")
GSM_P2 = _variant_set("gsm_p2", "GSM-P2", "p2")
