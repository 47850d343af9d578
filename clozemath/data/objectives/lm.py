"""The LM objective: the whole solution after the prompt, `P<SEP>` then ` Y<EOS>`."""

from __future__ import annotations

import random

from clozemath.config import MethodConfig
from clozemath.data.objectives.base import Objective, Solution
from clozemath.data.samples import EOS, SEP, Sample


def lm_sample(problem_id: str, prompt: str, solution: str) -> Sample:
    return Sample(problem_id, LM.name, f"{prompt}{SEP}", f" {solution}{EOS}")


def lm_samples(solution: Solution, method: MethodConfig, rng: random.Random) -> list[Sample]:
    return [lm_sample(solution.problem_id, solution.prompt, solution.text)]


LM = Objective("lm", lm_samples, draws=False, settings=())
"""Balancing repeats its samples against every other objective's (`clozemath.data.objectives.balance`)."""
