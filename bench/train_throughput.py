"""Training throughput: our DeepSpeed loop against a plain transformers + peft loop, LoRA rank 32.

Tokens per second and peak GPU memory at a fixed batch shape (default 8 x 512, no padding) on a Llama-3.2-1B-shaped
random model, for the attention settings a ClozeMath run can use:

- `hf-causal`: the baseline researchers run today: the peft model's own forward with `labels` (logits at every
  position), `loss.backward()`, fused AdamW; no DeepSpeed. `hf-causal-compiled`: the same under `torch.compile`.
- `causal`, `prefix_lm-sdpa`, `prefix_lm-flex`: `clozemath.train.loop.train` (DeepSpeed ZeRO-2 or 3, one GPU),
  causal mask, PrefixLM through the additive 4D mask with sdpa, or PrefixLM through a FlexAttention BlockMask.

Every row has `--prefix-share` of its tokens in the prefix (default 0.66: ClozeMath's GSM8K samples) and the rest
as targets; the same rows feed every mode. Times are per optimizer step after `--warmup` steps.

    python bench/train_throughput.py --out bench/results/train_throughput_<gpu>.md
    python bench/train_throughput.py --model tiny-llama --steps 3 --warmup 1 --seq 64   # a CPU smoke run

`--profile DIR` also writes, per mode, the 30 costliest operations of 3 steps (torch.profiler) and how busy the GPU
was; `--lora-dropout`, `--no-special-rows` change the setup (to find where the time goes).

Needs torch, transformers, peft, deepspeed and this repository (no ray, mlflow or datasets).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath.config import ExperimentConfig, MethodConfig, ModelConfig, TrainConfig, read_yaml  # noqa: E402
from clozemath.data.tokenize import IGNORE_INDEX, collate  # noqa: E402
from clozemath.model.load import load_model  # noqa: E402
from clozemath.train.loop import StepMetrics, model_inputs, train  # noqa: E402

MODES = ("hf-causal", "hf-causal-compiled", "causal", "prefix_lm-sdpa", "prefix_lm-flex")


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


def experiment(model: ModelConfig, mode: str, args: argparse.Namespace) -> ExperimentConfig:
    attention = "prefix_lm" if mode.startswith("prefix_lm") else "causal"
    implementation = "flex_attention" if mode.endswith("flex") else "sdpa"
    return ExperimentConfig(
        name=f"bench-{mode}",
        model=model.model_copy(update={"attn_implementation": implementation}),
        method=MethodConfig(name=mode, attention=attention),
        train=TrainConfig(
            micro_batch_size=args.batch, max_steps=args.warmup + args.steps, checkpoint_every=10**9,
            group_by_length=False, zero_stage=args.zero_stage, lr=5e-5,
        ),
    )


Tick = Callable[[], None]
"""Called after every optimizer step (the GPU synchronized)."""


def run_ours(config: ExperimentConfig, rows: list[dict[str, Any]], device: torch.device, tick: Tick) -> None:
    """`clozemath.train.loop.train` (the last step's checkpoint is written after its tick)."""
    loaded = load_model(config.model, num_sentinels=8, device=device)

    def report(_metrics: StepMetrics, _checkpoint: Path | None) -> None:
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        tick()

    train(loaded.model, rows, config, specials=loaded.specials, pad_id=loaded.tokenizer.pad_token_id, report=report)


def run_hf(config: ExperimentConfig, rows: list[dict[str, Any]], device: torch.device, tick: Tick) -> None:
    """The plain loop: `model(input_ids, attention_mask, labels).loss`, backward, fused AdamW."""
    loaded = load_model(config.model, num_sentinels=8, device=device)
    model = torch.compile(loaded.model) if config.name.endswith("-compiled") else loaded.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-5, fused=device.type == "cuda")
    batch_size = config.train.micro_batch_size
    for step in range(config.train.max_steps or 0):
        chunk = rows[(step * batch_size) % len(rows) :][:batch_size]
        batch = {k: v.to(device) for k, v in collate(chunk, loaded.tokenizer.pad_token_id).items()}
        inputs = model_inputs(batch, config, loaded.model, packed=False)
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        tick()


