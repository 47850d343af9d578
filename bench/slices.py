"""A plan of grids run in slices on a machine lent for a session at a time (issue 46: bench/slices_qwen1.5b.yaml).

A slice is some trials of one grid, picked by overrides that narrow its axes (`set`), run as a grid run of its own by
`bench/slice_lease.sh`. Its report (`clozemath report`: trials.json, steps.json.gz, predictions) is committed under the
plan's `results` folder; `clozemath report --from <slice> --from <slice> ...` reports the slices as one (the study's
tables, intervals, compute table, Figure 3 and steps, no store needed). A trial is finished once a trials.json there
holds its accuracy on every set and decoding it evaluates, at its learning rate; a slice is done when all of its trials
are. What is left of a slice runs again with its axes narrowed to the values its unfinished trials take (a finished
trial inside that product reruns too, and is named).

    python bench/slices.py [--plan FILE] list                 # every slice: its grid, trials and what is done
    python bench/slices.py [--plan FILE] describe SLICE       # key=value lines for the lease script
    python bench/slices.py [--plan FILE] estimate [--out MD]  # each slice's dry-run estimate, and the sessions
    python bench/slices.py [--plan FILE] unpack TARBALL...   # what a session brought back, into the results

The estimate is `clozemath run --dry-run`'s (`clozemath.cost.estimate`) for each slice on one card of the plan's kind,
less Ray's start and the GGUF parse, which a session pays once (with the machine's start, shipping the model and the
last collect: `session`), times the plan's `session.calibration` (what slices measured took over their dry-run);
the slices not yet done are then packed, in the plan's order, into sessions of the device time left. Beside each
estimate stands what the slice measured, read from its committed console. The estimates are saved in the results
folder (`estimates.json`), whence `describe` gives the lease script each slice's: a chain told its session's seconds
(`SESSION_S`) starts no slice that would not finish in them.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath.config import ExperimentConfig  # noqa: E402
from clozemath.errors import ClozeMathError  # noqa: E402
from clozemath.plan import GridPoint, RunPlan, grid_points, load_plan  # noqa: E402
from clozemath.records import ACCURACY, eval_metric  # noqa: E402
from clozemath.safe_yaml import read_yaml  # noqa: E402

PLAN = ROOT / "bench" / "slices_qwen1.5b.yaml"
TRIALS_FILE = "trials.json"
COMMITTED = ("report", "driver.log", "report.log")
"""What of a slice's tarball (`bench/slice_lease.sh collect`) is committed: its MLflow store and the workers' logs stay
out (the report folder reports the slice again without them)."""
ESTIMATES_FILE = "estimates.json"
"""In the plan's `results`: each slice's calibrated seconds, as `estimate` last made them."""


@dataclass(frozen=True)
class Slice:
    name: str
    grid: Path
    overrides: list[str]
    reserve: bool = False


@dataclass(frozen=True)
class Plan:
    results: Path
    card: str
    session: dict[str, float]
    slices: dict[str, Slice]

    def slice(self, name: str) -> Slice:
        if name not in self.slices:
            raise ClozeMathError(f"no slice '{name}' in the plan (slices: {', '.join(self.slices)})")
        return self.slices[name]


def read_plan(path: Path) -> Plan:
    raw = read_yaml(path)
    try:
        slices = {name: Slice(name, ROOT / entry["grid"], list(entry["set"]), bool(entry.get("reserve", False)))
                  for name, entry in raw["slices"].items()}
        return Plan(ROOT / raw["results"], raw["card"], dict(raw["session"]), slices)
    except (KeyError, TypeError) as exc:
        raise ClozeMathError(f"{path}: not a plan of slices (results, card, session, slices: grid, set): {exc}") \
            from None


def expected_metrics(config: ExperimentConfig) -> set[str]:
    """The accuracy of every set with each of its decodings: what a finished trial holds."""
    return {eval_metric(s.dataset, d, ACCURACY) for s in config.eval.sets for d in config.eval.decodings_of(s)}


def trial_rows(path: Path) -> list[dict[str, Any]]:
    """A committed trials.json's rows (`clozemath report`: run_id, run_name, params, metrics per trial)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ClozeMathError(f"{path}: not a trials.json file ({exc})") from None


def committed_metrics(results: Path) -> dict[tuple[str, str | None], set[str]]:
    """Every trial in the trials.json files under `results`, by name and learning rate, with the metrics it has (over
    all of them)."""
    found: dict[tuple[str, str | None], set[str]] = {}
    for path in sorted(results.rglob(TRIALS_FILE)) if results.is_dir() else []:
        for row in trial_rows(path):
            rate = row["params"].get("train.lr")
            name = row["params"].get("name") or row["run_name"]  # run names are readable since 2026-12-02
            found.setdefault((name, None if rate is None else repr(float(rate))), set()).update(
                row["metrics"])
    return found


