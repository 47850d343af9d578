"""Where ZeRO-3's time goes: `clozemath.train.loop.train` on N processes (one per GPU, or gloo on CPU), ZeRO-2 or
ZeRO-3 with this repository's settings (`after`: `clozemath.train.zero.zero3_settings`, a decoder layer gathered at a
time, the next prefetched), two variants of it (`efficient-linear`: DeepSpeed's memory-efficient linear;
`persistent`: the trained tensors persistent and no room to prefetch, as until the evening of 2026-11-28) or
DeepSpeed's defaults as the loop used them before issue 28 (`before`: `{"stage": 3}` alone), on synthetic packed rows.
Prints each setting's median step, tokens/s and peak memory, and writes rank 0's profile of 3 steps (the costliest
operations on the GPU and on the host, the all-gathers' count and time, a Chrome trace).

    python bench/zero3_profile.py --gpus 2 --model smollm2-135m --path <folder of the GGUF> --runs zero2,before,after
    python bench/zero3_profile.py --gpus 2 --model llama-3.1-8b-random --pack-tokens 8192 --runs zero2,after
    python bench/zero3_profile.py --gpus 2 --model tiny-llama --pack-tokens 256 --steps 4 --runs before,after  # CPU

`--compile on` compiles the decoder layers under ZeRO-3 too (the trap issue 28 names: DeepSpeed's gather hooks sit
on the layers; `clozemath.train.compilation.compile_decoder_layers` keeps them out of the compiled code).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RUNS = {"zero2": 2, "before": 3, "after": 3, "efficient-linear": 3, "persistent": 3}
PROFILED = 3


def before(config: dict[str, Any], _model: torch.nn.Module) -> dict[str, Any]:
    """The engine config the loop built before issue 28 for ZeRO-3: the stage alone, DeepSpeed's defaults."""
    return {**config, "zero_optimization": {"stage": 3}}


def efficient_linear(config: dict[str, Any], _model: torch.nn.Module) -> dict[str, Any]:
    """`after` with DeepSpeed's `memory_efficient_linear` (its default, and this repository's until 2026-11-28): its
    `zero3_linear_wrap` looks up each weight's `ds_id`, a guard Dynamo recompiled on once per layer (torch 2.11)."""
    return {**config, "zero_optimization": {**config["zero_optimization"], "memory_efficient_linear": True}}


def persistent(config: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """`after` as it was on 2026-11-28 before the prefetch settings: the trained parameters (LoRA's, the token rows) and
    everything smaller persistent, and no room among the live parameters for the vocabulary matrices the fused loss
    holds (so nothing was prefetched). 576 all-gathers a step on the 8B shape against 62."""
    from clozemath.train.zero import vocabulary_elements

    zero = config["zero_optimization"]
    largest_trained = max(p.numel() for p in model.parameters() if p.requires_grad)
    return {**config, "zero_optimization": {**zero, "stage3_param_persistence_threshold": largest_trained + 1,
                                            "stage3_max_live_parameters": zero["stage3_max_live_parameters"]
                                            - vocabulary_elements(model)}}


VARIANTS = {"before": before, "efficient-linear": efficient_linear, "persistent": persistent}


def worker(rank: int, args: argparse.Namespace, run: str, port: int, out: Path) -> None:
    import clozemath.train.loop as loop
    import clozemath.train.step as step
    from clozemath.config import ExperimentConfig, MethodConfig, ModelConfig, TrainConfig
    from clozemath.model.load import load_model
    from clozemath.safe_yaml import read_yaml
    from train_throughput import synthetic_rows

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.gpus), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    model = ModelConfig.model_validate(read_yaml(ROOT / "configs" / "models" / f"{args.model}.yaml"))
    if args.path:
        model = model.model_copy(update={"path": args.path})
    config = ExperimentConfig(
        name=f"zero3-profile-{run}", model=model,
        method=MethodConfig(name="clozemath", objectives=["lm", "cloze"], attention="prefix_lm"),
        train=TrainConfig(zero_stage=RUNS[run], pack_tokens=args.pack_tokens, compile=args.compile == "on",
                          max_steps=args.warmup + PROFILED + args.steps + 1, checkpoint_every=10**9,
                          grad_accum=args.grad_accum, use_gpu=gpu),
    )
    torch.manual_seed(0)
    loaded = load_model(config.model, num_sentinels=8, device=device)
    if run in VARIANTS:
        built, variant = step.deepspeed_config, VARIANTS[run]
        step.deepspeed_config = lambda *a, **k: variant(built(*a, **k), loaded.model)
    rows = synthetic_rows(4 * args.pack_tokens // 150 * (args.steps + args.warmup + PROFILED + 2), 150, 0.66,
                          seed=rank)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    profiler = torch.profiler.profile(activities=activities, schedule=torch.profiler.schedule(
        wait=args.warmup, warmup=0, active=PROFILED, repeat=1))
    steps: list[dict[str, float]] = []

    def report(metrics: Any, _checkpoint: Path | None) -> None:
        steps.append({"seconds": metrics.seconds, "tokens_per_s": metrics.tokens_per_s,
                      "peak_gib": metrics.peak_memory_gib})
        profiler.step()

    with profiler:
        loop.train(loaded.model, rows, config, specials=loaded.specials, pad_id=loaded.tokenizer.pad_token_id,
                   report=report)
    if rank != 0:
        return
    timed = steps[args.warmup + PROFILED:-1]
    summary = {
        "run": run, "gpus": args.gpus, "model": args.model, "pack_tokens": args.pack_tokens, "compile": args.compile,
        "first_step_s": steps[0]["seconds"], "median_step_s": statistics.median(s["seconds"] for s in timed),
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
        "peak_gib": max(s["peak_gib"] for s in steps),
    }
    averages = profiler.key_averages()
    # the collective's own op: the NCCL kernel and the record_param_comms rows below it would count each call again
    gathers = [e for e in averages if e.key.startswith("c10d::") and "allgather" in e.key]
    summary["all_gather_calls_per_step"] = sum(e.count for e in gathers) / PROFILED
    sort = "self_device_time_total" if gpu else "self_cpu_time_total"
    (out / f"{run}.txt").write_text(
        json.dumps(summary, indent=1) + "\n\n"
        + averages.table(sort_by=sort, row_limit=30, max_name_column_width=70) + "\n\nThe host's side:\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    )
    profiler.export_chrome_trace(str(out / f"{run}.trace.json"))
    print(json.dumps(summary), flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="processes (one per GPU; gloo on CPU)")
    parser.add_argument("--model", default="smollm2-135m", help="a name in configs/models (default: %(default)s)")
    parser.add_argument("--path", help="override the model config's path (e.g. where the SmolLM2 GGUF lies)")
    parser.add_argument("--pack-tokens", type=int, default=8192)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--compile", choices=("on", "off"), default="off")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the profiled ones")
    parser.add_argument("--runs", default="zero2,before,after", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=Path("zero3_profile"), help="folder for the profiles")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for run in args.runs.split(","):
        if run not in RUNS:
            parser.error(f"unknown run '{run}' (known: {', '.join(RUNS)})")
        started = time.perf_counter()
        torch.multiprocessing.spawn(worker, args=(args, run, free_port(), args.out), nprocs=args.gpus, join=True)
        print(f"{run}: {time.perf_counter() - started:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
