"""Training throughput: ours against what a researcher would run instead, same samples, same LoRA, same card, one
process.

Real (non-padding) tokens per second, MFU and peak GPU memory, LoRA rank 32 (alpha 64, every linear layer of the
decoder) with the trainable special-token rows our loader adds, on a Llama-3.2-1B-shaped random model (or any model
in configs/models; `--path` points it elsewhere, e.g. at the SmolLM2 GGUF). Modes:

- ours: `packed` (what `clozemath run` does on a GPU for ClozeMath: `clozemath.train.loop.train` on packed rows,
  PrefixLM FlexAttention document masks, compiled decoder layers (`--compile`, on by default as in a long run), the
  fused loss at target positions) and `packed-causal` (the same for IT: causal attention within each sample); one
  sample a row: `causal`, `prefix_lm-sdpa`, `prefix_lm-flex` (micro-batches of `--batch`).
- the baselines (`bench/trl_baseline.py` says how TRL is set up and why):
  `trl-flex`, `trl-sdpa`: TRL's `SFTTrainer`, padding-free packing, liger-kernel, bf16, its fused LM head at target
  positions, FlexAttention or sdpa; `trl-flex-compiled`: the same with `torch_compile=True`. TRL has no PrefixLM:
  it is the baseline of both of ours.
  `hf-causal`: the plain transformers + peft loop (the model's forward with `labels`: full logits, loss.backward(),
  fused AdamW), rows grouped by length into buckets (`--buckets`), each bucket's batches holding as many rows as make
  the step's real tokens (`--step-tokens`, by default ours': equal real tokens a step), padded to the bucket's width;
  `hf-causal-compiled`: the same loop under `torch.compile(dynamic=False)`: one fixed shape per bucket, each compiled
  in the warm-up steps.

Baselines that run out of memory halve their step (the plain loop's tokens, TRL's sequences) until they fit, as
their user would; the table says so. Every mode's settings stand beside its numbers; the ratios are against the
fastest baseline. Times are per optimizer step: `--steps` steps after `--warmup` (more for the compiled plain loop:
one per bucket), then one more step that is not timed (ours writes the run's checkpoint and adapter in its last
step); the first step's time (compilation included, loading the model not) is reported apart. MFU follows
`clozemath.train.flops` (`MFU_CONVENTION`, stated in the table).

The modes run ours' packed ones first (the baselines take their step's real tokens from them), TRL's last (see
`run_order`). A mode that breaks leaves its error in its row and the others run. `--keep` adds the modes of this
command to the table an earlier one wrote to the same `--out` (its numbers are kept in the `.json` beside it): on a
cold machine the compiled modes take minutes each to compile, so one table can come from a command per few modes.

    python bench/train_throughput.py --out bench/results/x.md --speed-json
    python bench/train_throughput.py --model tiny-llama --problems 20 --modes packed,hf-causal,trl-sdpa \\
        --steps 2 --warmup 1 --pack-tokens 512 --compile off   # a CPU smoke run

`--profile DIR` writes, per mode, the 30 costliest operations of 3 steps (torch.profiler) on the GPU and the 40 on the
host, how busy the GPU was, and a Chrome trace; `--lora-dropout`, `--no-special-rows` change the setup.

Needs torch, transformers, peft, deepspeed, this repository; trl 1.16.0 (and datasets) for the trl modes,
liger-kernel on a GPU (`pip install '.[bench]'`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, Literal

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.profiling import activities, profile_summary  # noqa: E402
from bench.speed_record import SPEED_JSON, Headline, Side, command_line, failure_note, record  # noqa: E402
from clozemath.config import DataConfig, ExperimentConfig, MethodConfig, ModelConfig, TrainConfig  # noqa: E402
from clozemath.data.prepare import prepare_data  # noqa: E402
from clozemath.data.tokenize import IGNORE_INDEX, collate_packs  # noqa: E402
from clozemath.errors import ClozeMathError  # noqa: E402
from clozemath.files import write_text_atomic  # noqa: E402
from clozemath.model.attention import flex_kernel_options, head_dim  # noqa: E402
from clozemath.model.load import aligned_vocabulary, load_model  # noqa: E402
from clozemath.model.tokenizer import load_tokenizer  # noqa: E402
from clozemath.safe_yaml import read_yaml  # noqa: E402
from clozemath.train.batches import model_inputs  # noqa: E402
from clozemath.train.flops import (  # noqa: E402
    MFU_CONVENTION, PEAK_BF16_FLOPS, TrainingShape, Work, card_value, flops_per_token, mfu,
)
from clozemath.train.loop import StepMetrics, train  # noqa: E402

LORA = {"rank": 32, "alpha": 64, "target_modules": "all-linear"}


@dataclass(frozen=True)
class Mode:
    name: str
    runner: Literal["ours", "trl", "plain"]
    attention: Literal["causal", "prefix_lm"]
    implementation: Literal["sdpa", "flex_attention", "auto"] = "auto"
    compiled: bool = False
    packed: bool = False

    @property
    def baseline(self) -> bool:
        return self.runner != "ours"

    @property
    def needs_cuda(self) -> bool:
        """FlexAttention has no backward on CPU."""
        return self.implementation == "flex_attention"


MODES = {mode.name: mode for mode in (
    Mode("packed", "ours", "prefix_lm", packed=True),
    Mode("packed-causal", "ours", "causal", packed=True),
    Mode("trl-flex", "trl", "causal", "flex_attention"),
    Mode("trl-flex-compiled", "trl", "causal", "flex_attention", compiled=True),
    Mode("trl-sdpa", "trl", "causal", "sdpa"),
    Mode("hf-causal", "plain", "causal", "sdpa"),
    Mode("hf-causal-compiled", "plain", "causal", "sdpa", compiled=True),
    Mode("causal", "ours", "causal", "sdpa"),
    Mode("prefix_lm-sdpa", "ours", "prefix_lm", "sdpa"),
    Mode("prefix_lm-flex", "ours", "prefix_lm", "flex_attention"),
)}
DEFAULT_MODES = ("packed", "packed-causal", "trl-flex", "trl-sdpa", "trl-flex-compiled", "hf-causal",
                 "hf-causal-compiled")
DEFAULT_BUCKETS = (128, 192, 256, 512)
FALLBACK_STEP_TOKENS = 8192
"""Baselines' real tokens a step when no packed mode ran first and `--pack-tokens` is auto."""


