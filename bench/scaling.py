"""Scaling table (issue 28): `clozemath run configs/grids/scaling.yaml` (the 1B and 8B shapes on 1, 2 and 4 GPUs,
ZeRO-2 and ZeRO-3, 12 steps each), then one line a trial from what its Train workers logged to MLflow:

- tokens/s per GPU: the median over the steps after the second and before the last (which writes the checkpoint),
  of `train/tokens_per_s` (real tokens of all ranks a second) over the workers;
- MFU: that rate x the FLOPs of a real token of the trial's samples, by `clozemath.train.flops`'s convention (the
  output layer at target positions only, LoRA's own FLOPs included, PrefixLM's attended pairs), over the card's bf16
  peak;
- peak memory: `train/peak_memory_gib`, the most any rank held;
- first step: `train/seconds` of step 1 (compiling included: cold for each model's first trial, from the grid's
  compile cache after); to first step: from the trial's MLflow run start to step 1 logged (workers' start, the model's
  random init and its move to the GPU, the first step);
- scaling efficiency: tokens/s per GPU over the same model's on one GPU (ZeRO-2);
- the dry-run's estimate of the trial's wall time beside the measured one (issue 28 asks for 25%).

    python bench/scaling.py --out bench/results/scaling_h100.md                       # on the GPU machine
    python bench/scaling.py --out x.md axes.model=[llama-3.2-1b-random] 'axes.layout=[1xZeRO-2,2xZeRO-2]'
    python bench/scaling.py --report-only --card H100 tracking.uri=sqlite:///mlruns.db   # the table again
    python bench/scaling.py --out x.md model=tiny-llama 'axes.model=[tiny-llama]' train.use_gpu=false \\
        train.compile=false train.pack_tokens=512 data.limit=40 'axes.layout=[1xZeRO-2,2xZeRO-3]'  # CPU smoke

Arguments other than the flags are `clozemath run` overrides of the grid.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath import tracking  # noqa: E402
from clozemath.config import ExperimentConfig  # noqa: E402
from clozemath.cost import estimate, meta_shape  # noqa: E402
from clozemath.cost.throughput import Throughput  # noqa: E402
from clozemath.plan import RunPlan, load_plan  # noqa: E402
from clozemath.records import GRID_TAG, ROLE_TAG, TRIAL_ROLE, TRIAL_TAG  # noqa: E402
from clozemath.train.flops import (  # noqa: E402
    MFU_CONVENTION, PEAK_BF16_FLOPS, TrainingShape, Work, card_value, flops_per_token, mfu,
)

GRID = ROOT / "configs" / "grids" / "scaling.yaml"


def trial_runs(plan: RunPlan) -> dict[str, Any]:
    """The latest MLflow run of each trial of the grid."""
    config = plan.experiments[0].tracking
    runs = tracking.find_runs(config, {GRID_TAG: plan.grid.name, ROLE_TAG: TRIAL_ROLE})
    latest: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        latest[run.data.tags[TRIAL_TAG]] = run
    return latest


def measured(client: Any, run: Any) -> dict[str, float]:
    def history(name: str) -> list[Any]:
        return sorted(client.get_metric_history(run.info.run_id, f"train/{name}"), key=lambda m: m.step)

    rates = history("tokens_per_s")
    steady = [m.value for m in rates[2:-1]] or [m.value for m in rates]
    seconds = history("seconds")
    first = seconds[0] if seconds else None
    return {
        "tokens_per_s": statistics.median(steady),
        "first_step_s": first.value if first else float("nan"),
        "to_first_step_s": (first.timestamp - run.info.start_time) / 1000 if first else float("nan"),
        "peak_gib": max((m.value for m in history("peak_memory_gib")), default=float("nan")),
        "wall_s": ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000,
        "steps": len(rates),
    }


def real_token_flops(config: ExperimentConfig, shapes: Throughput) -> float:
    """FLOPs of one real token of the trial's samples (`clozemath.train.flops`), its model's shape (the throughput
    table's, for a model whose weights are read) built on the meta device."""
    from clozemath.data.prepare import prepare_data

    prepared = prepare_data(config)
    sentinels = len(prepared.specials.ids) - 3  # less SEP, mask and EOS
    shape = TrainingShape.of(meta_shape(shapes.shape_of(config.model), len(prepared.tokenizer), sentinels))
    work = Work.of(row for row in prepared.encoded if row is not None)
    return flops_per_token(shape, work, targets_only=True, prefix_lm=config.method.attention == "prefix_lm")


def table(plan: RunPlan, card_name: str) -> str:
    runs = trial_runs(plan)
    client = tracking.client(plan.experiments[0].tracking.uri)
    peak = card_value(PEAK_BF16_FLOPS, card_name)
    estimated = {s.trial.name: s.trial.wall_s for s in estimate(plan, 4, card_name).scheduled}
    shapes = Throughput(plan.root)
    flops: dict[str, float] = {}
    rows, single = [], {}
    for config in plan.experiments:
        run = runs.get(config.name)
        if run is None or run.info.status != "FINISHED":
            rows.append((config, None))
            continue
        values = measured(client, run)
        workers = config.train.num_workers
        values["per_gpu"] = values["tokens_per_s"] / workers
        key = config.model.model_dump_json()
        if key not in flops:
            flops[key] = real_token_flops(config, shapes)
        values["mfu"] = mfu(values["per_gpu"], flops[key], peak) if peak else float("nan")
        if workers == 1 and config.train.zero_stage in (2, "auto"):
            single[config.model.name] = values["per_gpu"]
        rows.append((config, values))
    lines = [
        "| model | GPUs | ZeRO | compiled | tokens/s | tokens/s per GPU | MFU | scaling efficiency | peak GiB | "
        "first step s | to first step s | wall s (measured / dry-run) |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config, values in rows:
        train = config.train
        compiled = {True: "yes", False: "no"}.get(train.compile, str(train.compile))
        head = f"| {config.model.name} | {train.num_workers} | {train.zero_stage} | {compiled}"
        if values is None:
            lines.append(f"{head} | not finished | | | | | | | |")
            continue
        base = single.get(config.model.name)
        efficiency = f"{values['per_gpu'] / base:.0%}" if base else "n/a"
        lines.append(
            f"{head} | {values['tokens_per_s']:,.0f} | {values['per_gpu']:,.0f} | {values['mfu']:.1%} | {efficiency} "
            f"| {values['peak_gib']:.1f} | {values['first_step_s']:.1f} | {values['to_first_step_s']:.1f} | "
            f"{values['wall_s']:.0f} / {estimated.get(config.name, float('nan')):.0f} |"
        )
    header = (f"Scaling through `clozemath run` on {card_name} ({plan.grid.name}: {len(plan.experiments)} trials, one "
              f"at a time). {MFU_CONVENTION}.")
    return "\n".join([header, "", *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the markdown table to this file")
    parser.add_argument("--report-only", action="store_true", help="do not run the grid: tabulate what it logged")
    parser.add_argument("--card", help="the GPU (default: this machine's first)")
    args, overrides = parser.parse_known_args(argv)
    plan = load_plan(GRID, overrides)
    if not args.report_only:
        command = [sys.executable, "-m", "clozemath_cli", "run", str(GRID), *overrides]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, cwd=ROOT, check=True)
    card = args.card
    if card is None:
        import torch

        card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100"
    report = table(plan, card)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
