"""One training worker's loop on a DeepSpeed engine: ZeRO-2/3 LoRA fine-tuning, checkpoints, exact resume.

Ray-free: the caller hands in the worker's tokenized rows and a `report` callback that receives the metrics of
every optimizer step and, every `checkpoint_every` steps and at the last one, a folder holding a checkpoint; what
it does with them (print, `ray.train.report`, copy) is its business. Every rank calls `report` the same number
of times. The last checkpoint also holds the trained adapter in `adapter/` (written by rank 0), so that a run's
final checkpoint is its result.

Resuming is exact. The data order is a pure function of (seed, epoch, rank, the rows): a seeded permutation per epoch
(laid into packed rows, `clozemath.train.packing`, or cut into padded micro-batches), read as an endless stream of
micro-batches (`clozemath.train.batches`); everything random within a step (dropout, MFT noise) is drawn after
seeding with (seed, step, rank). With `train.deterministic`, torch's deterministic kernels make a run repeat itself
(`clozemath.train.determinism`). A checkpoint holds the engine state (trainable weights, optimizer partitions,
schedule), the step and the data position (the next micro-batch); a resumed run redoes no step and ends at the
planned number of optimizer steps whatever happened on the way (`clozemath.train.checkpoint`).

The run's shape (row width, compilation, steps) is planned in `clozemath.train.layout`, a step's forward, loss,
backward and optimizer live in `clozemath.train.step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clozemath import console
from clozemath.config import ExperimentConfig
from clozemath.data.tokenize import MASK, SpecialTokens
from clozemath.errors import ClozeMathError
from clozemath.records import ADAPTER_DIR, train_metric
from clozemath.train.batches import micro_batch, micro_batch_rows, model_inputs, noised, step_seed, tokens_before
from clozemath.train.checkpoint import checkpoint_folder, export_adapter, load_checkpoint, save_checkpoint
from clozemath.train.compilation import compile_decoder_layers, compiled_shape_key, mark_compiled
from clozemath.train.determinism import deterministic_kernels, seed_everything
from clozemath.train.divergence import DivergenceWatch
from clozemath.train.distributed import all_ranks_reduce, all_ranks_sum, init_distributed
from clozemath.train.flops import TrainingShape, peak_flops, sample_flops
from clozemath.train.layout import Layout, layout_line, resolved_zero_stage, training_layout
from clozemath.train.step import StepTally, accumulate, build_engine


class InjectedFailure(RuntimeError):
    """Raised by the `train.fail_at_step` test hook."""


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, averaged over its micro-batches and over all ranks."""

    step: int
    total_steps: int
    epoch: float
    loss: float
    lr: float
    tokens: int
    """Real (non-padding) tokens of all ranks in this step."""
    trained_tokens: int
    """Real tokens of all ranks in steps 1 to `step`: what the run has trained on so far (a resumed run counts the
    steps before its checkpoint too)."""
    tokens_per_s: float
    """Real (non-padding) tokens of all ranks per second of this step."""
    pad_share: float
    """Share of the batch positions that are padding."""
    seconds: float
    """Wall time of this step on rank 0 (the first: compiling included, on a cold cache minutes)."""
    peak_memory_gib: float
    """The most GPU memory any rank's tensors held so far (torch's allocator; 0 on CPU)."""
    mfu: float | None
    """Model FLOPs utilisation of this step, per GPU, by `clozemath.train.flops.MFU_CONVENTION` (the FLOPs of the
    step's real tokens of all ranks, over its wall time and the cards' bf16 peak); None on a card whose peak is not
    listed (`PEAK_BF16_FLOPS`) or a CPU."""
    grad_norm: float | None
    """The global norm of this step's gradients over all ranks, before clipping (DeepSpeed's); None where the engine
    gives none."""

    def as_dict(self) -> dict[str, float | int]:
        values = asdict(self)
        return {
            "step": values.pop("step"),
            "total_steps": values.pop("total_steps"),
            **{train_metric(name): value for name, value in values.items() if value is not None},
        }


Report = Callable[[StepMetrics, Path | None], None]
"""Called after every optimizer step; the folder (or None) holds a checkpoint valid for the call's duration."""