# --------------------------------------------------------------------------------------------------------------
# Samples


def synthetic_rows(count: int, seq: int, prefix_share: float, seed: int = 0) -> list[dict[str, Any]]:
    """Random ordinary tokens (ids 1000-29999 exist in every tokenizer we use) split into prefix and target."""
    generator = torch.Generator().manual_seed(seed)
    prefix_len = max(1, round(seq * prefix_share))
    rows = []
    for _ in range(count):
        ids = torch.randint(1000, 30_000, (seq,), generator=generator).tolist()
        labels = [IGNORE_INDEX] * prefix_len + ids[prefix_len:]
        rows.append({"input_ids": ids, "labels": labels, "prefix_len": prefix_len})
    return rows


def real_rows(model: ModelConfig, problems: int) -> tuple[list[dict[str, Any]], int]:
    """ClozeMath's GSM8K training samples of the first `problems` problems, tokenized as a run tokenizes them; and
    how many sentinels they use."""
    config = ExperimentConfig(
        name="bench-data", model=model, method=MethodConfig(name="clozemath", objectives=["lm", "cloze"],
                                                            attention="prefix_lm"),
        data=DataConfig(dataset="gsm8k", split="train", max_length=512),
    )
    prepared = prepare_data(config, limit=problems)
    rows = [row for row in prepared.encoded if row is not None]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    return [rows[i] for i in order], len(prepared.specials.ids) - 3


@dataclass(frozen=True)
class Bucketed:
    """One batch of the plain loop: row indices, padded to `width`."""

    indices: list[int]
    width: int


