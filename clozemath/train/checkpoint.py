"""Checkpoints of a training run: the engine state with the step and the data position (exact resume), and the
trained adapter in the last one; each rank's part marked complete (its files' sizes and hashes), so that a resume
tells a whole checkpoint from one a crash, a full disk or a stray write damaged; written beside their place and
renamed into it whole (`write_checkpoint_whole`), so that a failed write leaves no checkpoint at all."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

from clozemath.data.tokenize import SpecialTokens
from clozemath.errors import ClozeMathError
from clozemath.files import remove_abandoned_staging, staging_folder, write_text_atomic
from clozemath.train.distributed import all_ranks_reduce, from_rank_zero, world_rank
from clozemath.train.layout import StepCounts

CHECKPOINT_TAG = "state"
"""DeepSpeed's tag (sub-folder) for the engine state inside a checkpoint folder."""


def save_checkpoint(engine: Any, folder: Path, step: int, steps: StepCounts, next_micro_batch: int) -> None:
    """Engine state (trainable weights, optimizer partitions, schedule), the step and the data position (the next
    micro-batch of the stream); every rank writes its part, frozen base weights are left out."""
    state = {"step": step, "total_steps": steps.total_steps, "next_micro_batch": next_micro_batch}
    engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state=state, exclude_frozen_parameters=True)