def train(
    model: torch.nn.Module,
    rows: Sequence[Mapping[str, Any]],
    config: ExperimentConfig,
    *,
    specials: SpecialTokens,
    pad_id: int,
    report: Report,
    resume_from: Path | None = None,
    scratch_dir: Path | None = None,
    compile_cache: Path | None = None,
) -> Any:
    """Fine-tune `model` (peft, trainable parameters already chosen) on this worker's `rows` (input_ids, labels,
    prefix_len); return the DeepSpeed engine. `resume_from`: a checkpoint folder `report` was given earlier.
    Checkpoints are written under `scratch_dir` (default: the system's temp folder) and removed after `report`.
    `compile_cache`: the folder this process compiles into (`use_compile_cache`), where `compile: auto` looks for a
    compiled step of this run's shape and marks its own after the first step.
    `train.zero_stage: auto` is resolved here (`clozemath.train.layout.resolved_zero_stage`) unless the caller did
    (a Ray worker, once: its evaluation during training decodes by the stage)."""
    with deterministic_kernels(config.train.deterministic):
        device = next(model.parameters()).device
        if device.type == "cpu" and model.config._attn_implementation == "flex_attention":
            raise ClozeMathError(
                "model.attn_implementation=flex_attention cannot train on CPU (no backward there): use sdpa"
            )
        init_distributed(device)
        if config.train.zero_stage == "auto":
            config = resolved_zero_stage(config, model, device)
        rank = dist.get_rank()
        seed_everything(config.train.seed)
        lengths = [len(row["input_ids"]) for row in rows]
        layout = training_layout(config, model, lengths, device, compile_cache)
        steps = layout.steps
        if layout.compiled:
            compile_decoder_layers(model, config.train.zero_stage)
        if rank == 0:
            console.phase(f"[{config.name}] training: {layout_line(layout, config.train)}")
        shape = TrainingShape.of(model)  # before the engine: ZeRO-3 leaves a partitioned weight with no elements
        row_flops = [sample_flops(shape, row, config.method.attention == "prefix_lm") for row in rows]
        engine = build_engine(model, config.train, steps.total_steps, steps.warmup_steps)
        step, next_micro_batch = load_checkpoint(engine, resume_from, steps) if resume_from is not None else (0, 0)
        order_seed = config.train.seed * 1009 + rank
        stream = micro_batch_rows(lengths, steps, config.train, layout.row_tokens, order_seed, next_micro_batch)
        worker = _Worker(engine, model, rows, config, layout, specials, pad_id, rank, device, stream, row_flops)
        if next_micro_batch:  # the tokens of the steps before the checkpoint: the stream is a function of the seed
            before = tokens_before(lengths, steps, config.train, layout.row_tokens, order_seed, next_micro_batch)
            worker.trained_tokens = int(all_ranks_sum([before], device)[0])
        # after the first step, rank 0 tells the compile cache that it holds this shape's compiled step
        # (`compile: auto`)
        unmarked = (compile_cache, compiled_shape_key(config, layout.row_tokens, device)) if (
            layout.compiled and layout.row_tokens is not None and compile_cache is not None and rank == 0) else None
        watch = DivergenceWatch(config.train.divergence_factor) if config.train.divergence_factor else None
        engine.train()
        while step < steps.total_steps:
            if config.train.fail_at_step == step + 1 and resume_from is None and rank == 0:
                raise InjectedFailure(f"train.fail_at_step={config.train.fail_at_step}: failing on purpose")
            metrics = worker.step(step)
            if unmarked is not None:
                mark_compiled(*unmarked)
                unmarked = None
            step += 1
            if watch is not None and rank == 0 and (diverged := watch.update(metrics.step, metrics.loss)):
                console.warn(f"[{config.name}] training {diverged.describe()}; the run goes on "
                             "(train.divergence_factor)")
            worker.report(metrics, report, scratch_dir)
        if watch is not None and rank == 0 and (outcome := watch.outcome()) is not None:
            console.warn(f"[{config.name}] training {outcome.ending()}")
        return engine


