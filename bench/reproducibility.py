"""Same-seed reproducibility on one card: the same config trained twice with `train.deterministic: true` and twice
without, each run in a fresh process, then the adapters compared tensor by tensor (how many tensors differ in any bit,
the largest absolute difference) and the losses step by step.

A run is the training loop of `clozemath run` (`clozemath.train.loop.train`: the DeepSpeed engine, packed rows,
FlexAttention and the fused loss on a GPU) on the samples `clozemath prepare` makes, prepared once for all runs;
no Ray (the workers' data order is a function of the seed and their rows, in a fixed order: tests/test_determinism.py
checks that end to end on CPU). Each deterministic run also lists the operations torch warned have no deterministic
implementation (`warn_only`): where what still differs comes from.

    # one GPU (SmolLM2-135M, ClozeMath on 1,000 GSM8K problems, 120 packed rows of 4,096 tokens a run; about 4
    # minutes on an H200 by estimate: ~15k tokens/s uncompiled, imports and model loads a run)
    python bench/reproducibility.py --out bench/results/reproducibility_h200 model.path=/tmp/m
    # the pair without the switch alone (--only deterministic: the pair with it)
    python bench/reproducibility.py --only default --out bench/results/reproducibility_h200 model.path=/tmp/m
    # a CPU smoke run of the same code
    python bench/reproducibility.py --out /tmp/repro model=tiny-llama data.limit=8 train.max_steps=3 \\
        train.pack_tokens=null

On the project's GPU machine (torch, transformers and peft of its own; deepspeed, ray and liger-kernel from
`../shared/tools/gpu-site`'s bundle unpacked into /tmp/site, the GGUF put in /tmp/m as `../shared/tools/gpu-smollm2`
says): `export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 CLOZEMATH_DATA_DIR=$PWD/shared/data` first.
Overrides (`key=value`) apply to `configs/experiments/quickstart_gpu.yaml`'s ClozeMath trial after the
benchmark's own (`SETTINGS`).
Writes `reproducibility.json` and `reproducibility.md` under `--out`; the runs' adapters stay in `--work`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.speed_record import command_line  # noqa: E402
from clozemath.config import ExperimentConfig, from_wire, to_wire  # noqa: E402
from clozemath.errors import ClozeMathError  # noqa: E402
from clozemath.files import write_text_atomic  # noqa: E402
from clozemath.records import ADAPTER_DIR  # noqa: E402

BASE = ROOT / "configs" / "experiments" / "quickstart_gpu.yaml"
SETTINGS = [
    "name=reproducibility", "axes.method=[clozemath]", "data.limit=1000", "train.epochs=1.0", "train.max_steps=120",
    "train.num_workers=1", "train.gpu_share=1.0", "train.zero_stage=2", "train.micro_batch_size=4",
    "train.pack_tokens=4096",
    "train.compile=false", "train.lr=1.0e-3", "train.warmup_ratio=0.03", "train.checkpoint_every=120",
    "eval.sets=[]",
]
"""quickstart_gpu's ClozeMath trial (its rate, packed rows, LoRA dropout), cut to 120 steps of ~490k tokens in all:
enough for differences to grow, a few minutes for four runs on an H200. Uncompiled (compiling would take minutes), so
the deterministic pair attends with eager attention and the default pair with sdpa
(`clozemath.train.layout.uncompiled_attention`); `train.compile=true` compares compiled runs. The settings of the run
of 2026-12-02 (then written over the CPU quickstart's experiment, which is a grid now)."""
MODES = {"deterministic": True, "default": False}
ADAPTER_FILE = "adapter_model.safetensors"
NONDETERMINISTIC_HINT = "does not have a deterministic implementation"
"""The words of torch's warning (`warn_only`) for an operation it cannot run deterministically."""


def bench_config(overrides: Sequence[str]) -> ExperimentConfig:
    from clozemath.plan import load_plan

    experiments = load_plan(BASE, [*SETTINGS, *overrides]).experiments
    if len(experiments) != 1:
        raise ClozeMathError(f"{BASE}: {len(experiments)} trials with these overrides, not one")
    return experiments[0]


# --------------------------------------------------------------------------------------------------------------
# One run, in a process of its own


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train_one(work: Path, name: str, deterministic: bool) -> None:
    """Train `work/config.json` on `work/rows.json` with `train.deterministic` as given: the adapter into
    `work/<name>/adapter`, the steps' losses and gradient norms and the nondeterministic operations torch warned of
    into `work/<name>/run.json`."""
    from clozemath.model.load import load_model
    from clozemath.train.determinism import use_deterministic_kernels
    from clozemath.train.loop import StepMetrics, train

    if deterministic:
        use_deterministic_kernels()  # first: cuBLAS reads its workspace setting once
    config = from_wire(json.loads((work / "config.json").read_text()))
    config = config.model_copy(update={"train": config.train.model_copy(update={"deterministic": deterministic})})
    data = json.loads((work / "rows.json").read_text())
    loaded = load_model(config.model, data["num_sentinels"], device(), training=True, seed=config.train.seed)
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    steps: list[StepMetrics] = []

    def report(metrics: StepMetrics, checkpoint: Path | None) -> None:
        steps.append(metrics)
        if checkpoint is not None and metrics.step == metrics.total_steps:
            shutil.copytree(checkpoint / ADAPTER_DIR, folder / ADAPTER_DIR, dirs_exist_ok=True)

    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(loaded.model, data["rows"], config, specials=loaded.specials, pad_id=loaded.tokenizer.pad_token_id,
              report=report, scratch_dir=folder)
    seconds = time.perf_counter() - started
    warned = Counter(str(w.message).split(NONDETERMINISTIC_HINT)[0].strip() for w in caught
                     if NONDETERMINISTIC_HINT in str(w.message))  # the operation's name
    record = {"name": name, "deterministic": deterministic, "seconds": seconds, "steps": len(steps),
              "tokens": steps[-1].trained_tokens, "loss": [m.loss for m in steps],
              "grad_norm": [m.grad_norm for m in steps], "nondeterministic_ops": dict(warned)}
    write_text_atomic(folder / "run.json", json.dumps(record, indent=1))


# --------------------------------------------------------------------------------------------------------------
# Comparisons


@dataclass(frozen=True)
class AdapterDiff:
    tensors: int
    differing: int
    """Tensors that differ in any bit."""
    max_abs_diff: float
    worst: str | None
    """The tensor holding the largest difference (None: none differs)."""
    max_rel_diff: float
    """The largest difference of a tensor over its largest magnitude."""


def compare_adapters(first: Path, second: Path) -> AdapterDiff:
    """Two saved adapters (folders), tensor by tensor."""
    from safetensors.torch import load_file

    a, b = load_file(first / ADAPTER_FILE), load_file(second / ADAPTER_FILE)
    if a.keys() != b.keys():
        raise ClozeMathError(f"{first} and {second} hold different tensors: not two runs of one config")
    differing, worst, largest, relative = 0, None, 0.0, 0.0
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ClozeMathError(f"{name}: {tuple(x.shape)} {x.dtype} against {tuple(y.shape)} {y.dtype}")
        if torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            continue
        differing += 1
        diff = float((x.double() - y.double()).abs().max())
        scale = float(torch.maximum(x.double().abs().max(), y.double().abs().max()))
        relative = max(relative, diff / scale if scale else 0.0)
        if diff >= largest:
            worst, largest = name, diff
    return AdapterDiff(len(a), differing, largest, worst, relative)


def first_difference(first: Sequence[float], second: Sequence[float]) -> int | None:
    """The first step (1-based) whose values differ; None where none does."""
    return next((step for step, (x, y) in enumerate(zip(first, second), start=1) if x != y), None)


def compare_runs(first: Path, second: Path) -> dict[str, Any]:
    """Two runs' folders: their adapters (`AdapterDiff`), their final losses, how far their losses and gradient norms
    drifted apart and from which step."""
    runs = [json.loads((folder / "run.json").read_text()) for folder in (first, second)]
    losses, norms = [run["loss"] for run in runs], [run["grad_norm"] for run in runs]
    return {
        "runs": [run["name"] for run in runs],
        "adapter": asdict(compare_adapters(first / ADAPTER_DIR, second / ADAPTER_DIR)),
        "final_loss": [loss[-1] for loss in losses],
        "loss_max_abs_diff": max(abs(x - y) for x, y in zip(*losses)),
        "loss_first_differing_step": first_difference(*losses),
        "grad_norm_first_differing_step": first_difference(*norms),
        "seconds": [run["seconds"] for run in runs],
    }


# --------------------------------------------------------------------------------------------------------------
# The benchmark


def environment() -> dict[str, str]:
    import peft
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
                "transformers": transformers.__version__, "peft": peft.__version__}
    for module in ("deepspeed", "liger_kernel"):
        try:
            versions[module] = getattr(__import__(module), "__version__", "installed")
        except ImportError:
            versions[module] = "not installed"
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'unknown'})"
    return {"card": card, **versions}


