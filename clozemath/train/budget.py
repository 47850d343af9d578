"""Compute budgets: how many epochs a run trains, and how many training tokens it sees.

With equal epochs, methods with several samples per problem (ClozeMath: 47,395 per GSM8K epoch, with its balanced LM
copies) make several times the optimizer steps of IT or MFT (7,473). A matched budget gives every method the steps
(`steps`) or the training tokens (`tokens`) that a reference method makes in `train.epochs`, by scaling this run's
`epochs`. Epochs rather than a step count, so that the match holds however a step is batched: one sample a row
(`train.pack_tokens=null`, a step holds `micro_batch_size x grad_accum` samples) or packed rows (a step holds about
`pack_tokens x grad_accum` tokens, so matching steps is matching tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from clozemath.config import TrainConfig
from clozemath.errors import ClozeMathError
from clozemath.train.layout import count_steps


@dataclass(frozen=True)
class Footprint:
    """A method's training set over one epoch: its samples and their (non-padding) tokens."""

    samples: int
    tokens: int


def planned_steps(footprint: Footprint, train: TrainConfig) -> int:
    """The optimizer steps a run of one sample a row makes: `max_steps`, else `epochs` over its training set."""
    return count_steps(footprint.samples // train.num_workers // train.micro_batch_size, train).total_steps


def planned_tokens(footprint: Footprint, train: TrainConfig, packed: bool = False) -> int | None:
    """The training tokens a run plans to see: `epochs` over its training set (however its steps are batched), or,
    where `max_steps` sets the steps instead, the share of them its steps reach (a 20-step run plans 20 steps' tokens,
    not an epoch's; more steps than the epochs hold go round the data again). None where that share is unknown until
    the workers lay out their rows (`max_steps` with packing)."""
    tokens = train.epochs * footprint.tokens
    if train.max_steps is None:
        return round(tokens)
    if packed:
        return None
    steps_of_epochs = planned_steps(footprint, train.model_copy(update={"max_steps": None}))
    return round(tokens * train.max_steps / steps_of_epochs)


def matched_epochs(train: TrainConfig, reference: Footprint, mine: Footprint, packed: bool) -> float:
    """The epochs that give this run the reference's optimizer steps (`budget: steps`) or its training tokens
    (`budget: tokens`) in `epochs`. Packed steps hold a fixed number of tokens: there, steps match when tokens do."""
    if train.budget == "epochs":
        raise ClozeMathError("train.budget is 'epochs': no budget to match")
    if train.budget == "tokens" or packed:
        return train.epochs * reference.tokens / mine.tokens
    return train.epochs * reference.samples / mine.samples
