"""A grid's trials laid on a cluster's GPUs as Tune starts them, its totals, and the dry-run's printout."""

from __future__ import annotations

import heapq
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from clozemath.cost.throughput import Card, Throughput
from clozemath.cost.trials import Estimator, TrialCost
from clozemath.errors import ClozeMathError
from clozemath.plan import RunPlan, trial_labels
from clozemath.records import trial_run_names


@dataclass(frozen=True)
class Scheduled:
    trial: TrialCost
    start_s: float
    nodes: tuple[int, ...]


def schedule(trials: Sequence[TrialCost], nodes: int, gpus_per_node: float,
             max_concurrent: int | None = None) -> list[Scheduled]:
    """The trials in order, each started as soon as enough GPUs are free (on one node where it fits one; across
    nodes else) and fewer than `max_concurrent` trials run, as Tune starts a grid's trials."""
    free = [gpus_per_node] * nodes
    running: list[tuple[float, int, list[tuple[int, float]]]] = []  # (end, order, [(node, gpus)])
    now, placed = 0.0, []
    for order, trial in enumerate(trials):
        if trial.gpus > nodes * gpus_per_node + 1e-9:
            raise ClozeMathError(f"{trial.name}: needs {trial.gpus:g} GPUs, the cluster has {nodes * gpus_per_node:g}")
        while True:
            where = _place(free, trial.gpus)
            if where is not None and (max_concurrent is None or len(running) < max_concurrent):
                break
            end, _, held = heapq.heappop(running)
            now = max(now, end)
            for node, gpus in held:
                free[node] += gpus
        for node, gpus in where:
            free[node] -= gpus
        heapq.heappush(running, (now + trial.wall_s, order, where))
        placed.append(Scheduled(trial, now, tuple(node for node, _ in where)))
    return placed


def _place(free: list[float], need: float) -> list[tuple[int, float]] | None:
    """GPUs for a trial: the first node that holds it whole, else the nodes' free GPUs in turn."""
    for node, gpus in enumerate(free):
        if gpus + 1e-9 >= need:
            return [(node, need)]
    if sum(free) + 1e-9 < need:
        return None
    taken, left = [], need
    for node, gpus in enumerate(free):
        if gpus > 1e-9 and left > 1e-9:
            part = min(gpus, left)
            taken.append((node, part))
            left -= part
    return taken


@dataclass(frozen=True)
class GridEstimate:
    name: str
    card: Card
    nodes: int
    gpus_per_node: float
    scheduled: list[Scheduled]
    ray_start_s: float
    gguf_parse_s: float
    """Parsing the grid's GGUF models once, before their trials train."""
    notes: dict[str, str]
    counts: list[str]
    short_names: dict[str, str]
    """Each trial by what varies between the grid's points (`clozemath · seed 0`: `records.trial_run_names`)."""
    stand_ins: list[str]
    """The models whose tokens were counted with a stand-in tokenizer."""

    @property
    def wall_s(self) -> float:
        started = self.ray_start_s + self.gguf_parse_s
        return started + max((s.start_s + s.trial.wall_s for s in self.scheduled), default=0.0)

    @property
    def gpu_hours(self) -> float:
        return sum(s.trial.gpus * s.trial.wall_s for s in self.scheduled) / 3600


def estimate(plan: RunPlan, gpus: float, card_name: str, nodes: int = 1) -> GridEstimate:
    """The cost of `plan` on `nodes` nodes of `gpus / nodes` GPUs of `card_name` each."""
    table = Throughput(plan.root)
    card = table.card(card_name)
    estimator = Estimator(table, card, gpus / nodes)
    trials = [estimator.trial(config, plan.root) for config in plan.experiments]
    scheduled = schedule(trials, nodes, gpus / nodes, plan.grid.max_concurrent_trials)
    parse_s = estimator.gguf_parse_s([config.model for config in plan.experiments])
    labels = trial_labels(plan.grid)
    short_names = dict(zip(labels, trial_run_names(list(labels.values()), plan.grid.name)))
    return GridEstimate(plan.grid.name, card, nodes, gpus / nodes, scheduled, estimator.overhead_s("ray_start"),
                        parse_s, estimator.notes, estimator.counted(), short_names, sorted(estimator.stand_ins))


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{seconds / 60:.1f} min"


WIDTH = 120
"""Columns the dry-run's printout fits in (its `--details` tables excepted)."""
COUNTED = ("It counts each trial's training (its training set's tokens at its model's tokens/s measured on the card), "
           "its evaluation (its problems at the measured problems/s) and its fixed costs (workers' start, model loads, "
           "the first step), and Ray's start; the trials run in order, each as soon as its GPUs are free. "
           "--details: every trial's samples, steps, layout and start, and the figures used.")


