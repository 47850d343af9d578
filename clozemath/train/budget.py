"""Compute budgets: how many optimizer steps a run makes, and how many training tokens it sees.

With equal epochs, methods with several samples per problem (ClozeMath: 47,395 per GSM8K epoch, with its balanced LM
copies) make several times the optimizer steps of IT or MFT (7,473). A matched budget gives every method the steps
(`steps`) or the training tokens (`tokens`) that a reference method makes in `train.epochs`; `max_steps` carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

from clozemath.config import TrainConfig
from clozemath.errors import ClozeMathError
from clozemath.train.loop import plan_steps


@dataclass(frozen=True)
class Footprint:
    """A method's training set over one epoch: its samples and their (non-padding) tokens."""

    samples: int
    tokens: int


def samples_per_step(train: TrainConfig) -> int:
    return train.micro_batch_size * train.grad_accum * train.num_workers


def planned_steps(footprint: Footprint, train: TrainConfig) -> int:
    """The optimizer steps a run makes: `max_steps`, else `epochs` over its training set (the training loop's plan)."""
    return plan_steps(footprint.samples // train.num_workers, train).total_steps


def planned_tokens(footprint: Footprint, steps: int, train: TrainConfig) -> int:
    """The training tokens `steps` optimizer steps see, at the training set's mean tokens per sample."""
    return round(steps * samples_per_step(train) * footprint.tokens / footprint.samples)


def matched_steps(train: TrainConfig, reference: Footprint, mine: Footprint) -> int:
    """The optimizer steps that give this run the reference's steps (`budget: steps`) or its training tokens
    (`budget: tokens`) in `epochs`."""
    if train.budget == "epochs":
        raise ClozeMathError("train.budget is 'epochs': no budget to match")
    epochs_train = train.model_copy(update={"budget": "epochs", "max_steps": None})
    reference_steps = planned_steps(reference, epochs_train)
    if train.budget == "steps":
        return reference_steps
    return max(1, round(planned_tokens(reference, reference_steps, epochs_train) * mine.samples
                        / (mine.tokens * samples_per_step(train))))
