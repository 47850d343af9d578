"""Training throughput: our DeepSpeed loop against a plain transformers + peft loop, LoRA rank 32.

Real (non-padding) tokens per second, MFU and peak GPU memory on a Llama-3.2-1B-shaped random model (or any model
in configs/models), for the settings a ClozeMath run can use:

- `hf-causal`: the baseline researchers run today: the peft model's own forward with `labels` (logits at every
  position), `loss.backward()`, fused AdamW; no DeepSpeed. `hf-causal-compiled`: the same under `torch.compile`.
- `causal`, `prefix_lm-sdpa`, `prefix_lm-flex`: `clozemath.train.loop.train` (DeepSpeed ZeRO-2 or 3, one GPU),
  one sample a row: causal mask, PrefixLM through the additive 4D mask with sdpa, or through a FlexAttention
  BlockMask.
- `packed`: what `clozemath run` does on a GPU: `train` with packed rows (`train.pack_tokens`, default auto),
  PrefixLM FlexAttention document masks, compiled decoder layers.

Rows: `--data gsm8k` takes ClozeMath's training samples of the first `--problems` GSM8K training problems through
our tokenizer path (the plain loop gets them in shuffled micro-batches of `--batch`, padded to the longest, as a
user would batch them); without it, synthetic rows of `--seq` tokens with `--prefix-share` in the prefix. Times are
per optimizer step: `--steps` steps after `--warmup` steps, then one more step that is not timed (ours writes the
run's checkpoint and adapter in its last step); the first step's time (compilation included) is reported apart.
MFU counts 4N FLOPs a token for LoRA (forward and input gradients of every weight matrix: N), plus attention
(12 x layers x hidden x the mean attended context), against the card's dense bf16 peak.

    python bench/train_throughput.py --data gsm8k --modes hf-causal,hf-causal-compiled,packed --out bench/results/x.md
    python bench/train_throughput.py --model tiny-llama --steps 3 --warmup 1 --seq 64   # a CPU smoke run

`--compile`, `--pack-tokens` and `--fused-loss` set the packed mode's `train.*` settings. `--profile DIR` also
writes, per mode, the 30 costliest operations of 3 steps (torch.profiler) on the GPU and the 40 on the host, how
busy the GPU was, and a Chrome trace of the 3 steps;
`--lora-dropout`, `--no-special-rows` change the setup (to find where the time goes).

Needs torch, transformers, peft, deepspeed and this repository (no ray, mlflow or datasets).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath.config import (  # noqa: E402
    DataConfig, ExperimentConfig, MethodConfig, ModelConfig, TrainConfig, read_yaml,
)
from clozemath.data.prepare import prepare_data  # noqa: E402
from clozemath.data.tokenize import IGNORE_INDEX, collate  # noqa: E402
from clozemath.model.load import load_model  # noqa: E402
from clozemath.train.loop import StepMetrics, model_inputs, train  # noqa: E402

MODES = ("hf-causal", "hf-causal-compiled", "causal", "prefix_lm-sdpa", "prefix_lm-flex", "packed")
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak by card (vendors' datasheets, SXM)."""


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


def experiment(model: ModelConfig, mode: str, args: argparse.Namespace) -> ExperimentConfig:
    attention = "causal" if mode.endswith("causal") or mode.startswith("hf-causal") else "prefix_lm"
    implementation = "flex_attention" if mode.endswith("flex") else "sdpa"
    packing = {"pack_tokens": args.pack_tokens, "compile": args.compile} if mode == "packed" else {"pack_tokens": None}
    packing["fused_loss"] = args.fused_loss
    return ExperimentConfig(
        name=f"bench-{mode}",
        model=model if mode == "packed" else model.model_copy(update={"attn_implementation": implementation}),
        method=MethodConfig(name=mode, attention=attention),
        train=TrainConfig(
            micro_batch_size=args.batch, max_steps=args.warmup + args.steps + 1, checkpoint_every=10**9,
            group_by_length=False, zero_stage=args.zero_stage, lr=5e-5, **packing,
        ),
    )


Tick = Callable[[int], None]
"""Called after every optimizer step (the GPU synchronized) with the step's real tokens."""