def prepare(config: ExperimentConfig, work: Path) -> dict[str, Any]:
    """The config and its samples' token ids, written once for every run."""
    from clozemath.data.prepare import prepare_data

    prepared = prepare_data(config)
    rows = [row for row in prepared.encoded if row is not None]
    sentinels = prepared.summary(config.data.max_length)["sentinels_needed"]
    write_text_atomic(work / "config.json", json.dumps(to_wire(config)))
    write_text_atomic(work / "rows.json", json.dumps({"num_sentinels": sentinels, "rows": rows}))
    return {"samples": len(rows), "tokens": sum(len(row["input_ids"]) for row in rows)}


def run_in_process_of_its_own(work: Path, name: str, deterministic: bool) -> None:
    command = [sys.executable, __file__, "--train", str(work), name, *(["--deterministic"] if deterministic else [])]
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode:
        raise ClozeMathError(f"run {name} failed (exit {done.returncode}): its output is above")


def batches(config: ExperimentConfig) -> str:
    train = config.train
    rows = f"packed rows of {train.pack_tokens} tokens" if isinstance(train.pack_tokens, int) else \
        f"micro-batches of {train.micro_batch_size} samples"
    return f"{train.grad_accum} x {rows}" if train.grad_accum > 1 else rows


def benchmark(config: ExperimentConfig, work: Path, repeats: int, modes: Sequence[str]) -> dict[str, Any]:
    data = prepare(config, work)
    runs: dict[str, list[Path]] = {}
    for mode in modes:
        deterministic = MODES[mode]
        for repeat in range(1, repeats + 1):
            name = f"{mode}-{repeat}"
            print(f"[reproducibility] {name}", flush=True)
            run_in_process_of_its_own(work, name, deterministic)
            runs.setdefault(mode, []).append(work / name)
    warned = {run.name: json.loads((run / "run.json").read_text())["nondeterministic_ops"]
              for run in runs.get("deterministic", [])}
    return {
        "environment": environment(),
        "config": {"model": config.model.name, "method": config.method.name, "seed": config.train.seed,
                   "steps": config.train.max_steps, "batches": batches(config), **data},
        "seconds": {mode: [json.loads((run / "run.json").read_text())["seconds"] for run in folders]
                    for mode, folders in runs.items()},
        "pairs": {mode: [compare_runs(folders[0], other) for other in folders[1:]] for mode, folders in runs.items()},
        "nondeterministic_ops": warned,
    }


