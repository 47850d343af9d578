"""How one worker's run is shaped before its first step: the ZeRO stage, packed rows or padded micro-batches, their
width, whether the decoder layers are compiled, and the optimizer steps these give. The same on every rank and on
every restart.

Each decision is a function of stated inputs (the config, the card's bytes or none, what the model holds, the samples'
lengths, a warm compile cache): the workers (`training_layout`, `resolved_zero_stage`), the driver's checks
(`ray_jobs.train.preflight_checks`) and the dry-run (`clozemath.cost.trials`) call the same ones."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from clozemath import console
from clozemath.config import ExperimentConfig, TrainConfig
from clozemath.errors import ClozeMathError
from clozemath.model.memory import usable_bytes
from clozemath.train.compilation import compiled_before, compiled_shape_key
from clozemath.train.distributed import all_ranks_reduce
from clozemath.train.packing import auto_pack_tokens, packs_needed, whole_blocks
from clozemath.train.zero import (
    TrainingMemory,
    auto_zero_stage,
    card_bytes,
    model_memory,
    planned_row_tokens,
    with_zero_stage,
)


@dataclass(frozen=True)
class StepCounts:
    """How many micro-batches an epoch has on this worker, and how many optimizer steps the run makes."""

    micro_batches_per_epoch: int
    total_steps: int
    warmup_steps: int


def count_steps(per_epoch: int, train: TrainConfig) -> StepCounts:
    """Steps of the whole run from one worker's micro-batches per epoch (every rank must get the same count)."""
    if per_epoch < train.grad_accum:
        raise ClozeMathError(
            f"too few training samples: {per_epoch} micro-batches per worker cannot fill one step of "
            f"train.grad_accum={train.grad_accum} (train.micro_batch_size={train.micro_batch_size}, "
            f"train.pack_tokens={train.pack_tokens})"
        )
    total = train.max_steps or max(1, int(train.epochs * per_epoch) // train.grad_accum)
    return StepCounts(per_epoch, total, warmup_steps=math.ceil(train.warmup_ratio * total))


# --------------------------------------------------------------------------------------------------------------
# The ZeRO stage


def zero_stage(train: TrainConfig, memory: TrainingMemory, card: int | None, workers: int) -> int:
    """`train.zero_stage`; auto: `auto_zero_stage` for `memory` on `card` bytes (this process's share; None: no GPU)
    with `workers` workers."""
    return auto_zero_stage(memory, card, workers) if train.zero_stage == "auto" else train.zero_stage


def needless_zero3(train: TrainConfig, memory: TrainingMemory, card: int | None, workers: int) -> str | None:
    """The warning for a set ZeRO-3 where `auto` would take ZeRO-2 (the model fits one card); else None."""
    if train.zero_stage != 3 or card is None or workers < 2 or auto_zero_stage(memory, card, workers) != 2:
        return None
    return (f"train.zero_stage=3: the frozen model, the optimizer state and a row ({memory.total / 2**30:.1f} GiB) fit "
            f"one card ({card / 2**30:.0f} GiB), where ZeRO-2 trains faster: ZeRO-3 gathers every layer from the other "
            "cards, forward and backward (SmolLM2 on 2 GPUs ran 66% of one GPU alone). `auto` takes ZeRO-2 here")


def resolved_zero_stage(config: ExperimentConfig, model: torch.nn.Module, device: torch.device) -> ExperimentConfig:
    """The config with its ZeRO stage decided for this model on this card (`zero_stage`), agreed across the ranks
    (`with_zero_stage`); a needless set ZeRO-3 is warned about by rank 0. Once per worker: a set stage it returns is
    indistinguishable from one the user set."""
    train = config.train
    card = card_bytes(device, train.gpu_share)
    workers = dist.get_world_size() if dist.is_initialized() else 1
    memory = model_memory(model, planned_row_tokens(train, config.data.max_length))
    warning = needless_zero3(train, memory, card, workers)
    if warning is not None and dist.get_rank() == 0:
        console.warn(warning)
    return with_zero_stage(config, zero_stage(train, memory, card, workers), device)


# --------------------------------------------------------------------------------------------------------------
# Packing


def packs(train: TrainConfig, gpu: bool) -> bool:
    """Whether a run packs its samples into rows (`train.pack_tokens`; auto: on a GPU only)."""
    return train.pack_tokens is not None and (train.pack_tokens != "auto" or gpu)


def row_tokens(train: TrainConfig, model_config: object, beside_model: int | None, longest: int) -> int | None:
    """Tokens of a packed row, or None for padded micro-batches (`packs`). `beside_model`: the bytes of this
    process's share of the card left beside the loaded model (None: no GPU), which `auto` sizes the row to (not to
    the memory free right now: a restarted run sizes the same rows)."""
    if not packs(train, gpu=beside_model is not None):
        return None
    if isinstance(train.pack_tokens, int):
        return train.pack_tokens
    assert beside_model is not None  # `packs`: auto packs on a GPU only
    return auto_pack_tokens(model_config, beside_model, longest)


def micro_batches_per_epoch(
    lengths: Sequence[int], train: TrainConfig, row_tokens: int | None, device: torch.device
) -> int:
    """The same on every rank: padded micro-batches of the smallest shard (the others drop their extra rows), or
    the packed rows of the largest (the others spread their samples over as many rows)."""
    if row_tokens is None:
        return all_ranks_reduce(len(lengths) // train.micro_batch_size, dist.ReduceOp.MIN, device)
    return all_ranks_reduce(packs_needed(lengths, row_tokens), dist.ReduceOp.MAX, device)


COMPILE_PAYS_OFF_TOKENS = 2_000_000
"""`train.compile: auto` compiles a worker's run of at least this many tokens. Compiling the decoder layers and
FlexAttention's kernels takes seconds to minutes; below this a run is over sooner uncompiled, in rows of
`EAGER_PACK_TOKENS` through sdpa. The break-even measured per model and card, compiled and uncompiled speeds and
compile times: `bench/results/train_throughput_profile_h100_h200.md`."""
COMPILE_PAYS_OFF_WARM_TOKENS = 500_000
"""The same where the compile cache already holds the run's compiled step (`clozemath.train.compilation.
compiled_before`): the first step then takes seconds (SmolLM2 on an H200: 8.7 s warm, then ~128k tokens/s against
~18k uncompiled: it pays back from ~0.2M tokens; bench/results/blockmask_h200_2026-11-28). Both thresholds date from
cold first steps of 4-5 minutes, before the BlockMask was built eagerly (now 15-21 s cold); not yet lowered. Only for
a fixed `train.pack_tokens`: under `auto` the compiled row is wider, and a run must not train on other rows because a
cache was warm."""
EAGER_PACK_TOKENS = 4096
"""`train.pack_tokens: auto` caps an uncompiled row here: sdpa's dense mask spans all L x L pairs of a row, so a longer
row spends more on attention across samples it then masks out."""


@dataclass(frozen=True)
class Layout:
    """How one worker's steps are shaped: packed rows of `row_tokens` tokens (None: padded micro-batches), and whether
    the decoder layers are compiled (FlexAttention's block-sparse document masks) or run eagerly (dense masks, sdpa)."""

    row_tokens: int | None
    compiled: bool
    steps: StepCounts
    warm: bool = False
    """Compiled from a compile cache that holds this shape's compiled step (`compiled_before`)."""


def training_layout(
    config: ExperimentConfig, model: torch.nn.Module, lengths: Sequence[int], device: torch.device,
    compile_cache: Path | None = None,
) -> Layout:
    """Row size (`row_tokens` beside what the loaded model holds), compilation and the steps they give; the same on
    every rank and on every restart (a function of the rows' lengths, the config, the GPU's memory and, for a fixed
    row, whether `compile_cache` holds its compiled step).
    An uncompiled packed run on FlexAttention (chosen when the model was loaded for training) moves to
    `uncompiled_attention`: FlexAttention run eagerly compiles its own kernels all the same."""
    train = config.train
    longest = max(lengths, default=1)
    row = row_tokens(train, model.config, usable_bytes(device) if device.type == "cuda" else None, longest)
    if train.pack_tokens == "auto" and row is not None:  # the smallest over the ranks: every rank plans alike
        row = all_ranks_reduce(row, dist.ReduceOp.MIN, device)
    warm = compile_cache is not None and row is not None and \
        compiled_before(compile_cache, compiled_shape_key(config, row, device))
    warm = bool(all_ranks_reduce(int(warm), dist.ReduceOp.MIN, device))  # a mark written meanwhile: every rank alike
    layout = choose_layout(train, row, longest, device,
                           lambda row_tokens: micro_batches_per_epoch(lengths, train, row_tokens, device), warm)
    if layout.row_tokens is not None and not layout.compiled and config.model.attn_implementation == "auto" \
            and model.config._attn_implementation == "flex_attention":
        model.set_attn_implementation(uncompiled_attention(train))
    return layout


def uncompiled_attention(train: TrainConfig) -> str:
    """The attention of an uncompiled packed run: sdpa, whose kernels for a dense mask do not repeat their backward
    (two runs part from their second step, with torch's deterministic algorithms or without; torch warns that
    memory-efficient attention's backward is nondeterministic unless those are strict); with `train.deterministic`
    (and `train.compile: false`: auto compiles such a run), transformers' eager attention, which repeats bit for bit.
    On SmolLM2 at rows of 4,096 tokens both trained at one speed (one H100, 2026-12-05:
    bench/results/reproducibility_h100_2026-12-05/), but eager keeps each layer's attention weights for the
    backward, 6 bytes a head per pair of positions (fp32 and bf16), which the row's sizing does not count: at 4,096
    tokens 25 GiB for SmolLM2-135M's 30 layers of 9 heads, 32 GiB for Qwen2.5-1.5B's 28 of 12."""
    return "eager" if train.deterministic else "sdpa"


def choose_layout(
    train: TrainConfig, row_tokens: int | None, longest: int, device: torch.device,
    per_epoch: Callable[[int | None], int], warm: bool = False,
) -> Layout:
    """`training_layout`'s choice from the `row_tokens` it sizes (None: padded micro-batches) and `per_epoch`, the
    micro-batches an epoch takes in rows of that width: compiled when `should_compile`, else an auto row capped at
    `EAGER_PACK_TOKENS`. `clozemath.cost` makes the same choice for a run not started."""
    steps = count_steps(per_epoch(row_tokens), train)
    compiled = should_compile(train, row_tokens, steps, device, warm)
    if row_tokens is None or compiled:
        return Layout(row_tokens, compiled, steps, warm and compiled)
    if train.pack_tokens == "auto" and row_tokens > EAGER_PACK_TOKENS:
        row_tokens = max(EAGER_PACK_TOKENS, whole_blocks(longest))
        steps = count_steps(per_epoch(row_tokens), train)
    return Layout(row_tokens, compiled, steps)


def should_compile(train: TrainConfig, row_tokens: int | None, steps: StepCounts, device: torch.device,
                   warm: bool = False) -> bool:
    """`train.compile`; auto: packed rows (one shape) on a GPU, for a run long enough to pay the compilation back:
    less long where the compile cache is `warm` and the row is the config's own; and every `train.deterministic`
    one, since a compiled run repeats itself bit for bit and keeps no L x L attention weights (`uncompiled_attention`).
    ZeRO-3 too: compiled, it ran 1.6x its uncompiled rate on the 8B shape (4 x H200, 10,608 tokens/s a GPU against
    6,680; first step 19 s cold: bench/results/scaling_4gpu_h200_2026-11-28)."""
    if train.compile != "auto":
        return train.compile
    if device.type != "cuda" or row_tokens is None:
        return False
    if train.deterministic:
        return True
    pays_off = COMPILE_PAYS_OFF_WARM_TOKENS if warm and isinstance(train.pack_tokens, int) else COMPILE_PAYS_OFF_TOKENS
    return run_positions(steps, train, row_tokens) >= pays_off


def run_positions(steps: StepCounts, train: TrainConfig, row_tokens: int) -> int:
    """Token positions of a worker's whole run in packed rows of `row_tokens` (padding included: rows are ~full);
    not `clozemath.train.budget.planned_tokens`, the training tokens of a run's epochs."""
    return steps.total_steps * train.grad_accum * row_tokens


def layout_line(layout: Layout, train: TrainConfig) -> str:
    """What the steps will be, said before the first: a compiled first step is silent for a while on a cold cache."""
    steps, row_tokens = layout.steps, layout.row_tokens
    rows = (f"packed rows of {row_tokens:,} tokens" if row_tokens is not None
            else f"micro-batches of {train.micro_batch_size}")
    text = f"{steps.total_steps:,} steps of {train.grad_accum} {rows}"
    if layout.compiled and layout.warm:
        return text + "; compiled, from the compile cache that a run of this shape filled (seconds)"
    if layout.compiled:
        return text + "; the first step compiles the decoder layers (15-30 s on a cold cache)"
    if row_tokens is not None and train.compile == "auto":
        tokens = run_positions(steps, train, row_tokens)
        return text + (f", not compiled ({tokens / 1e6:.1f}M tokens; compiling pays back past "
                       f"{COMPILE_PAYS_OFF_TOKENS / 1e6:.0f}M: train.compile=true forces it)")
    return text