PROFILED_STEPS = 3


def profiler(warmup: int, device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=warmup, warmup=1, active=PROFILED_STEPS, repeat=1)
    return torch.profiler.profile(activities=activities, schedule=schedule)


def profile_summary(prof: torch.profiler.profile, ms_per_step: float, device: torch.device) -> str:
    """The costliest operations, and the share of a step's wall time during which the GPU ran kernels."""
    averages = prof.key_averages()
    if device.type != "cuda":
        return averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    kernels = [event for event in averages if event.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(event.self_device_time_total for event in kernels) / 1000 / PROFILED_STEPS
    head = f"GPU busy {busy_ms:.1f} ms of a {ms_per_step:.1f} ms step ({busy_ms / ms_per_step:.0%})\n"
    return head + averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)


def measure(mode: str, run: Callable[..., None], config: ExperimentConfig, rows: list[dict[str, Any]],
            device: torch.device, warmup: int, profile_dir: Path | None) -> dict[str, float]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds: list[float] = []
    last = time.perf_counter()
    prof = profiler(warmup, device) if profile_dir else None

    def tick() -> None:
        nonlocal last
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
        if prof is not None:
            prof.step()

    with prof if prof is not None else nullcontext():
        run(config, rows, device, tick)
    timed = seconds[warmup:] if prof is None else seconds[warmup + 1 + PROFILED_STEPS :] or seconds[warmup:]
    tokens = config.train.micro_batch_size * len(rows[0]["input_ids"])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    per_step = sum(timed) / len(timed)
    if prof is not None:
        assert profile_dir is not None
        (profile_dir / f"{mode}.txt").write_text(profile_summary(prof, 1000 * per_step, device))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": tokens / per_step, "ms_per_step": 1000 * per_step, "peak_gib": peak}


def table(
    results: dict[str, dict[str, float]], args: argparse.Namespace, device_name: str, model: ModelConfig
) -> str:
    base = results.get("hf-causal", {}).get("tokens_per_s")
    lines = [
        f"Training throughput on {device_name}: {args.model}, LoRA rank 32 (dropout {model.lora.dropout}"
        f"{'' if args.no_special_rows else ', + special-token rows'}), ours on ZeRO-{args.zero_stage}, "
        f"batch {args.batch} x {args.seq}, prefix share {args.prefix_share}, mean of {args.steps} steps after "
        f"{args.warmup}.",
        "",
        "| mode | tokens/s | ms/step | peak GiB | vs hf-causal |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode, values in results.items():
        ratio = f"{values['tokens_per_s'] / base:.2f}x" if base else "n/a"
        lines.append(
            f"| {mode} | {values['tokens_per_s']:,.0f} | {values['ms_per_step']:.1f} | {values['peak_gib']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b-random", help="a name in configs/models (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prefix-share", type=float, default=0.66)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--profile", type=Path, help="write each mode's profile (top operations) into this folder")
    parser.add_argument("--lora-dropout", type=float, help="default: the model config's")
    parser.add_argument("--no-special-rows", action="store_true", help="LoRA alone, no trainable special-token rows")
    parser.add_argument("--zero-stage", type=int, choices=(2, 3), default=2, help="ours (default: %(default)s)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model = ModelConfig.model_validate(read_yaml(ROOT / "configs" / "models" / f"{args.model}.yaml"))
    lora = {"rank": 32, "alpha": 64, "train_special_tokens": not args.no_special_rows}
    if args.lora_dropout is not None:
        lora["dropout"] = args.lora_dropout
    model = model.model_copy(update={"lora": model.lora.model_copy(update=lora)})
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = synthetic_rows(args.batch * (args.warmup + args.steps), args.seq, args.prefix_share)
    results: dict[str, dict[str, float]] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode '{mode}' (known: {', '.join(MODES)})")
        run = run_hf if mode.startswith("hf-") else run_ours
        config = experiment(model, mode, args)
        results[mode] = measure(mode, run, config, rows, device, args.warmup, args.profile)
        print(f"{mode}: {results[mode]}", flush=True)
        report = table(results, args, device_name, model)
        if args.out:
            Path(args.out).write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
