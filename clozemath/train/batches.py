"""The data of a step: the micro-batches' rows (a pure function of seed, epoch, rank and the rows), their tensors
with the method's attention masks, and MFT's noise."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from clozemath.config import ExperimentConfig, TrainConfig
from clozemath.data.objectives.mft import apply_mft_noise, mft_rate
from clozemath.data.tokenize import collate, collate_packs
from clozemath.model.attention import attention_inputs, flex_kernel_options, head_dim
from clozemath.train.layout import StepCounts
from clozemath.train.packing import epoch_packs

LENGTH_WINDOW = 32
"""Micro-batches whose rows are sorted by length together (`train.group_by_length`)."""


def epoch_micro_batches(
    lengths: Sequence[int], micro_batches: int, micro_batch_size: int, seed: int, epoch: int, group_by_length: bool
) -> list[list[int]]:
    """One epoch's micro-batches (row indices): a seeded permutation, the last partial micro-batch dropped.

    `group_by_length`: within windows of `LENGTH_WINDOW` micro-batches the rows are sorted by length before they are
    cut, and the micro-batches then shuffled, so that a batch pads little and the order stays random.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()[: micro_batches * micro_batch_size]
    if group_by_length:
        window = micro_batch_size * LENGTH_WINDOW
        windows = [order[start : start + window] for start in range(0, len(order), window)]
        order = [i for rows in windows for i in sorted(rows, key=lengths.__getitem__)]
    batches = [order[k * micro_batch_size : (k + 1) * micro_batch_size] for k in range(micro_batches)]
    if group_by_length:
        batches = [batches[k] for k in torch.randperm(micro_batches, generator=generator).tolist()]
    return batches


def micro_batch_rows(
    lengths: Sequence[int], steps: StepCounts, train: TrainConfig, row_tokens: int | None, seed: int, start: int
) -> Iterator[list[int]]:
    """Row indices of micro-batch `start`, `start + 1`, ... of the endless stream of epochs (with packing, a
    micro-batch is one packed row)."""
    index = start
    while True:
        epoch, offset = divmod(index, steps.micro_batches_per_epoch)
        if row_tokens is None:
            batches = epoch_micro_batches(
                lengths, steps.micro_batches_per_epoch, train.micro_batch_size, seed, epoch, train.group_by_length
            )
        else:
            batches = epoch_packs(lengths, row_tokens, steps.micro_batches_per_epoch, seed, epoch)
        yield from batches[offset:]
        index = (epoch + 1) * steps.micro_batches_per_epoch


def tokens_before(
    lengths: Sequence[int], steps: StepCounts, train: TrainConfig, row_tokens: int | None, seed: int, micro_batches: int
) -> int:
    """The real tokens of the stream's first `micro_batches` micro-batches (what a run resumed there trained before)."""
    stream = micro_batch_rows(lengths, steps, train, row_tokens, seed, start=0)
    return sum(lengths[i] for indices in itertools.islice(stream, micro_batches) for i in indices)


def micro_batch(
    rows: Sequence[Mapping[str, Any]], indices: list[int], row_tokens: int | None, pad_id: int
) -> dict[str, torch.Tensor]:
    """The tensors of one micro-batch: one packed row of `row_tokens`, or one sample a row padded to the longest."""
    samples = [rows[i] for i in indices]
    return collate(samples, pad_id) if row_tokens is None else collate_packs([samples], pad_id, width=row_tokens)


def model_inputs(
    batch: Mapping[str, torch.Tensor], config: ExperimentConfig, model: torch.nn.Module, packed: bool
) -> dict[str, torch.Tensor | Any]:
    """Forward arguments: the batch with the method's attention mask (PrefixLM, or causal) in the form the model's
    attention implementation takes. A causal one-sample-a-row batch passes its padding mask alone (the model's own
    causal mask is the fastest); packed rows always need the document mask."""
    prefix_mask: torch.Tensor | None = batch["prefix_mask"]
    if config.method.attention != "prefix_lm":
        prefix_mask = torch.zeros_like(prefix_mask) if packed else None
    implementation = model.config._attn_implementation
    dtype = next(model.parameters()).dtype
    options = flex_kernel_options(head_dim(model.config), dtype, batch["attention_mask"].device)
    masks = attention_inputs(implementation, batch["attention_mask"], prefix_mask, dtype, options)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"], **masks}


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of everything random in one step on one rank (dropout, MFT noise): resuming redraws the same."""
    return (seed * 1_000_003 + step) * 1009 + rank


def noised(
    batch: dict[str, torch.Tensor],
    config: ExperimentConfig,
    step: int,
    total_steps: int,
    mask_id: int,
    noise_ids: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """MFT: the batch with target tokens replaced at the step's rate (labels unchanged); others untouched.
    Drawn from the global RNG, which the loop seeds per step (`step_seed`)."""
    mft = config.method.mft
    if mft is None:
        return batch
    rate = mft_rate(step, total_steps, mft.r_max)
    input_ids = apply_mft_noise(batch["input_ids"], batch["labels"], rate, mft.noise, mask_id, noise_ids)
    return {**batch, "input_ids": input_ids}