def markdown(result: dict[str, Any], command: str) -> str:
    env, config = result["environment"], result["config"]
    lines = [f"# Same-seed reproducibility: {config['model']}, {config['method']}, seed {config['seed']}", "",
             f"Card: {env['card']}; " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "card") + ".",
             f"Each run: {config['steps']} steps of {config['batches']} ({config['samples']:,} samples, "
             f"{config['tokens']:,} tokens an epoch), in a fresh process. Seconds a run (training): "
             + "; ".join(f"{mode} " + ", ".join(f"{s:.0f}" for s in seconds)
                         for mode, seconds in result["seconds"].items()) + ".", "",
             f"`{command}`", "",
             "| runs | tensors differing (any bit) | max abs diff | max rel diff | worst tensor | final losses | "
             "max loss diff | first step whose loss differs | first step whose grad norm differs |",
             "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    for mode, pairs in result["pairs"].items():
        for pair in pairs:
            adapter = pair["adapter"]
            lines.append(
                f"| {' vs '.join(pair['runs'])} | {adapter['differing']} of {adapter['tensors']} | "
                f"{adapter['max_abs_diff']:.3g} | {adapter['max_rel_diff']:.3g} | {adapter['worst'] or '–'} | "
                f"{', '.join(f'{loss:.6f}' for loss in pair['final_loss'])} | {pair['loss_max_abs_diff']:.3g} | "
                f"{pair['loss_first_differing_step'] or '–'} | {pair['grad_norm_first_differing_step'] or '–'} |")
    if "deterministic" not in result["pairs"]:  # `--only default`: nothing was asked to warn
        return "\n".join(lines) + "\n"
    lines += ["", "Operations torch warned have no deterministic implementation (deterministic runs; calls counted):"]
    warned = {op: count for ops in result["nondeterministic_ops"].values() for op, count in ops.items()}
    lines += [f"- {op} ({count})" for op, count in sorted(warned.items())] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value, applied to the benchmark's config")
    parser.add_argument("--out", type=Path, help="where reproducibility.json and .md are written")
    parser.add_argument("--work", type=Path, help="where the runs' adapters are kept (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode (each compared with the first)")
    parser.add_argument("--only", choices=list(MODES),
                        help="run this mode alone (default: both, with train.deterministic and without)")
    parser.add_argument("--train", nargs=2, metavar=("WORK", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train:
        train_one(Path(args.train[0]), args.train[1], args.deterministic)
        return 0
    if args.out is None or args.repeats < 2:
        parser.error("--out is needed, and --repeats of 2 or more")
    config = bench_config(args.overrides)
    with TemporaryDirectory(prefix="reproducibility-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        result = benchmark(config, work, args.repeats, [args.only] if args.only else MODES)
    command = command_line("reproducibility.py", sys.argv[1:] if argv is None else argv)
    result["command"] = command
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "reproducibility.json", json.dumps(result, indent=1) + "\n")
    text = markdown(result, command)
    write_text_atomic(args.out / "reproducibility.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