def bucket_batches(lengths: Sequence[int], widths: Sequence[int], step_tokens: int, seed: int = 0) -> list[Bucketed]:
    """Rows grouped by length: a bucket holds the rows longer than the previous width and at most its own; its batches
    hold as many rows as make `step_tokens` real tokens at the bucket's mean length (all its rows when fewer), padded
    to the bucket's width, so each bucket has one shape. Within a bucket the rows are shuffled (the last partial batch
    dropped); the batches come in a seeded random order, the first of every bucket first (a compiled loop meets every
    shape in its warm-up)."""
    widths = sorted(widths)
    longest = max(lengths, default=0)
    if longest > widths[-1]:
        raise ClozeMathError(f"a sample of {longest} tokens is longer than the widest bucket ({widths[-1]}): add a "
                             "wider one to --buckets")
    generator = random.Random(seed)
    firsts: list[Bucketed] = []
    rest: list[Bucketed] = []
    lower = 0
    for width in widths:
        members = [i for i, n in enumerate(lengths) if lower < n <= width]
        lower = width
        if not members:
            continue
        generator.shuffle(members)
        mean = sum(lengths[i] for i in members) / len(members)
        size = min(len(members), max(1, round(step_tokens / mean)))
        batches = [Bucketed(members[k : k + size], width) for k in range(0, len(members) - size + 1, size)]
        firsts.append(batches[0])
        rest.extend(batches[1:])
    generator.shuffle(rest)
    return firsts + rest


# --------------------------------------------------------------------------------------------------------------
# Timing


class StepClock:
    """Each optimizer step's wall time and real tokens, from `start()` (training begins: loading the model is not
    counted) to every `tick` (the GPU synchronized by the caller)."""

    def __init__(self, on_tick: Callable[[], None] | None = None):
        self.on_tick = on_tick
        self.reset()

    def reset(self) -> None:
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.start()

    def start(self) -> None:
        self.last = time.perf_counter()

    def tick(self, real_tokens: int) -> None:
        """`on_tick`'s own time (the profiler starting, or stopping and collecting its events) is no step's: charged to
        the next step, it made the first after the profiled ones 2-2.5x the others (H200,
        scaling_4gpu_h200_2026-11-28)."""
        self.seconds.append(time.perf_counter() - self.last)
        self.tokens.append(real_tokens)
        if self.on_tick is not None:
            self.on_tick()
        self.last = time.perf_counter()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Ran:
    """What a runner tells about its run."""

    shape: TrainingShape
    settings: str
    targets_only: bool
    """Its loss projects onto the vocabulary at target positions only."""
    warmup: int
    """Steps before the timed ones."""


@dataclass(frozen=True)
class Context:
    rows: list[dict[str, Any]]
    sentinels: int
    device: torch.device
    model: ModelConfig
    args: argparse.Namespace
    step_tokens: int
    """The baselines' real tokens a step (before any halving)."""


# --------------------------------------------------------------------------------------------------------------
# Ours


def experiment(model: ModelConfig, mode: Mode, args: argparse.Namespace) -> ExperimentConfig:
    packing: dict[str, Any] = {"pack_tokens": args.pack_tokens, "compile": args.compile} if mode.packed else {
        "pack_tokens": None}
    implementation = mode.implementation
    return ExperimentConfig(
        name=f"bench-{mode.name}",
        model=model if implementation == "auto" else model.model_copy(update={"attn_implementation": implementation}),
        method=MethodConfig(name=mode.name, attention=mode.attention),
        train=TrainConfig(
            micro_batch_size=args.batch, max_steps=args.warmup + args.steps + 1, checkpoint_every=10**9,
            group_by_length=False, zero_stage=args.zero_stage, lr=5e-5, fused_loss=args.fused_loss, **packing,
        ),
    )


