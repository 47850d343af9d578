"""How much of a grid's time goes to evaluation, and to starting it: the matched SmolLM2 grid
(`configs/grids/replication_matched.yaml`, Figure 3 off) on one GPU, run by one checkout of the code, then each trial's
run, evaluation, start-up and decoding seconds and the grid's shares, for one or more such runs side by side (before
and after a change).

Next GPU session (issue 49 item 3): the current main first, then branch i49c (the evaluation in fixed shapes: one
batch size a decoding, static batches and graphs kept across calls, captured at the actor's start), one `run` call
each. A side of one seed is 4 trials at a fifth of the H200 each, the base model's evaluation and the three trainings
at once; that it fits the 10 minutes a command may take is not yet measured. A device call carries the checkout's
files, not its branches: export i49c into an untracked folder of the checkout first and give that folder as `--code`:

    git archive --prefix=sides/i49c/ i49c | tar -x                     # here, in the worktree
    python bench/eval_share.py run --out /tmp/share/main --model-path FOLDER
    python bench/eval_share.py run --code sides/i49c --out /tmp/share/i49c --model-path FOLDER
    python bench/eval_share.py show /tmp/share/main /tmp/share/i49c > bench/results/eval_share_h200.md

FOLDER: the SmolLM2-135M-Instruct GGUF's folder (`model.path`). `--seeds 0 1` runs 7 trials (5 at a time on one GPU
at the grid's `train.gpu_share` 0.2); extra arguments after `--` go to `clozemath run` as overrides
(`train.gpu_share=0.25`). Either checkout may lack the fixed shapes: the table needs only the runs' seconds and their
`eval/seconds`. The split of an evaluation's seconds into start-up (`eval/startup_s`: its request to the first actor
ready to decode) and decoding (`eval/decode_s`) differs between them: main's actor is ready once its model is loaded
and captures its graphs while it decodes (decoding seconds), i49c's captures them before it is ready (start-up
seconds). A side run by code older than these metrics shows its evaluation's seconds alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath.records import EVAL_SECONDS, EVAL_STARTUP_S  # noqa: E402

GRID = "configs/grids/replication_matched.yaml"
EXPERIMENT = "replication-matched"
WALL_FILE = "wall_s.txt"
"""In a side's folder: the `clozemath run` command's wall seconds."""


def run_side(code: Path, out: Path, model_path: str, seeds: list[int], overrides: list[str]) -> float:
    """The grid by the checkout `code` into `out` (its runs, MLflow store and console); the command's wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "clozemath_cli", "run", GRID, f"model.path={model_path}", "eval.every_share=null",
               f"axes.train.seed=[{','.join(map(str, seeds))}]", f"train.output_dir={out / 'runs'}",
               f"tracking.uri=sqlite:///{out / 'mlruns.db'}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(code)}
    started = time.monotonic()
    with (out / "console.txt").open("w") as console:
        done = subprocess.run(command, cwd=code, env=env, stdout=console, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - started
    (out / WALL_FILE).write_text(f"{wall:.1f}\n")
    if done.returncode:
        raise SystemExit(f"clozemath run failed ({done.returncode}): {out / 'console.txt'}")
    return wall


def shares(folder: Path) -> tuple[str, str]:
    """A side's line (its wall time, trials' time, the shares evaluating and starting to) and its time table."""
    from clozemath.report.runs import grid_runs
    from clozemath.report.tables import evaluation_time_table, timed_trials

    parent, trials = grid_runs(f"sqlite:///{folder / 'mlruns.db'}", EXPERIMENT)
    wall_file = folder / WALL_FILE
    wall = float(wall_file.read_text()) if wall_file.is_file() else \
        (parent.info.end_time - parent.info.start_time) / 1000
    timed = timed_trials(trials)
    run = sum(t.seconds or 0.0 for t in timed)
    evaluating = sum(t.metrics[EVAL_SECONDS] for t in timed)
    starting = [t.metrics[EVAL_STARTUP_S] for t in timed if EVAL_STARTUP_S in t.metrics]
    startup = f"{sum(starting) / run:.0%} ({max(starting):.0f} s at most)" if starting else "–"
    line = (f"| {folder.name} | {wall:.0f} | {len(timed)} | {run:.0f} | {evaluating / run:.0%} | {startup} |"
            if run else f"| {folder.name} | {wall:.0f} | 0 | – | – | – |")
    return line, evaluation_time_table(trials)


def show(folders: list[Path]) -> str:
    lines = ["**Evaluation's share of the matched SmolLM2 grid** (one GPU; trials' time: their runs' seconds summed)",
             "", "| Side | Command wall s | Trials | Trials' s | Evaluating | Starting evaluations |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    tables = []
    for folder in folders:
        line, table = shares(folder)
        lines.append(line)
        tables += ["", f"### {folder.name}", "", table]
    return "\n".join(lines + tables)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    side = commands.add_parser("run", help="run the grid with one checkout of the code, then show it")
    side.add_argument("--code", type=Path, default=ROOT, help="the checkout that runs it (default: this one)")
    side.add_argument("--out", type=Path, required=True)
    side.add_argument("--model-path", required=True, help="the SmolLM2-135M-Instruct GGUF's folder")
    side.add_argument("--seeds", type=int, nargs="+", default=[0])
    side.add_argument("overrides", nargs="*", help="after --: more `clozemath run` overrides")
    shown = commands.add_parser("show", help="the shares of sides already run")
    shown.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "run":
        run_side(args.code.resolve(), args.out.resolve(), args.model_path, args.seeds, args.overrides)
        print(show([args.out]))
    else:
        print(show(args.folders))


if __name__ == "__main__":
    main()
