"""Evaluation during training: accuracy against training steps (the paper's Figure 3).

Every `eval.every_steps` optimizer steps (or at each `eval.every_share` of the planned steps) and after the last one,
the training workers decode the same `eval.during_training_limit` problems of the first evaluation set with its first
decoding, on the weights they hold, and report `curve/<set>/<decoding>/accuracy` (and `correct`, `total`) with that step's metrics: every point of a
curve is measured on one subset, apart from the run's final full-set `eval/...` accuracy.
Each rank decodes its share of the problems and the counts are summed over the ranks; under ZeRO-3, where every
forward pass gathers parameters from all ranks, every rank decodes all of them in step instead.

Ray-free: the caller hands in the rank, the world size and a function that sums counts over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from clozemath.config import EvalConfig, ExperimentConfig
from clozemath.data.sources import Problem
from clozemath.eval.evaluate import eval_problems, evaluate_batch, prompting
from clozemath.records import CURVE_PREFIX, tally_metrics

if TYPE_CHECKING:
    from clozemath.eval.decoding import Engine
    from clozemath.model.load import Loaded

SumOverRanks = Callable[[list[float]], list[float]]


@dataclass(frozen=True)
class StepEvaluation:
    """What a training run evaluates at its intermediate steps and after the last (`EvalConfig.during_training`), and
    when (`EvalConfig.during_training_steps`)."""

    set_name: str
    decoding: str
    problems: list[Problem]
    schedule: EvalConfig
    _steps: dict[int, frozenset[int]] = field(default_factory=dict, compare=False, repr=False)
    """The steps due, by the run's total (computed once)."""

    def due(self, step: int, total_steps: int) -> bool:
        if total_steps not in self._steps:
            self._steps[total_steps] = frozenset(self.schedule.during_training_steps(total_steps))
        return step in self._steps[total_steps]


def step_evaluation(cfg: ExperimentConfig) -> StepEvaluation | None:
    """The subset evaluated during training, or None when neither `eval.every_steps` nor `eval.every_share` is set."""
    evaluated = cfg.eval.during_training()
    if evaluated is None:
        return None
    set_cfg, decoding = evaluated
    return StepEvaluation(set_cfg.dataset, decoding, eval_problems(set_cfg), cfg.eval)


def during_training_engine(zero_stage: int | str, device_type: str) -> Engine:
    """The engine a model in training decodes with (its workers', and the dry-run's price of its evaluations during
    training), by its resolved ZeRO stage and its device. On a CUDA worker under ZeRO-2, CUDA graphs: for the
    evaluation the model is made a plain one to capture (`clozemath.train.inference.decoding_in_training`: peft's
    trainable special-token rows merged into their matrices, the compiled layers set aside, eval mode), then given
    back to training as it was, to the bit. Under ZeRO-3, eager: every forward gathers the parameters from all ranks
    (collectives and host work that a capture cannot hold). A CPU decodes eagerly, as it always does."""
    return "graphs" if device_type == "cuda" and zero_stage != 3 else "eager"


def evaluate_step(
    evaluation: StepEvaluation,
    loaded: Loaded,
    cfg: ExperimentConfig,
    rank: int,
    world_size: int,
    sum_over_ranks: SumOverRanks,
) -> dict[str, float]:
    """Decode and grade this rank's share of the subset on the engine chosen for a model in training
    (`during_training_engine`), the model made ready for that engine for the while (`decoding_in_training`) and given
    back to training as it was."""
    from clozemath.train.inference import decoding_in_training  # torch and peft: the dry-run imports this module

    lockstep = cfg.train.zero_stage == 3
    mine = evaluation.problems if lockstep else evaluation.problems[rank::world_size]
    engine = during_training_engine(cfg.train.zero_stage, loaded.model.device.type)
    with decoding_in_training(loaded.model, engine):
        predictions = (
            evaluate_batch(loaded, mine, evaluation.decoding, cfg.eval, prompting(cfg), engine) if mine else []
        )
    counts = [float(sum(p.correct for p in predictions)), float(len(predictions))]
    correct, total = counts if lockstep else sum_over_ranks(counts)
    return tally_metrics(evaluation.set_name, evaluation.decoding, correct, total, prefix=CURVE_PREFIX)