def run_ours(mode: Mode, context: Context, clock: StepClock) -> Ran:
    """`clozemath.train.loop.train` (its last step writes the run's checkpoint and adapter before it reports: that
    step is run but not timed)."""
    config = experiment(context.model, mode, context.args)
    loaded = load_model(config.model, num_sentinels=context.sentinels, device=context.device)

    def report(metrics: StepMetrics, _checkpoint: Path | None) -> None:
        synchronize(context.device)
        clock.tick(metrics.tokens)

    clock.start()
    train(loaded.model, context.rows, config, specials=loaded.specials, pad_id=loaded.tokenizer.pad_token_id,
          report=report)
    train_cfg = config.train
    rows = (f"packed rows of train.pack_tokens={train_cfg.pack_tokens}" if mode.packed
            else f"micro-batches of {train_cfg.micro_batch_size} samples padded to the longest")
    settings = (f"ours: {mode.attention}, {rows}, train.compile={train_cfg.compile}, "
                f"train.fused_loss={train_cfg.fused_loss}, ZeRO-{train_cfg.zero_stage}, loss at target positions")
    return Ran(TrainingShape.of(loaded.model), settings, targets_only=True, warmup=context.args.warmup)


# --------------------------------------------------------------------------------------------------------------
# TRL


def run_trl(mode: Mode, context: Context, clock: StepClock) -> Ran:
    """TRL's SFTTrainer (`bench/trl_baseline.py`); out of memory, it retries with half the sequences a step."""
    from transformers.utils import is_triton_available

    from bench.trl_baseline import TrlSettings, build_trainer

    args, device = context.args, context.device
    cfg = context.model.model_copy(update={"attn_implementation": mode.implementation})
    first_batch = batch = args.trl_batch or max(1, round(context.step_tokens / args.trl_max_length))
    note = ""
    while True:
        loaded = load_model(cfg, num_sentinels=context.sentinels, device=device)
        dtype = next(loaded.model.parameters()).dtype
        tiles = (flex_kernel_options(head_dim(loaded.model.config), dtype, device)
                 if mode.implementation == "flex_attention" else None)
        on_gpu = device.type == "cuda" and is_triton_available()
        settings = TrlSettings(mode.implementation, mode.compiled, batch, args.trl_max_length, on_gpu=on_gpu,
                               liger=on_gpu, flex_tiles=tiles)
        with TemporaryDirectory(prefix="bench-trl-") as output_dir:
            trainer = build_trainer(loaded.model, loaded.tokenizer, context.rows, settings,
                                    args.warmup + args.steps + 1, output_dir, clock.start, clock.tick)
            try:
                trainer.train()
                break
            except torch.OutOfMemoryError:
                if batch == 1:
                    raise
        del trainer, loaded  # out of the except block: its traceback no longer holds the step's tensors
        free_memory(device)
        batch //= 2
        note = f" (halved from {first_batch} after OOM)"
        clock.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    # TRL 1.16's fused LM head gathers the target positions on a Triton device, and projects every position elsewhere
    return Ran(TrainingShape.of(loaded.model), settings.describe() + note, settings.on_gpu, warmup=args.warmup)


# --------------------------------------------------------------------------------------------------------------
# The plain loop


