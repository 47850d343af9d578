"""A training run whose loss diverged: its smoothed loss climbed to `train.divergence_factor` times the lowest it had
reached. One rule for the loop, which warns on the console the step it happens (the run goes on: what it scores is
the measurement) and again at the run's end (ended diverged or came back), and for the report, which reads it from
every step's loss (`clozemath.report.seeds`), so that runs trained before the watch are judged alike. A run that
came back (its smoothed loss fell below that mark again and stayed there to its end) had a surge, not a collapse: the
report names it, and `--exclude-diverged` keeps it.

Why this rule: on Qwen2.5-Coder-1.5B (issue 46, 2026-12-04) ClozeMath's seed 4 at 3e-4 went from a smoothed loss of
0.70 at step 39 to 4.91 (7.1x), ended at 4.3x and scored 0.83% on GSM8K, while the study's other IT, ClozeMath and
ablation runs stayed within 1.43x of their lowest, MFT's, whose masking grows over training (Masked Thought's
schedule), within 2.2x, and one ClozeMath run of the rate sweep that surged to 2.2x came back and scored with its
method. A gradient-norm spike is no such sign there: ClozeMath's seeds 0 and 3 spiked to 49-87 and scored with their
method. Why "came back" is apart: ClozeMath's MATH seed 2 reached 3x its lowest at step 164 (3.6x at its peak; one
step's loss 5.4, gradient norms up to 99), was back under 3x from step 172, ended at its lowest (0.43) and scored
21.4% on MATH beside its other seeds' 20.8 and 21.6.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

SMOOTHING = 0.1
"""The weight of a step's loss in the smoothed loss (an exponential moving average: about the last ten steps)."""


@dataclass(frozen=True)
class Divergence:
    step: int
    """The first step whose smoothed loss reached the factor times the lowest before it."""
    loss: float
    """The smoothed loss at `step`."""
    lowest: float
    lowest_step: int
    back: int | None = None
    """The step from which its smoothed loss stayed under the factor times `lowest` to the run's end; None: the run
    ended diverged (or, in the loop's warning, its end is not known yet)."""

    @property
    def ended_diverged(self) -> bool:
        return self.back is None

    def ending(self) -> str:
        """What the loop says at the run's end, after its warning at `step`."""
        if self.ended_diverged:
            return (f"ended diverged ({self.describe()}): `clozemath report` marks the run and --exclude-diverged "
                    "leaves it out")
        return f"came back ({self.describe()}): `clozemath report` names the run and --exclude-diverged keeps it"

    def describe(self) -> str:
        came_back = f", back under it from step {self.back}" if self.back is not None else ""
        return (f"diverged at step {self.step}: smoothed loss {self.loss:.3f}, {self.loss / self.lowest:.1f}x its "
                f"lowest ({self.lowest:.3f} at step {self.lowest_step}){came_back}")


class DivergenceWatch:
    """Fed each step's loss in order; `update` returns the run's `Divergence` at the step it happens, once, and
    `outcome` the run's at the end, with where it came back (if it did). (The loop's watch starts where the run
    starts: a run resumed from a checkpoint is watched from there.)"""

    def __init__(self, factor: float) -> None:
        if factor <= 1:
            raise ValueError(f"a divergence factor must be above 1, not {factor}")
        self.factor = factor
        self._smoothed: float | None = None
        self._lowest: tuple[float, int] | None = None
        self.found: Divergence | None = None
        self._back: int | None = None

    def update(self, step: int, loss: float) -> Divergence | None:
        if not math.isfinite(loss):  # NaN or infinite: diverged at once
            self._back = None
            lowest, lowest_step = self._lowest or (loss, step)
            return self._found(Divergence(step, loss, lowest, lowest_step))
        smoothed = loss if self._smoothed is None else SMOOTHING * loss + (1 - SMOOTHING) * self._smoothed
        self._smoothed = smoothed
        if self.found is not None:
            if smoothed >= self.factor * self.found.lowest:
                self._back = None
            elif self._back is None:
                self._back = step
        if self._lowest is None or smoothed < self._lowest[0]:
            self._lowest = (smoothed, step)
        lowest, lowest_step = self._lowest
        if smoothed >= self.factor * lowest and lowest > 0:
            return self._found(Divergence(step, smoothed, lowest, lowest_step))
        return None

    def _found(self, divergence: Divergence) -> Divergence | None:
        if self.found is not None:
            return None
        self.found = divergence
        return divergence

    def outcome(self) -> Divergence | None:
        """The run's divergence as far as it has been fed, with the step it came back from (None: not back)."""
        return None if self.found is None else replace(self.found, back=self._back)


def find_divergence(steps: Iterable[tuple[int, float]], factor: float) -> Divergence | None:
    """The first divergence of a run's (step, loss) in step order, with where it came back; None: none, or `factor`
    0 (not watched)."""
    if not factor:
        return None
    watch = DivergenceWatch(factor)
    for step, loss in steps:
        watch.update(step, loss)
    return watch.outcome()