@dataclass
class _Worker:
    """One worker's run once planned: what every step reads."""

    engine: Any
    model: torch.nn.Module
    rows: Sequence[Mapping[str, Any]]
    config: ExperimentConfig
    layout: Layout
    specials: SpecialTokens
    pad_id: int
    rank: int
    device: torch.device
    stream: Iterator[list[int]]
    """Row indices of the micro-batches to come."""
    row_flops: Sequence[float]
    """Training FLOPs of each row (`clozemath.train.flops.sample_flops`), for the steps' MFU."""
    trained_tokens: int = 0
    """Real tokens of all ranks in the steps trained so far."""

    def __post_init__(self) -> None:
        self.noise_ids = torch.tensor(self.specials.ordinary_ids)
        self.mask_id = self.specials.ids[MASK]
        card_peak = peak_flops(self.device)  # all ranks' cards together, for the steps' MFU per GPU; None: unknown
        self.cards_peak_flops = card_peak * dist.get_world_size() if card_peak else None

    def step(self, step: int) -> StepMetrics:
        """Optimizer step `step + 1`, its metrics over all ranks."""
        started, lr = time.perf_counter(), self.engine.get_lr()[0]  # this step's (the schedule moves on)
        torch.manual_seed(step_seed(self.config.train.seed, step, self.rank))  # dropout: a function of the step
        packed = self.layout.row_tokens is not None
        taken: list[int] = []
        tally = accumulate(self.engine, self.micro_batches(step, taken), self.device,
                           lambda batch: model_inputs(batch, self.config, self.model, packed))
        return self.metrics(tally, sum(self.row_flops[i] for i in taken), step + 1, started, lr)

    def micro_batches(self, step: int, taken: list[int]) -> Iterator[dict[str, torch.Tensor]]:
        """The step's micro-batches on the host, made one at a time as the step takes them (so that MFT's noise and
        the forward's dropout are drawn in the same order on every run); their rows' indices go into `taken`."""
        for _ in range(self.config.train.grad_accum):
            indices = next(self.stream)
            taken.extend(indices)
            batch = micro_batch(self.rows, indices, self.layout.row_tokens, self.pad_id)
            yield noised(batch, self.config, step, self.layout.steps.total_steps, self.mask_id, self.noise_ids)

    def metrics(self, tally: StepTally, flops: float, step: int, started: float, lr: float) -> StepMetrics:
        """`flops`: the training FLOPs of this rank's rows in the step."""
        device, steps = self.device, self.layout.steps
        loss_sum, micro_batches, tokens, positions, flops = all_ranks_sum(
            [float(tally.loss), tally.micro_batches, tally.tokens, tally.positions, flops], device
        )
        self.trained_tokens += int(tokens)
        grad_norm = self.engine.get_global_grad_norm()  # the same on every rank
        seconds = time.perf_counter() - started
        peak = all_ranks_reduce(torch.cuda.max_memory_allocated(device), dist.ReduceOp.MAX, device) \
            if device.type == "cuda" else 0
        return StepMetrics(
            step=step,
            total_steps=steps.total_steps,
            epoch=step * self.config.train.grad_accum / steps.micro_batches_per_epoch,
            loss=loss_sum / micro_batches,
            lr=lr,
            tokens=int(tokens),
            trained_tokens=self.trained_tokens,
            tokens_per_s=tokens / seconds,
            pad_share=1.0 - tokens / positions,
            seconds=seconds,
            peak_memory_gib=peak / 2**30,
            mfu=flops / seconds / self.cards_peak_flops if self.cards_peak_flops else None,
            grad_norm=None if grad_norm is None else float(grad_norm),
        )

    def report(self, metrics: StepMetrics, report: Report, scratch_dir: Path | None) -> None:
        """Hand the step's metrics to `report`, with a checkpoint every `checkpoint_every` steps and at the last (which
        also holds the adapter)."""
        step, steps, train = metrics.step, self.layout.steps, self.config.train
        if step % train.checkpoint_every and step != steps.total_steps:
            report(metrics, None)
            return
        with checkpoint_folder(scratch_dir) as folder:
            save_checkpoint(self.engine, folder, step, steps, next_micro_batch=step * train.grad_accum)
            if step == steps.total_steps:
                export_adapter(self.engine, folder / ADAPTER_DIR, self.specials)
            report(metrics, folder)