def run_plain(mode: Mode, context: Context, clock: StepClock) -> Ran:
    """`model(input_ids, attention_mask, labels).loss` (full logits), backward, gradient clipping, fused AdamW, on
    `bucket_batches`; out of memory, it retries with half the real tokens a step."""
    args, device, rows = context.args, context.device, context.rows
    cfg = context.model.model_copy(update={"attn_implementation": mode.implementation})
    loaded = load_model(cfg, num_sentinels=context.sentinels, device=device)
    config = experiment(context.model, mode, args)
    model = torch.compile(loaded.model, dynamic=False) if mode.compiled else loaded.model
    trainable = [p for p in loaded.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-5, fused=device.type == "cuda")
    pad_id = loaded.tokenizer.pad_token_id
    lengths = [len(row["input_ids"]) for row in rows]
    step_tokens, note = context.step_tokens, ""
    while True:
        batches = bucket_batches(lengths, args.buckets, step_tokens)
        shapes = len({batch.width for batch in batches})
        warmup = max(args.warmup, shapes) if mode.compiled else args.warmup
        if mode.compiled and shapes > torch._dynamo.config.recompile_limit:
            torch._dynamo.config.recompile_limit = shapes
        clock.start()
        try:
            for step in range(warmup + args.steps + 1):
                batch = batches[step % len(batches)]
                samples = [rows[i] for i in batch.indices]
                tensors = collate_packs([[sample] for sample in samples], pad_id, width=batch.width)
                inputs = model_inputs({k: v.to(device) for k, v in tensors.items()}, config, loaded.model, packed=False)
                model(**inputs).loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                synchronize(device)
                clock.tick(sum(len(sample["input_ids"]) for sample in samples))
            break
        except torch.OutOfMemoryError:
            if step_tokens <= max(lengths):
                raise
        optimizer.zero_grad(set_to_none=True)
        free_memory(device)
        note = f" (halved from {context.step_tokens:,} after OOM)"
        step_tokens //= 2
        clock.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    settings = (f"plain transformers + peft loop{', torch.compile(dynamic=False)' if mode.compiled else ', eager'}, "
                f"full logits, {mode.implementation}, rows bucketed by length ({'/'.join(map(str, args.buckets))}), "
                f"~{step_tokens:,} real tokens a step{note}, padded to the bucket, fused AdamW")
    return Ran(TrainingShape.of(loaded.model), settings, targets_only=False, warmup=warmup)


RUNNERS: dict[str, Callable[[Mode, Context, StepClock], Ran]] = {"ours": run_ours, "trl": run_trl, "plain": run_plain}


# --------------------------------------------------------------------------------------------------------------
# Measuring


PROFILED_STEPS = 3


def profiler(warmup: int, device: torch.device) -> torch.profiler.profile:
    schedule = torch.profiler.schedule(wait=warmup, warmup=1, active=PROFILED_STEPS, repeat=1)
    return torch.profiler.profile(activities=activities(device), schedule=schedule)


def measure(mode: Mode, context: Context, work: Work, profile_dir: Path | None) -> dict[str, Any]:
    device, args = context.device, context.args
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prof = profiler(args.warmup, device) if profile_dir else None
    clock = StepClock(prof.step if prof is not None else None)
    with prof if prof is not None else nullcontext():
        ran = RUNNERS[mode.runner](mode, context, clock)
    first = ran.warmup if prof is None else ran.warmup + 1 + PROFILED_STEPS
    # the last step is not timed: ours writes the run's checkpoint and adapter in it (0.6-0.8 s for the 1B shape)
    timed = clock.seconds[first:-1] or clock.seconds[ran.warmup:-1]
    counted = clock.tokens[first:-1] or clock.tokens[ran.warmup:-1]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    per_step = sum(timed) / len(timed)
    if prof is not None:
        assert profile_dir is not None
        (profile_dir / f"{mode.name}.txt").write_text(profile_summary(prof, 1000 * per_step, device, PROFILED_STEPS))
        prof.export_chrome_trace(str(profile_dir / f"{mode.name}.trace.json"))
    free_memory(device)
    return {
        "settings": ran.settings,
        "tokens_per_s": sum(counted) / sum(timed), "ms_per_step": 1000 * per_step,
        "tokens_per_step": sum(counted) / len(counted), "first_step_s": clock.seconds[0], "peak_gib": peak,
        "flops_per_token": flops_per_token(ran.shape, work, ran.targets_only, mode.attention == "prefix_lm"),
        "ms_per_step_min_median_max": [round(1000 * f(timed), 1) for f in (min, statistics.median, max)],
        "ms_per_timed_step": [round(1000 * s, 1) for s in timed],  # where the one-off slow steps fall
    }