def run_ours(config: ExperimentConfig, rows: list[dict[str, Any]], sentinels: int, device: torch.device,
             tick: Tick) -> float:
    """`clozemath.train.loop.train` (its last step writes the run's checkpoint and adapter before it reports: that
    step is run but not timed); returns the model's FLOPs
    a token."""
    loaded = load_model(config.model, num_sentinels=sentinels, device=device)

    def report(metrics: StepMetrics, _checkpoint: Path | None) -> None:
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        tick(metrics.tokens)

    train(loaded.model, rows, config, specials=loaded.specials, pad_id=loaded.tokenizer.pad_token_id, report=report)
    return flops_per_token(loaded.model, rows)


def run_hf(config: ExperimentConfig, rows: list[dict[str, Any]], sentinels: int, device: torch.device,
           tick: Tick) -> float:
    """The plain loop: `model(input_ids, attention_mask, labels).loss`, backward, fused AdamW; consecutive rows of the
    (shuffled) samples in micro-batches padded to the longest."""
    loaded = load_model(config.model, num_sentinels=sentinels, device=device)
    # dynamic shapes: padded micro-batches change length every step (static shapes recompile for each new one)
    model = torch.compile(loaded.model, dynamic=True) if config.name.endswith("-compiled") else loaded.model
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
        tick(sum(len(row["input_ids"]) for row in chunk))
    return flops_per_token(loaded.model, rows)


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
    gpu = averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
    host = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    return f"{head}{gpu}\nThe host's side (where a step's CPU time goes):\n{host}"