def finished(config: ExperimentConfig, committed: dict[tuple[str, str | None], set[str]]) -> bool:
    """Whether the committed results hold every accuracy of this trial, trained at its rate (a grid's rates are
    chosen after its slices are planned: a trial run at another rate is not this one)."""
    return expected_metrics(config) <= committed.get((config.name, repr(float(config.train.lr))), set())


@dataclass(frozen=True)
class SliceTrials:
    plan: RunPlan
    points: list[GridPoint]
    finished: list[bool]

    def names(self) -> list[str]:
        return [config.name for config in self.plan.experiments]

    def left(self) -> list[GridPoint]:
        return [point for point, done in zip(self.points, self.finished) if not done]


def slice_trials(plan: Plan, piece: Slice) -> SliceTrials:
    """The slice's trials, each with whether the committed results finish it."""
    run_plan = load_plan(piece.grid, piece.overrides)
    points = grid_points(run_plan.grid, piece.grid)
    committed = committed_metrics(plan.results)
    return SliceTrials(run_plan, points, [finished(config, committed) for config in run_plan.experiments])


def flow(values: list[Any]) -> str:
    """Values as a YAML flow list that reads back as the same values (`5.0e-05`, not the string `5e-05`)."""
    return yaml.safe_dump(values, default_flow_style=True, width=1 << 16).strip()


def narrowed(piece: Slice, trials: SliceTrials) -> tuple[list[str], list[str]]:
    """The overrides that run what is left of the slice: its own, then each axis that the unfinished trials take
    fewer values of narrowed to those; and the finished trials those overrides run again (inside that product)."""
    left = trials.left()
    axes = list(trials.plan.grid.axes)
    values = {axis: list(dict.fromkeys(point.labels[axis] for point in left)) for axis in axes}
    every = {axis: {point.labels[axis] for point in trials.points} for axis in axes}
    rerun = [name for name, point, done in zip(trials.names(), trials.points, trials.finished)
             if done and all(point.labels[axis] in values[axis] for axis in axes)]
    narrower = [f"axes.{axis}={flow(values[axis])}" for axis in axes if set(values[axis]) != every[axis]]
    return [*piece.overrides, *narrower], rerun


def report_decoding(configs: list[ExperimentConfig]) -> str:
    """The decoding a slice's report tables: beam where its trials decode with it."""
    decodings = {d for config in configs for s in config.eval.sets for d in config.eval.decodings_of(s)}
    return "beam" if "beam" in decodings else "greedy"


def describe(plan: Plan, name: str) -> str:
    """What `bench/slice_lease.sh` needs to run a slice: its grid, experiment, report decoding, trials, and the
    overrides of what is left (none when it is done)."""
    piece = plan.slice(name)
    trials = slice_trials(plan, piece)
    configs = trials.plan.experiments
    lines = [f"grid={piece.grid.relative_to(ROOT)}", f"experiment={configs[0].tracking.experiment}",
             f"decoding={report_decoding(configs)}", f"trials={len(configs)}", f"todo={len(trials.left())}"]
    if trials.left():
        overrides, rerun = narrowed(piece, trials)
        lines += [f"override={override}" for override in overrides] + [f"rerun={name}" for name in rerun]
        seconds = read_estimates(plan).get(name)
        lines += [] if seconds is None else [f"estimate_s={seconds}"]  # the whole slice's: what is left takes less
    return "\n".join(lines)


def run_ids(path: Path) -> set[str]:
    try:
        return {row["run_id"] for row in trial_rows(path)}
    except (KeyError, TypeError) as exc:
        raise ClozeMathError(f"{path}: not a trials.json file ({exc!r} in a row)") from None


def holding(plan: Plan, name: str, ids: set[str]) -> Path | None:
    """The part of the slice already committed that holds every one of these trials, if any."""
    for folder in [plan.results / name, *sorted(plan.results.glob(f"{name}-[0-9]*"))]:
        path = folder / "report" / TRIALS_FILE
        if path.is_file() and ids <= run_ids(path):
            return folder
    return None


def part_folder(plan: Plan, name: str) -> Path:
    """Where a slice's next part goes: `<slice>/`, or `<slice>-2/`, `<slice>-3/`... beside the parts there."""
    folder, part = plan.results / name, 1
    while folder.exists():
        part += 1
        folder = plan.results / f"{name}-{part}"
    return folder