def fastest_baseline(results: dict[str, dict[str, Any]]) -> str | None:
    baselines = [name for name in results if MODES[name].baseline and "failed" not in results[name]]
    return max(baselines, key=lambda name: results[name]["tokens_per_s"], default=None)


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace, device_name: str, model: ModelConfig,
          rows_described: str) -> str:
    best = fastest_baseline(results)
    base = results[best]["tokens_per_s"] if best else None
    peak = card_value(PEAK_BF16_FLOPS, device_name)
    lines = [
        f"Training throughput on {device_name}: {args.model}, LoRA rank {LORA['rank']} alpha {LORA['alpha']} on every "
        f"linear layer (dropout {model.lora.dropout}{'' if args.no_special_rows else ', + the special-token rows'}), "
        f"{rows_described}; mean of {args.steps} steps after the warm-up; tokens are real (non-padding) tokens. "
        f"Ratios against the fastest baseline ({best or 'none run'}). TRL has no PrefixLM attention: its causal runs "
        "are the baseline of both of ours (PrefixLM ClozeMath, causal IT).",
        "",
        f"{MFU_CONVENTION}.",
        "",
        "| mode | settings | tokens/s | MFU | GFLOP/token | tokens/step | ms/step (min / median / max) | first step s "
        "| peak GiB | vs fastest baseline |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, values in results.items():
        if "failed" in values:
            lines.append(f"| {name} | failed: {values['failed']} |" + " - |" * 8)
            continue
        ratio = f"{values['tokens_per_s'] / base:.2f}x" if base else "n/a"
        share = f"{mfu(values['tokens_per_s'], values['flops_per_token'], peak):.1%}" if peak else "n/a"
        fastest, median, slowest = values["ms_per_step_min_median_max"]
        lines.append(
            f"| {name} | {values['settings']} | {values['tokens_per_s']:,.0f} | {share} | "
            f"{values['flops_per_token'] / 1e9:.2f} | {values['tokens_per_step']:,.0f} | {values['ms_per_step']:.1f} "
            f"({fastest} / {median} / {slowest}) | {values['first_step_s']:.1f} | {values['peak_gib']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def headlines(results: dict[str, dict[str, Any]], model_name: str, device_name: str) -> list[Headline]:
    """Each packed mode of ours against the fastest baseline; the command(s) that measured the two."""
    best = fastest_baseline(results)
    if best is None:
        return []
    peak = card_value(PEAK_BF16_FLOPS, device_name)

    def side(name: str) -> Side:
        values = results[name]
        extra = {"peak_gib": round(values["peak_gib"], 2)}
        if peak:
            extra["mfu"] = round(mfu(values["tokens_per_s"], values["flops_per_token"], peak), 4)
        return Side(name, values["settings"], round(values["tokens_per_s"], 1), "real tokens/s", extra)

    claims = {"packed": "training ClozeMath (PrefixLM, packed) against the fastest baseline",
              "packed-causal": "training IT (causal, packed) against the fastest baseline"}
    found = []
    for name, claim in claims.items():
        if name in results and "failed" not in results[name]:
            commands = dict.fromkeys([results[name]["command"], results[best]["command"]])
            found.append(Headline(claim, model_name, device_name, side(name), side(best), " && ".join(commands)))
    return found


# --------------------------------------------------------------------------------------------------------------
# The command


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b-random",
                        help="a name in configs/models (default: %(default)s)")
    parser.add_argument("--path", help="override the model config's path (e.g. a folder holding the SmolLM2 GGUF)")
    parser.add_argument("--data", choices=("synthetic", "gsm8k"), default="gsm8k", help="(default: %(default)s)")
    parser.add_argument("--problems", type=int, default=2000, help="--data gsm8k: problems (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8,
                        help="ours, one sample a row: samples a micro-batch (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=512, help="--data synthetic: tokens a sample")
    parser.add_argument("--prefix-share", type=float, default=0.66, help="--data synthetic: the prefix's share")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="(default: %(default)s)")
    parser.add_argument("--pack-tokens", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="ours packed: train.pack_tokens (default: %(default)s)")
    parser.add_argument("--compile", type=lambda v: v if v == "auto" else v == "on", default=True,
                        help="ours packed: train.compile: auto, on or off (default: on, what a long run does; a bench "
                        "run is too short for auto to compile)")
    parser.add_argument("--fused-loss", type=lambda v: v if v == "auto" else v == "on", default="auto",
                        help="ours: train.fused_loss: auto, on or off (default: %(default)s)")
    parser.add_argument("--step-tokens", type=int,
                        help="the baselines' real tokens a step (default: the first packed mode's measured tokens a "
                        f"step, else --pack-tokens, else {FALLBACK_STEP_TOKENS})")
    parser.add_argument("--buckets", type=lambda v: sorted(int(x) for x in v.split(",")), default=list(DEFAULT_BUCKETS),
                        help="the plain loop's bucket widths (default: %(default)s)")
    parser.add_argument("--trl-max-length", type=int, default=1024,
                        help="TRL: tokens of a packed sequence (default: %(default)s, TRL's own)")
    parser.add_argument("--trl-batch", type=int,
                        help="TRL: packed sequences a step (default: the step tokens / --trl-max-length)")
    parser.add_argument("--no-cudnn-sdpa", action="store_true",
                        help="keep sdpa off cuDNN (which builds a new plan for every new shape)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--out", help="also write the markdown table to this file (and its numbers beside it, .json)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the modes an earlier run wrote to --out's .json (same model, card and samples) and "
                        "add these: one table from several commands")
    parser.add_argument("--speed-json", nargs="?", const=str(SPEED_JSON), type=Path,
                        help=f"record the headline ratios in this file (default when given: {SPEED_JSON})")
    parser.add_argument("--profile", type=Path, help="write each mode's profile (top operations) into this folder")
    parser.add_argument("--lora-dropout", type=float, help="default: the model config's")
    parser.add_argument("--no-special-rows", action="store_true", help="LoRA alone, no trainable special-token rows")
    parser.add_argument("--zero-stage", type=int, choices=(2, 3), default=2, help="ours (default: %(default)s)")
    args = parser.parse_args(argv)
    names = args.modes.split(",")
    unknown = [name for name in names if name not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)} (known: {', '.join(MODES)})")
    if not torch.cuda.is_available():
        cuda_only = [name for name in names if MODES[name].needs_cuda]
        if cuda_only:
            parser.error(f"mode(s) {', '.join(cuda_only)} need a GPU (FlexAttention has no backward on CPU)")
    args.modes = sorted(names, key=run_order)
    return args