def estimate_text(result: GridEstimate, details: bool = False, said: str = "") -> str:
    """The dry-run's printout: the totals first, what they count, a line per trial within `WIDTH` columns; with
    `details`, every trial's counts and layout and the figures behind them. `said`: a line on how the cluster was
    chosen (a machine without a GPU: the default card)."""
    cluster = f"{result.nodes} node{'s' if result.nodes > 1 else ''} of {result.gpus_per_node:g} x {result.card.name}"
    trials = len(result.scheduled)
    lines = [
        f"{result.name}: {trials} trial{'s' if trials > 1 else ''}, {result.gpu_hours:,.1f} GPU-hours, "
        f"{_duration(result.wall_s)} of wall time on {cluster} (an estimate: nothing was started)",
        *([said] if said else []),
        *textwrap.wrap(COUNTED, WIDTH),
        *(textwrap.wrap(f"The tokens of {', '.join(result.stand_ins)} are estimated with a stand-in tokenizer (theirs "
                        "is not on this machine).", WIDTH) if result.stand_ins else []),
        "",
        *_trials_table(result),
    ]
    if details:
        lines += ["", *_details(result, cluster)]
    return "\n".join(lines)


def _trials_table(result: GridEstimate) -> list[str]:
    """A line per trial, named by what varies (cut to fit `WIDTH`): its GPUs, steps, training, evaluation and wall
    time, and GPU-hours."""
    header = ["GPUs", "steps", "train", "eval", "wall", "GPU-h"]
    rows = []
    for placed in result.scheduled:
        trial, layout = placed.trial, placed.trial.layout
        rows.append([f"{trial.gpus:g}", f"{layout.steps.total_steps:,}" if layout else "-", _duration(trial.train_s),
                     _duration(trial.eval_s), _duration(trial.wall_s), f"{trial.gpus * trial.wall_s / 3600:.2f}"])
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    room = WIDTH - sum(widths) - 3 * len(widths) - 4
    names = [result.short_names.get(placed.trial.name, placed.trial.name) for placed in result.scheduled]
    name_width = max(5, min(room, max(map(len, names))))
    names = [name if len(name) <= name_width else name[: name_width - 1] + "…" for name in names]

    def line(name: str, cells: list[str]) -> str:
        return "| " + " | ".join([name.ljust(name_width), *(c.rjust(w) for c, w in zip(cells, widths))]) + " |"

    rule = "| " + " | ".join(["-" * name_width, *("-" * (w - 1) + ":" for w in widths)]) + " |"
    return [line("trial", header), rule, *(line(name, row) for name, row in zip(names, rows))]


def _details(result: GridEstimate, cluster: str) -> list[str]:
    """Every trial (by its full name) with its counts, layout and start; the totals' parts; the figures used."""
    rows = [
        "| trial | GPUs | samples | their tokens | steps | row | ZeRO | compiled | train | first step | eval | fixed | "
        "starts at | wall | GPU-h |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for placed in result.scheduled:
        trial, layout = placed.trial, placed.trial.layout
        steps = f"{layout.steps.total_steps:,}" if layout else "-"
        row = "-" if layout is None else (f"{layout.row_tokens:,}" if layout.row_tokens else "padded")
        compiled = "-" if layout is None else ("yes" if layout.compiled else "no")
        rows.append(
            f"| {trial.name} | {trial.gpus:g} | {trial.samples:,} | {trial.tokens / 1e6:.1f}M | {steps} | {row} | "
            f"{trial.stage or '-'} | {compiled} | {_duration(trial.train_s)} | {_duration(trial.first_step_s)} | "
            f"{_duration(trial.eval_s)} | {_duration(trial.fixed_s)} | {_duration(placed.start_s)} | "
            f"{_duration(trial.wall_s)} | {trial.gpus * trial.wall_s / 3600:.2f} |"
        )
    rows += [
        "",
        f"Total: {result.gpu_hours:,.1f} GPU-hours; wall time {_duration(result.wall_s)} on {cluster} "
        f"(Ray's start {result.ray_start_s:.0f} s, "
        + (f"the GGUF model(s) parsed once {result.gguf_parse_s:.0f} s, " if result.gguf_parse_s else "")
        + "then the trials in order, each as soon as its GPUs are free).",
        *(["Training sets counted: " + "; ".join(result.counts)] if result.counts else []),
        "Figures (configs/throughput.yaml):",
        *(f"- {what}: {how}" for what, how in result.notes.items()),
        "A compiled trial's first step is cold once per model, row size and stage, warm after (the compile cache that "
        "every trial and node shares: train.compile_cache). Evaluation runs on the trial's GPUs; its figures are of "
        "random weights, whose rows never stop before max_new_tokens: an upper bound for a trained model.",
    ]
    return rows