def unpack(plan: Plan, tarball: Path) -> str:
    """A slice's tarball as `bench/slice_lease.sh collect` brings it back (`<slice>.tar.gz`), into the plan's results
    (`part_folder`): its report and consoles (`COMMITTED`), the predictions exported again compact at the slice's
    decoding (the full generations would cost every later call what it carries: the tree travels with each). Unpacked
    beside the results first and moved in whole, so a tarball that is not a slice's, or one whose trials a committed
    part of the slice all holds (unpacked twice), leaves nothing behind."""
    from clozemath.report.command import write_report

    name = tarball.name.removesuffix(".tar.gz")
    piece = plan.slice(name)
    decoding = report_decoding(load_plan(piece.grid, piece.overrides).experiments)
    plan.results.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=plan.results, prefix=f".{name}."))
    try:
        try:
            with tarfile.open(tarball) as archive:
                members = [m for m in archive.getmembers() if next(iter(Path(m.name).parts), "") in COMMITTED]
                archive.extractall(staging, members=members, filter="data")
        except (OSError, tarfile.TarError) as exc:
            raise ClozeMathError(f"{tarball}: not a slice's tarball ({exc})") from None
        report = staging / "report"
        if not (report / TRIALS_FILE).is_file():
            raise ClozeMathError(f"{tarball}: no report/{TRIALS_FILE} in it (the slice's report had not been written "
                                 "when it was collected: collect again, or report its mlruns.db.gz)")
        before = holding(plan, name, run_ids(report / TRIALS_FILE))
        if before is not None:
            raise ClozeMathError(f"{tarball}: its trials are all in {before.relative_to(plan.results.parent)} already "
                                 "(unpacked before); nothing written")
        made = write_report([], out=report, decoding=decoding, export="compact", folders=[report])
        folder = part_folder(plan, name)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return f"{tarball.name} -> {folder.relative_to(plan.results.parent)}: {len(made.trials)} trials, {decoding}"


