"""Checkpoints of a training run: the engine state with the step and the data position (exact resume), and the
trained adapter in the last one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch.distributed as dist

from clozemath.data.tokenize import SpecialTokens
from clozemath.errors import ClozeMathError
from clozemath.model.load import save_adapter
from clozemath.train.layout import Plan

CHECKPOINT_TAG = "state"
"""DeepSpeed's tag (sub-folder) for the engine state inside a checkpoint folder."""


def save_checkpoint(engine: Any, folder: Path, step: int, plan: Plan, next_micro_batch: int) -> None:
    """Engine state (trainable weights, optimizer partitions, schedule), the step and the data position (the next
    micro-batch of the stream); every rank writes its part, frozen base weights are left out."""
    state = {"step": step, "total_steps": plan.total_steps, "next_micro_batch": next_micro_batch}
    engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state=state, exclude_frozen_parameters=True)


def load_checkpoint(engine: Any, folder: Path, plan: Plan) -> tuple[int, int]:
    """Restore the engine from `folder`; returns the step it was taken at and the next micro-batch to read."""
    path, client_state = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=False)
    if path is None:
        raise ClozeMathError(f"{folder}: no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in it")
    if client_state["total_steps"] != plan.total_steps:
        raise ClozeMathError(
            f"{folder}: checkpoint planned {client_state['total_steps']} steps, this run plans {plan.total_steps}"
            " (data or train.* changed?)"
        )
    return int(client_state["step"]), int(client_state["next_micro_batch"])


@contextmanager
def checkpoint_folder(scratch_dir: Path | None) -> Iterator[Path]:
    """A folder for one checkpoint under `scratch_dir` (default: the system's temp folder), removed afterwards."""
    with TemporaryDirectory(prefix="clozemath-ckpt-", dir=scratch_dir) as folder:
        yield Path(folder)


@contextmanager
def full_trainable_parameters(engine: Any) -> Iterator[None]:
    """Under ZeRO-3, gather the trainable parameters (LoRA, special-token rows) on every rank for the duration."""
    if engine.zero_optimization_stage() != 3:
        yield
        return
    import deepspeed

    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None):
        yield


def export_adapter(engine: Any, folder: Path, specials: SpecialTokens) -> None:
    """Rank 0 writes the adapter (LoRA + special-token rows, safetensors) and the special-token map; under ZeRO-3
    every rank takes part in gathering the trainable parameters first."""
    with full_trainable_parameters(engine):
        if dist.get_rank() == 0:
            save_adapter(engine.module.model, folder, specials)
    if dist.get_world_size() > 1:
        dist.barrier()