def run_order(name: str) -> int:
    """Ours' packed modes first (the baselines take their real tokens a step from them); TRL's last: its
    `use_liger_kernel` patches transformers' Llama module itself (liger 0.8.5 swaps in its RoPE function, RMSNorm and
    MLP classes), so every model built after it would run liger's kernels too."""
    mode = MODES[name]
    return {"ours": 0 if mode.packed else 1, "plain": 2, "trl": 3}[mode.runner]


def prime_target_count_variants(device: torch.device, model: ModelConfig, sentinels: int) -> None:
    """Compile both variants of liger-kernel's cross-entropy kernel before any mode is timed.

    liger-kernel 0.8.5 passes the count of target tokens to that Triton kernel as a plain integer, and Triton
    specializes integers on divisibility by 16: the first step whose count is a multiple of 16 compiles a second
    variant (~0.4 s). In one process only the first mode that meets one pays it, inside its timed steps (ours'
    4th timed step of the 1B bench, H200, bench/results/zero3_trl_h200_2026-11-28). Compiled here, no mode pays it
    (on an H200 the slowest of 30 timed steps then ran 3% over the median: loss_driver_decode_h200_2026-11-29)."""
    if device.type != "cuda":
        return
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return
    vocabulary = aligned_vocabulary(len(load_tokenizer(model)) + sentinels)
    weight = torch.randn(vocabulary, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    for targets in (16, 17):
        hidden = torch.randn(targets, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        wanted = torch.zeros(targets, dtype=torch.long, device=device)
        # one chunk: its buffers start aligned, as a step's chunks of hundreds of rows do (Triton specializes pointers
        # on 16-byte alignment too; chunks of one row, liger's default for 16 rows, would compile other variants)
        liger_fused_linear_cross_entropy(hidden, weight, wanted, chunk_mem_const=vocabulary).backward()
    synchronize(device)


def model_config(args: argparse.Namespace) -> ModelConfig:
    model = ModelConfig.model_validate(read_yaml(ROOT / "configs" / "models" / f"{args.model}.yaml"))
    lora = {**LORA, "train_special_tokens": not args.no_special_rows}
    if args.lora_dropout is not None:
        lora["dropout"] = args.lora_dropout
    update: dict[str, Any] = {"lora": model.lora.model_copy(update=lora)}
    if args.path:
        update["path"] = args.path
    return model.model_copy(update=update)


def kept_results(args: argparse.Namespace, setup: dict[str, str]) -> dict[str, dict[str, Any]]:
    """`--keep`: the modes an earlier run measured in `--out`'s JSON, when it measured the same setup."""
    if not args.keep:
        return {}
    if not args.out:
        raise ClozeMathError("--keep needs --out (the table whose modes it keeps)")
    path = Path(args.out).with_suffix(".json")
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        earlier, results = saved["setup"], saved["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClozeMathError(f"{path}: not a results file of this benchmark ({exc})") from None
    if earlier != setup:
        raise ClozeMathError(f"{path} holds another setup ({earlier}): drop --keep or give another --out")
    return {name: values for name, values in results.items() if name in MODES and name not in args.modes}


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model = model_config(args)
    model_name = args.model + (f" ({args.path})" if args.path else "")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.data == "gsm8k":
        rows, sentinels = real_rows(model, args.problems)
        described = (f"ClozeMath GSM8K training samples of {args.problems} problems ({len(rows)} samples, mean "
                     f"{sum(len(r['input_ids']) for r in rows) / len(rows):.0f} tokens)")
    else:
        rows, sentinels = synthetic_rows(args.batch * (args.warmup + args.steps + 1), args.seq, args.prefix_share), 8
        described = f"synthetic samples of {args.seq} tokens, prefix share {args.prefix_share}"
    work = Work.of(rows)
    described += f", {work.targets / work.tokens:.0%} of tokens predict a target"
    if any(MODES[name].runner == "plain" for name in args.modes):
        bucket_batches([len(row["input_ids"]) for row in rows], args.buckets, 1)  # a sample too long fails now
    setup = {"model": model_name, "card": device_name, "samples": described,
             "lora": f"{LORA}, dropout {model.lora.dropout}, special rows {not args.no_special_rows}"}
    results = kept_results(args, setup)
    step_tokens = args.step_tokens or (args.pack_tokens if isinstance(args.pack_tokens, int) else FALLBACK_STEP_TOKENS)
    command = command_line("train_throughput.py", argv)
    prime_target_count_variants(device, model, sentinels)
    report = ""
    for name in args.modes:
        mode = MODES[name]
        if mode.baseline and args.step_tokens is None:
            packed = next((results[n] for n in results if MODES[n].packed and "failed" not in results[n]), None)
            step_tokens = round(packed["tokens_per_step"]) if packed else step_tokens
        context = Context(rows, sentinels, device, model, args, step_tokens)
        try:
            measured = measure(mode, context, work, args.profile)
        except Exception as exc:  # noqa: BLE001  a mode that breaks leaves its line in the table, not the whole run
            traceback.print_exc()
            measured = {"failed": failure_note(exc)}
            free_memory(device)
        results[name] = {**measured, "command": command}
        print(f"{name}: {results[name]}", flush=True)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"]:
            print(f"{name} compile: {torch._dynamo.utils.compile_times()}", flush=True)
        report = table(results, args, device_name, model, described)
        if args.out:  # rewritten after every mode: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.out, report + "\n")
            write_text_atomic(Path(args.out).with_suffix(".json"),
                              json.dumps({"setup": setup, "results": results}, indent=1) + "\n")
    print(report)
    if args.speed_json:
        record(headlines(results, model_name, device_name), args.speed_json)
    return 1 if any("failed" in results[name] for name in args.modes) else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except ClozeMathError as exc:
        print(f"train_throughput: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