def listing(plan: Plan) -> str:
    rows = ["| slice | grid | trials | finished |", "| --- | --- | ---: | ---: |"]
    for piece in plan.slices.values():
        trials = slice_trials(plan, piece)
        reserve = " (reserve)" if piece.reserve else ""
        rows.append(f"| {piece.name}{reserve} | {piece.grid.name} | {len(trials.points)} | "
                    f"{sum(trials.finished)} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class SliceEstimate:
    piece: Slice
    trials: int
    seconds: float
    """The slice's wall time on one card, less Ray's start and the GGUF parse: the dry-run's times the plan's
    `session.calibration` (what slices measured took over what the dry-run said)."""
    once_s: float
    """Ray's start and the GGUF parse: once a session (the plan's `session.once_s` where measured, else the
    dry-run's)."""
    dry_run_s: float | None = None
    """The dry-run's figure, before the calibration."""
    measured_s: float | None = None
    """What its grid runs took, from the committed consoles (`<slice>/driver.log`, `<slice>-2/driver.log`...)."""
    done: bool = False
    """Every trial finished in the committed results: in no session."""


RUN_EXIT = re.compile(r"^\[[0-9:]+\] exit \d+ after (\d+) s$")
"""bench/slice_lease.sh's line after the grid's run, in the slice's driver.log."""


def measured_seconds(plan: Plan, name: str) -> float | None:
    """The seconds of the slice's grid runs (its first part and any `<slice>-N` rerun of what was left), or None."""
    found = []
    for log in [plan.results / name / "driver.log", *sorted(plan.results.glob(f"{name}-[0-9]*/driver.log"))]:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []
        found += [float(m.group(1)) for m in map(RUN_EXIT.match, lines) if m][-1:]
    return sum(found) if found else None


def estimate_slice(plan: Plan, piece: Slice) -> SliceEstimate:
    from clozemath.cost import estimate

    result = estimate(load_plan(piece.grid, piece.overrides), 1, plan.card)
    once = result.ray_start_s + result.gguf_parse_s
    dry = result.wall_s - once
    done = all(slice_trials(plan, piece).finished)
    once = plan.session.get("once_s", once)  # what a session pays once, where measured
    return SliceEstimate(piece, len(result.scheduled), dry * plan.session.get("calibration", 1.0), once, dry,
                         measured_seconds(plan, piece.name), done)


def save_estimates(plan: Plan, estimates: list[SliceEstimate]) -> Path:
    """Each slice's calibrated seconds into the plan's `ESTIMATES_FILE` (beside the entries of slices not estimated
    now), where `describe` reads them: a chain given its session's seconds skips a slice that would not finish in
    them (the estimate is ~25 s of CPU a slice: too slow to make on the device while the card waits)."""
    path = plan.results / ESTIMATES_FILE
    saved = read_estimates(plan)
    saved.update({e.piece.name: round(e.seconds) for e in estimates})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_estimates(plan: Plan) -> dict[str, int]:
    path = plan.results / ESTIMATES_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as exc:
        raise ClozeMathError(f"{path}: not an estimates file ({exc}); `bench/slices.py estimate` writes it") from None


def sessions(plan: Plan, estimates: list[SliceEstimate]) -> tuple[float, list[list[SliceEstimate]]]:
    """The seconds a session leaves for slices, and the slices still to run (not the reserve, not those done) packed
    into sessions in order."""
    once = max((e.once_s for e in estimates), default=0.0)
    session = plan.session
    window = session["device_s"] - session["start_s"] - session["ship_s"] - session["collect_s"] - once
    packed: list[list[SliceEstimate]] = []
    for e in (e for e in estimates if not e.piece.reserve and not e.done):
        if packed and sum(x.seconds for x in packed[-1]) + e.seconds <= window:
            packed[-1].append(e)
        else:
            packed.append([e])
    return window, packed


def counted(n: int, noun: str) -> str:
    """`1 slice`, `3 slices`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def estimate_text(plan: Plan, estimates: list[SliceEstimate]) -> str:
    window, packed = sessions(plan, estimates)
    minutes = lambda seconds: f"{seconds / 60:.1f}"  # noqa: E731
    session_of = {e.piece.name: index + 1 for index, group in enumerate(packed) for e in group}
    calibration = plan.session.get("calibration", 1.0)
    rows = [f"| slice | grid | trials | dry-run (min) | estimate (min, x{calibration:g}) | measured (min) | session |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for e in estimates:
        where = "reserve" if e.piece.reserve else "done" if e.done else str(session_of[e.piece.name])
        over = " (over a session)" if e.seconds > window and not e.done else ""
        dry = "-" if e.dry_run_s is None else minutes(e.dry_run_s)
        measured = "-" if e.measured_s is None else minutes(e.measured_s)
        rows.append(f"| {e.piece.name} | {e.piece.grid.name} | {e.trials} | {dry} | {minutes(e.seconds)}{over} | "
                    f"{measured} | {where} |")
    planned = [e for e in estimates if not e.piece.reserve and not e.done]
    reserve = [e for e in estimates if e.piece.reserve]
    once = max((e.once_s for e in estimates), default=0.0)
    overhead = plan.session["device_s"] - window
    rows += [
        "",
        f"Left to run: {minutes(sum(e.seconds for e in planned))} min ({counted(len(planned), 'slice')}, "
        f"{counted(sum(e.trials for e in planned), 'trial')}); "
        f"done: {counted(sum(e.done for e in estimates), 'slice')}; "
        f"reserve {minutes(sum(e.seconds for e in reserve))} min.",
        f"A session of {minutes(plan.session['device_s'])} min leaves {minutes(window)} min for slices: the machine's "
        f"start {minutes(plan.session['start_s'])}, shipping {minutes(plan.session['ship_s'])}, Ray's start and the "
        f"GGUF parse {minutes(once)}, the last collect {minutes(plan.session['collect_s'])}.",
        f"Sessions: {len(packed)} (device time {minutes(len(packed) * plan.session['device_s'])} min at most; "
        f"{minutes(sum(e.seconds for e in planned) + len(packed) * overhead)} min if each ends with its last "
        "slice); " + "; ".join(f"{i + 1}: {', '.join(e.piece.name for e in group)}" for i, group in enumerate(packed))
        + "." if packed else "Sessions: none; every planned slice is done.",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, default=PLAN, help=f"default: {PLAN.relative_to(ROOT)}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every slice, its trials and how many are finished")
    one = commands.add_parser("describe", help="a slice's grid, experiment and the overrides of what is left")
    one.add_argument("slice")
    cost = commands.add_parser("estimate", help="each slice's dry-run estimate, and the sessions they need")
    cost.add_argument("slices", nargs="*", help="default: every slice")
    cost.add_argument("--out", type=Path, help="also write the table here")
    back = commands.add_parser("unpack", help="slices' tarballs (bench/slice_lease.sh collect) into the results")
    back.add_argument("tarballs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        plan = read_plan(args.plan)
        if args.command == "list":
            text = listing(plan)
        elif args.command == "describe":
            text = describe(plan, args.slice)
        elif args.command == "unpack":
            text = "\n".join(unpack(plan, tarball) for tarball in args.tarballs) + "\n" + listing(plan)
        else:
            names = args.slices or list(plan.slices)
            estimates = [estimate_slice(plan, plan.slice(name)) for name in names]
            text = estimate_text(plan, estimates)
            save_estimates(plan, estimates)
            if args.out is not None:
                args.out.write_text(text + "\n", encoding="utf-8")
    except ClozeMathError as exc:
        print(f"slices: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
