"""From stage 1 to stage 2 of the matched-compute replication: each method's learning rate, the one with the best
accuracy on the problems the sweep held out, written into the grids that train at it.

    python lease/choose_lrs.py --experiment replication-matched-lr \
        --grids configs/grids/replication_matched.yaml configs/grids/table4.yaml [--tracking-uri sqlite:///mlruns.db]
    python lease/choose_lrs.py --trials bench/results/<slices>/rates-*/trials.json --grids ...

It reads the sweep's latest grid run (`clozemath.report.grid_runs`), or the `trials.json` files that `clozemath
report` wrote for its parts (a sweep run in slices, each a grid run of its own): per trial its method (tag), rate
(param `train.lr`) and held-out accuracy (`--metric`, default the sweep's `eval/gsm8k/greedy/accuracy`). A rate's
accuracy is the mean over the seeds that trained it. Per method it takes the best rate; a tie goes to the lower rate.
In each grid the rule `- {when: {method: M}, set: {train.lr: ...}}` gets
that rate and a comment with the sweep's accuracies (the grids then record the rates they ran at: commit them); a
rule for a method the sweep lacks is an error, and nothing is written. It prints the choices as a markdown table
(also to `--out`), with a warning where the best rate is the sweep's highest or lowest.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath.errors import ClozeMathError  # noqa: E402
from clozemath.files import write_text_atomic  # noqa: E402
from clozemath.records import METHOD_TAG, eval_metric  # noqa: E402
from clozemath.report import grid_runs  # noqa: E402

RATE_RULE = re.compile(
    r"^(?P<head>\s*- \{when: \{method: (?P<method>[\w-]+)\}, set: \{train\.lr: )[^}]*(?P<tail>\}\})(?P<comment>.*)$"
)
"""A grid's one-line rule setting one method's rate (how the replication's grids write them)."""

Sweep = dict[str, dict[float, list[float]]]
"""Method -> rate -> held-out accuracy of each seed."""


def rate_text(rate: float) -> str:
    """A rate as YAML reads it back as a number (`3.0e-4`: PyYAML wants a decimal point and a signed exponent)."""
    mantissa, exponent = f"{rate:e}".split("e")
    mantissa = mantissa.rstrip("0")
    return f"{mantissa}{'0' if mantissa.endswith('.') else ''}e{int(exponent)}"


Trial = tuple[dict[str, str], dict[str, str], dict[str, float]]
"""A trial's tags, params and metrics."""


def sweep_of(trials: list[Trial], metric: str, where: str) -> Sweep:
    """The accuracies of the trials that have a rate and `metric`, by method and rate."""
    sweep: Sweep = defaultdict(lambda: defaultdict(list))
    for tags, params, metrics in trials:
        if metric in metrics and "train.lr" in params:
            sweep[tags[METHOD_TAG]][float(params["train.lr"])].append(metrics[metric])
    if not sweep:
        raise ClozeMathError(f"{where}: no trial has a rate and '{metric}'")
    return {method: dict(rates) for method, rates in sweep.items()}


def read_sweep(tracking_uri: str, experiment: str, metric: str) -> Sweep:
    _, trials = grid_runs(tracking_uri, experiment)
    return sweep_of([(t.tags, t.params, t.metrics) for t in trials], metric, f"experiment '{experiment}'")


def read_trials_files(paths: list[Path], metric: str) -> Sweep:
    """The trials of `clozemath report`'s trials.json files (a trial in two of them counts once)."""
    trials: dict[str, Trial] = {}
    for path in paths:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ClozeMathError(f"{path}: not a trials.json file ({exc})") from None
        for row in rows:
            trials[row["run_name"]] = (row["tags"], row["params"], row["metrics"])
    return sweep_of(list(trials.values()), metric, ", ".join(map(str, paths)))


def best_rate(accuracies: dict[float, list[float]]) -> float:
    """The rate of the best mean accuracy over its seeds; of equal ones, the lowest rate."""
    return min(accuracies, key=lambda rate: (-statistics.fmean(accuracies[rate]), rate))


def _accuracies(accuracies: dict[float, list[float]]) -> str:
    def one(rate: float) -> str:
        seeds = accuracies[rate]
        return f"{rate_text(rate)} {100 * statistics.fmean(seeds):.1f}%" + (f" (mean of {len(seeds)})" if len(seeds) > 1 else "")

    return ", ".join(one(rate) for rate in sorted(accuracies))


def rewritten(text: str, sweep: Sweep, where: str) -> tuple[str, list[str]]:
    """The grid's text with each method's rate rule set to the sweep's best; and the methods it set."""
    lines, methods = [], []
    for line in text.splitlines(keepends=True):
        found = RATE_RULE.match(line.rstrip("\n"))
        if found is None:
            lines.append(line)
            continue
        method = found["method"]
        if method not in sweep:
            raise ClozeMathError(f"{where}: a rate rule for '{method}', which the sweep did not train "
                                 f"(it trained: {', '.join(sorted(sweep))})")
        rate = best_rate(sweep[method])
        comment = f"  # held out: {_accuracies(sweep[method])} (lease/choose_lrs.py)"
        lines.append(f"{found['head']}{rate_text(rate)}{found['tail']}{comment}\n")
        methods.append(method)
    return "".join(lines), methods


def choices_table(sweep: Sweep) -> str:
    lines = ["| Method | rate chosen | held-out accuracy by rate |", "| --- | ---: | --- |"]
    for method in sorted(sweep):
        rates = sweep[method]
        chosen = best_rate(rates)
        at_edge = len(rates) > 1 and chosen in (min(rates), max(rates))
        edge = " (the sweep's edge: a rate beyond it might do better)" if at_edge else ""
        lines.append(f"| {method} | {rate_text(chosen)}{edge} | {_accuracies(rates)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--experiment", help="the sweep's MLflow experiment (its latest grid run)")
    source.add_argument("--trials", nargs="+", type=Path, help="the sweep's trials.json files (`clozemath report`)")
    parser.add_argument("--grids", nargs="+", required=True, type=Path, help="grid YAML files to write the rates into")
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns.db")
    parser.add_argument("--metric", default=eval_metric("gsm8k", "greedy", "accuracy"))
    parser.add_argument("--out", type=Path, help="also write the choices (markdown) here")
    args = parser.parse_args(argv)
    try:
        sweep = (read_trials_files(args.trials, args.metric) if args.trials
                 else read_sweep(args.tracking_uri, args.experiment, args.metric))
        texts = {}
        for grid in args.grids:
            if not grid.is_file():
                raise ClozeMathError(f"{grid}: no such grid file")
            texts[grid], methods = rewritten(grid.read_text(encoding="utf-8"), sweep, str(grid))
            if not methods:
                raise ClozeMathError(f"{grid}: no rule `- {{when: {{method: M}}, set: {{train.lr: ...}}}}` to set")
    except ClozeMathError as exc:
        print(f"choose_lrs: error: {exc}", file=sys.stderr)
        return 2
    for grid, text in texts.items():  # every grid checked before any is written
        write_text_atomic(grid, text)
    table = choices_table(sweep)
    if args.out is not None:
        write_text_atomic(args.out, table + "\n")
    print(table)
    print(f"written: {', '.join(map(str, texts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