def matmul_params(model: torch.nn.Module) -> int:
    """N: the weights of every matrix product a token goes through (embedding lookups are not products; a tied output
    matrix is, once)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n = sum(p.numel() for name, p in base.named_parameters() if "embed_tokens" not in name and "lora_" not in name
            and "trainable_tokens" not in name)
    return n + (base.get_input_embeddings().weight.numel() if base.config.tie_word_embeddings else 0)


def flops_per_token(model: torch.nn.Module, rows: list[dict[str, Any]]) -> float:
    """4N for LoRA's matrix products, plus attention: 12 x layers x hidden x the mean context a token attends to
    (its position within its own sample, + 1: packed samples never attend to each other)."""
    config = model.config
    lengths = [len(row["input_ids"]) for row in rows]
    context = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)
    return 4 * matmul_params(model) + 12 * config.num_hidden_layers * config.hidden_size * context


def peak_flops(device_name: str) -> float | None:
    return next((flops for card, flops in PEAK_BF16_FLOPS.items() if card in device_name), None)


def measure(mode: str, run: Callable[..., None], config: ExperimentConfig, rows: list[dict[str, Any]],
            sentinels: int, device: torch.device, warmup: int, profile_dir: Path | None) -> dict[str, float]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds: list[float] = []
    tokens: list[int] = []
    last = time.perf_counter()
    prof = profiler(warmup, device) if profile_dir else None

    def tick(real_tokens: int) -> None:
        nonlocal last
        now = time.perf_counter()
        seconds.append(now - last)
        tokens.append(real_tokens)
        last = now
        if prof is not None:
            prof.step()

    with prof if prof is not None else nullcontext():
        flops = run(config, rows, sentinels, device, tick)
    first = warmup if prof is None else warmup + 1 + PROFILED_STEPS
    # the last step is not timed: ours writes the run's checkpoint and adapter in it (0.6-0.8 s for the 1B shape)
    timed = seconds[first:-1] or seconds[warmup:-1]
    counted = tokens[first:-1] or tokens[warmup:-1]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    per_step = sum(timed) / len(timed)
    if prof is not None:
        assert profile_dir is not None
        (profile_dir / f"{mode}.txt").write_text(profile_summary(prof, 1000 * per_step, device))
        prof.export_chrome_trace(str(profile_dir / f"{mode}.trace.json"))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": sum(counted) / sum(timed), "ms_per_step": 1000 * per_step, "tokens_per_step": sum(counted) / len(counted),
        "first_step_s": seconds[0], "peak_gib": peak, "flops_per_token": flops,
        "ms_per_step_min_median_max": [round(1000 * f(timed), 1) for f in (min, statistics.median, max)],
        "ms_per_timed_step": [round(1000 * s, 1) for s in timed],  # where the one-off slow steps fall
    }


def table(
    results: dict[str, dict[str, float]], args: argparse.Namespace, device_name: str, model: ModelConfig,
    rows_described: str,
) -> str:
    base = results.get("hf-causal", {}).get("tokens_per_s")
    peak = peak_flops(device_name)
    flops = next(iter(results.values()))["flops_per_token"]
    lines = [
        f"Training throughput on {device_name}: {args.model}, LoRA rank 32 (dropout {model.lora.dropout}"
        f"{'' if args.no_special_rows else ', + special-token rows'}), ours on ZeRO-{args.zero_stage}, "
        f"{rows_described}, mean of {args.steps} steps after {args.warmup}; tokens are real (non-padding) tokens; "
        f"{flops / 1e9:.2f} GFLOP a token.",
        "",
        "| mode | tokens/s | MFU | tokens/s at the median step | tokens/step | ms/step (min / median / max) "
        "| first step s | peak GiB | vs hf-causal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, values in results.items():
        ratio = f"{values['tokens_per_s'] / base:.2f}x" if base else "n/a"
        mfu = f"{values['tokens_per_s'] * flops / peak:.1%}" if peak else "n/a"
        fastest, median, slowest = values["ms_per_step_min_median_max"]
        lines.append(
            f"| {mode} | {values['tokens_per_s']:,.0f} | {mfu} | {values['tokens_per_step'] / median * 1000:,.0f} | "
            f"{values['tokens_per_step']:,.0f} | {values['ms_per_step']:.1f} ({fastest} / {median} / {slowest}) | "
            f"{values['first_step_s']:.1f} | {values['peak_gib']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b-random", help="a name in configs/models (default: %(default)s)")
    parser.add_argument("--path", help="override the model config's path (e.g. where the SmolLM2 GGUF lies)")
    parser.add_argument("--data", choices=("synthetic", "gsm8k"), default="synthetic")
    parser.add_argument("--problems", type=int, default=2000, help="--data gsm8k: problems (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prefix-share", type=float, default=0.66)
    parser.add_argument("--pack-tokens", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="packed mode's train.pack_tokens (default: %(default)s)")
    parser.add_argument("--compile", type=lambda v: v if v == "auto" else v == "on", default="auto",
                        help="packed mode's train.compile: auto, on or off (default: %(default)s)")
    parser.add_argument("--fused-loss", type=lambda v: v if v == "auto" else v == "on", default="auto",
                        help="ours: train.fused_loss (liger-kernel's fused linear + cross-entropy): auto, on or off "
                             "(default: %(default)s)")
    parser.add_argument("--no-cudnn-sdpa", action="store_true",
                        help="keep sdpa off cuDNN (which builds a new plan for every new shape of a padded batch)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--profile", type=Path, help="write each mode's profile (top operations) into this folder")
    parser.add_argument("--lora-dropout", type=float, help="default: the model config's")
    parser.add_argument("--no-special-rows", action="store_true", help="LoRA alone, no trainable special-token rows")
    parser.add_argument("--zero-stage", type=int, choices=(2, 3), default=2, help="ours (default: %(default)s)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model = ModelConfig.model_validate(read_yaml(ROOT / "configs" / "models" / f"{args.model}.yaml"))
    lora = {"rank": 32, "alpha": 64, "train_special_tokens": not args.no_special_rows}
    if args.lora_dropout is not None:
        lora["dropout"] = args.lora_dropout
    model = model.model_copy(update={"lora": model.lora.model_copy(update=lora), **({"path": args.path} if args.path else {})})
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.data == "gsm8k":
        rows, sentinels = real_rows(model, args.problems)
        described = (f"ClozeMath GSM8K training samples of {args.problems} problems ({len(rows)} samples, mean "
                     f"{sum(len(r['input_ids']) for r in rows) / len(rows):.0f} tokens; plain loop: micro-batches of "
                     f"{args.batch} padded to the longest; packed: rows of train.pack_tokens={args.pack_tokens})")
    else:
        rows, sentinels = synthetic_rows(args.batch * (args.warmup + args.steps), args.seq, args.prefix_share), 8
        described = f"batch {args.batch} x {args.seq}, prefix share {args.prefix_share}"
    results: dict[str, dict[str, float]] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode '{mode}' (known: {', '.join(MODES)})")
        run = run_hf if mode.startswith("hf-") else run_ours
        config = experiment(model, mode, args)
        results[mode] = measure(mode, run, config, rows, sentinels, device, args.warmup, args.profile)
        print(f"{mode}: {results[mode]}", flush=True)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"]:
            print(f"{mode} compile: {torch._dynamo.utils.compile_times()}", flush=True)
        report = table(results, args, device_name, model, described)
        if args.out:
            Path(args.out).write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