def load_checkpoint(engine: Any, folder: Path, steps: StepCounts) -> tuple[int, int]:
    """Restore the engine from `folder`; returns the step it was taken at and the next micro-batch to read."""
    path, client_state = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=False)
    if path is None:
        raise ClozeMathError(f"{folder}: no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in it")
    if client_state["total_steps"] != steps.total_steps:
        raise ClozeMathError(
            f"{folder}: checkpoint planned {client_state['total_steps']} steps, this run plans {steps.total_steps}"
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
    from clozemath.model.load import save_adapter  # peft: the training workers', not their controller's (~5 s)

    with full_trainable_parameters(engine):
        if dist.get_rank() == 0:
            save_adapter(engine.module.model, folder, specials)
    if dist.get_world_size() > 1:
        dist.barrier()


STEPS_FILE = "steps.json"
"""In a checkpoint: the metrics of each of the run's steps up to it, so that a resume logs the ones its tracking
store missed (a driver killed between a checkpoint's write and the logging of its steps)."""


def save_step_history(folder: Path, history: list[dict[str, Any]]) -> None:
    """The metrics of steps 1 to the checkpoint's, one dict a step (rank 0's, as the tracking store logs them)."""
    write_text_atomic(folder / STEPS_FILE, json.dumps(history) + "\n")


def load_step_history(folder: Path) -> list[dict[str, Any]]:
    """The step metrics saved in the checkpoint in `folder` (none in checkpoints from before they were saved)."""
    file = folder / STEPS_FILE
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else []


MARK_PREFIX = "complete.rank"
"""`complete.rank<k>.json` in a checkpoint: rank k's part is whole (written last, after its files)."""


def _digest(file: Path) -> str:
    with file.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def mark_complete(folder: Path, rank: int, world_size: int, step: int, total_steps: int | None = None,
                  trained_tokens: int | None = None) -> None:
    """Mark this rank's part of the checkpoint in `folder` whole: the size and hash of each file it wrote there
    (the other ranks' marks left out), the step and how many ranks wrote parts; the run's planned steps and the
    tokens trained so far, so that a trial whose training had ended reports them without training again."""
    files = {str(path.relative_to(folder)): [path.stat().st_size, _digest(path)]
             for path in sorted(folder.rglob("*")) if path.is_file() and not path.name.startswith(MARK_PREFIX)}
    mark = {"rank": rank, "world_size": world_size, "step": step, "files": files, "total_steps": total_steps,
            "trained_tokens": trained_tokens}
    write_text_atomic(folder / f"{MARK_PREFIX}{rank}.json", json.dumps(mark, indent=1, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Checked:
    """A checkpoint as `check_checkpoint` found it."""

    folder: Path
    step: int | None
    """The step it was taken at (None where its marks cannot say)."""
    problem: str | None
    """Why it cannot be resumed from; None: it is whole."""
    total_steps: int | None = None
    trained_tokens: int | None = None
    """The run's planned steps and the real tokens of its steps 1 to `step`, as its marks say (None in marks from
    before they recorded them)."""


def _read_mark(file: Path) -> dict | None:
    try:
        mark = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    valid = isinstance(mark, dict) and isinstance(mark.get("files"), dict) and all(
        isinstance(mark.get(key), int) for key in ("rank", "world_size", "step"))
    return mark if valid else None


def _file_problem(folder: Path, name: str, expected: object) -> str | None:
    """What is wrong with one file of a checkpoint against its mark (`[size, sha256]`), or None."""
    file = folder / name
    if not isinstance(expected, list) or len(expected) != 2:
        return f"its mark of {name} is damaged"
    size, digest = expected
    if not file.is_file():
        return f"{name} is missing"
    actual = file.stat().st_size
    if actual != size:
        return f"{name} holds {actual:,} of its {size:,} bytes"
    if _digest(file) != digest:
        return f"{name} is not the file written (its bytes changed)"
    return None


def check_checkpoint(folder: Path) -> Checked:
    """Whether the checkpoint in `folder` is whole: every rank's mark there, and every file as its mark says."""
    if not folder.is_dir():
        return Checked(folder, None, "it is gone")
    marks = [_read_mark(file) for file in sorted(folder.glob(f"{MARK_PREFIX}*.json"))]
    if not marks:
        return Checked(folder, None, "no mark of completeness: its write did not finish")
    if any(mark is None for mark in marks):
        return Checked(folder, None, "a mark of completeness is damaged")
    step, world_size = marks[0]["step"], marks[0]["world_size"]
    ranks = {mark["rank"] for mark in marks}
    missing = sorted(set(range(world_size)) - ranks)
    if missing or any(mark["step"] != step for mark in marks):
        return Checked(folder, step, f"rank {missing[0] if missing else '?'}'s part did not finish")
    for mark in marks:
        for name, expected in mark["files"].items():
            problem = _file_problem(folder, name, expected)
            if problem is not None:
                return Checked(folder, step, problem)
    counts = [marks[0].get(key) for key in ("total_steps", "trained_tokens")]
    return Checked(folder, step, None, *(count if isinstance(count, int) else None for count in counts))


def write_checkpoint_whole(part: Path, target: Path, device: torch.device) -> None:
    """Every rank's part of a checkpoint (`part`: its files and its mark) into `target`, which appears whole or not
    at all: the parts are copied into a staging folder beside `target` (rank 0's `staging_folder`), which rank 0
    renames to `target` once every rank's copy succeeded. A failed copy (a full disk) leaves no `target` and no
    staging folder, so that a resume takes the checkpoint before it; one killed midway leaves a staging folder under
    a dot name, which no resume reads and the next write removes. One line (`ClozeMathError`) on every rank names
    the folder, the fault and what was kept."""
    rank = world_rank()
    try:
        if rank == 0:
            remove_abandoned_staging(target.parent)  # what a write killed midway left
        with staging_folder(target) if rank == 0 else nullcontext() as made:
            staging = from_rank_zero(made, device)
            fault = None
            try:
                _copy_files(part, staging)
            except OSError as exc:
                fault = exc
            failed = all_ranks_reduce(rank + 1 if fault is not None else 0, dist.ReduceOp.MAX, device) - 1
            if fault is not None:
                raise fault
            if failed >= 0:
                raise _not_written(target, f"rank {failed}'s part failed")
            if rank == 0:
                os.rename(staging, target)
    except OSError as exc:  # the staging folder not made, a part not copied, the rename refused
        raise _not_written(target, exc.strerror or str(exc)) from None
    all_ranks_reduce(0, dist.ReduceOp.MAX, device)  # no rank reports the checkpoint before it is in place


def _not_written(target: Path, cause: str) -> ClozeMathError:
    return ClozeMathError(f"{target.parent}: the checkpoint {target.name} was not written ({cause}); the checkpoints "
                          "before it are kept whole, and a resume starts from the newest")


def _copy_files(source: Path, target: Path) -> None:
    """Copy the files under `source` into the folder `target`, beside what other ranks copied there; the first
    fault raised as it is (`shutil.copytree` gathers them into one `shutil.Error` without the fault's errno)."""
    for file in sorted(path for path in source.rglob("*") if path.is_file()):
        copy = target / file.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, copy)
