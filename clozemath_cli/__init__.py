"""The `clozemath` command. Each subcommand parses its arguments here and calls one function elsewhere: in
`clozemath` (the science, Ray-free) or in `ray_jobs` (the commands that start Ray jobs). It sits above both, outside
the `clozemath` package, which never imports Ray. Run it as `clozemath ...` or `python -m clozemath_cli ...`."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from clozemath import console, interrupts
from clozemath.data.training_sets import training_set_names
from clozemath.errors import ClozeMathError
from clozemath.eval.decoding import decoding_names

if TYPE_CHECKING:
    from clozemath.config import ExperimentConfig
    from clozemath.plan import RunPlan

Handler = Callable[[argparse.Namespace], int | None]

DESCRIPTION = """Fine-tune open LLMs for math reasoning with ClozeMath (equation infilling + PrefixLM) and the
baselines it is compared with, evaluate them, and report the paper's tables with intervals you can trust."""
EPILOG = """getting started:
  clozemath ls                                        what can be run: models, methods, grids, sets, decodings
  clozemath config configs/experiments/quickstart.yaml    the resolved config of a grid's trials (or an experiment)
  clozemath run configs/experiments/quickstart.yaml   train and evaluate (add key=value overrides, --dry-run to cost)
  clozemath report --experiment quickstart            results, intervals, the paper's tables
  clozemath generate configs/experiments/quickstart.yaml -q "Tom has 3 apples..."   ask the trained model
  clozemath export configs/experiments/quickstart.yaml --out merged/  the adapter merged into a Hugging Face folder
A grid on a Ray cluster: ray job submit --working-dir . -- clozemath run configs/grids/<grid>.yaml"""



def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="pass through everything Ray, Tune, DeepSpeed and transformers print (by default it goes to the run's "
        "logs/ folder and the console shows phases, progress bars and a summary)",
    )


def _add_data(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="inspect and generate data")
    sub = data.add_subparsers(dest="data_command", required=True)

    stats = sub.add_parser("stats", help="segmentation and sample counts of a dataset split")
    stats.add_argument("--dataset", required=True, choices=training_set_names())
    stats.add_argument("--split", default="train")
    stats.add_argument("--path", help="a JSONL file or folder (default: $CLOZEMATH_DATA_DIR/<dataset>/)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(handler=_data_stats)

    symbolic = sub.add_parser("gsm-symbolic", help="instantiate the GSM-Symbolic templates into a JSONL file")
    symbolic.add_argument("--variant", required=True, choices=["symbolic", "p1", "p2"])
    symbolic.add_argument("--per-template", type=int, default=50, help="instances per template (default: 50)")
    symbolic.add_argument("--seed", type=int, default=0)
    symbolic.add_argument("--out", required=True, help="the JSONL file to write")
    symbolic.add_argument(
        "--templates", help="folder holding <variant>/*.json (default: $CLOZEMATH_DATA_DIR/gsm_symbolic/templates)"
    )
    symbolic.set_defaults(handler=_data_gsm_symbolic)


def _data_stats(args: argparse.Namespace) -> None:
    from clozemath.data.stats import print_stats

    print_stats(args.dataset, args.split, args.path, as_json=args.json)


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="train and evaluate an experiment or a grid on Ray Tune (locally, or on the cluster at RAY_ADDRESS); "
        "run again with the same config to resume an interrupted grid",
    )
    run.add_argument("config", help="an experiment YAML (a grid of one) or a grid YAML (configs/grids/)")
    run.add_argument(
        "overrides", nargs="*", metavar="key=value",
        help="dotted config overrides (of a grid's base; `axes.<axis>=[...]` narrows an axis)",
    )
    _add_verbose(run)
    run.add_argument(
        "--dry-run", action="store_true",
        help="start nothing: print each trial's samples, tokens and steps and the estimated GPU-hours and wall time "
        "(from configs/throughput.yaml)",
    )
    run.add_argument("--gpus", type=float, help="--dry-run: GPUs of the cluster (default: the GPUs this machine "
                     f"sees; on a machine without one, 1 {DEFAULT_CARD})")
    run.add_argument("--nodes", type=int, help="--dry-run: nodes the GPUs are spread over (default: 1)")
    run.add_argument("--card", help="--dry-run: the GPU's name in configs/throughput.yaml (default: this machine's, "
                     f"else {DEFAULT_CARD})")
    run.add_argument("--details", action="store_true",
                     help="--dry-run: also every trial's samples, tokens, steps, layout and start, and the figures used")
    run.set_defaults(handler=_run)


def _check_before_work(experiments: Sequence[ExperimentConfig]) -> None:
    """Every folder a run writes can be written, and its tracking store answers (in seconds, before Ray starts)."""
    from clozemath.records import check_run_outputs
    from clozemath.tracking import check_tracking_uri

    check_run_outputs(experiments)
    for uri in dict.fromkeys(experiment.tracking.uri for experiment in experiments):
        check_tracking_uri(uri)


def _run(args: argparse.Namespace) -> int | None:
    from clozemath.plan import load_plan, run_inputs, with_absolute_paths
    from clozemath.records import claim_run_folder, run_lock

    if not args.dry_run:  # a forgotten --dry-run would start the whole grid
        given = [flag for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes), ("--card", args.card),
                                          ("--details", args.details or None)) if value is not None]
        if given:
            raise ClozeMathError(f"{given[0]} is an option of --dry-run, which is not given: nothing was started")
    plan = load_plan(args.config, args.overrides)  # a mistake is reported in a second, before Ray is imported
    if args.dry_run:
        return _dry_run(args, plan)
    _check_before_work(plan.experiments)
    folder = plan.folder
    with run_lock(folder):  # a second run of it now is refused at once
        # as is a run of another config, or on other data, where this one's work lies
        claim_run_folder(folder, [with_absolute_paths(e) for e in plan.experiments], run_inputs(plan.experiments))

        from ray_jobs.grid import run_command

        resume = shlex.join(["clozemath", "run", args.config, *args.overrides])
        interrupted = f"clozemath: interrupted; the grid resumes where it stopped with: {resume}"
        interrupts.set_message(interrupted)
        try:
            run_command(plan)
        except KeyboardInterrupt:
            interrupts.say(interrupted)
            return interrupts.exit_code()


DEFAULT_CARD = "H100"
"""The card `--dry-run` estimates for on a machine without a GPU, unless `--card` names another."""


def _dry_run(args: argparse.Namespace, plan: RunPlan) -> None:
    """`clozemath run CONFIG --dry-run`: the cost estimate, on the GPUs this machine sees or those the flags name (a
    machine without a GPU: one `DEFAULT_CARD`, said so). The libraries' warnings (transformers' deprecations while the
    shapes are built) are not the user's to act on: they are left out."""
    import warnings

    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it: a tokenizer not here is estimated, never fetched
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

        from clozemath.cost import estimate, estimate_text

        seen = torch.cuda.device_count()
        gpus = args.gpus if args.gpus is not None else (seen or 1)
        said = ""
        if not seen and args.gpus is None:
            said = (f"This machine sees no GPU: estimated for one {args.card or DEFAULT_CARD} (--gpus N [--nodes K] "
                    "[--card NAME] for a cluster).")
        nodes = 1 if args.nodes is None else args.nodes
        if gpus < 1 or gpus != int(gpus):
            raise ClozeMathError(f"--dry-run: --gpus {gpus:g} must be a whole number of GPUs, at least 1")
        if not 1 <= nodes <= gpus:
            raise ClozeMathError(f"--dry-run: --nodes {nodes} must be between 1 and the GPUs ({gpus:g})")
        card = args.card or (torch.cuda.get_device_name(0) if seen else DEFAULT_CARD)
        console.phase(f"[{plan.grid.name}] estimating {len(plan.experiments)} trial(s): counting the samples of each "
                      "training set (a minute or two for a large grid)")
        result = estimate(plan, gpus, card, nodes)
    print(estimate_text(result, args.details, said))


def _add_score(commands: argparse._SubParsersAction) -> None:
    score = commands.add_parser("score", help="regrade a predictions JSONL file and print its accuracy")
    score.add_argument("predictions", help="a predictions JSONL file (as `clozemath eval` writes)")
    score.add_argument("--json", action="store_true", help="print JSON instead of a table")
    score.set_defaults(handler=_score)


def _score(args: argparse.Namespace) -> None:
    from clozemath.eval.predictions import print_score

    print_score(args.predictions, as_json=args.json)


def _add_eval(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval", help="evaluate a base model (few-shot) or base + adapter on eval.sets with eval.decodings (Ray Data)"
    )
    evaluate.add_argument("config", help="an experiment YAML (configs/experiments/<name>.yaml)")
    evaluate.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. eval.adapter=PATH")
    _add_verbose(evaluate)
    evaluate.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> None:
    from clozemath.eval.evaluate import resolve_adapter

    config = _one_experiment(args.config, args.overrides, "eval")
    _check_before_work([config])
    adapter = resolve_adapter(config)  # a missing adapter fails here, before Ray starts

    from clozemath.plan import evaluation_inputs, with_absolute_paths
    from clozemath.records import EVAL_DIR, LOGS_DIR, claim_run_folder, evaluation_folder, run_lock
    from ray_jobs.eval_job import print_results, run_evaluation
    from ray_jobs.logs import logged

    resolved, inputs = with_absolute_paths(config), evaluation_inputs(config, adapter)
    folder = evaluation_folder(resolved, inputs)  # its own: a trained run's files are never touched
    with run_lock(folder):
        claim_run_folder(folder, [resolved], inputs)
        with logged(folder / LOGS_DIR):
            result = run_evaluation(config, adapter, folder=folder / EVAL_DIR)
    print_results(result, folder / LOGS_DIR, config.tracking.uri)


def _data_gsm_symbolic(args: argparse.Namespace) -> None:
    from clozemath.data.gsm_symbolic import write_jsonl
    from clozemath.files import check_writable_file

    check_writable_file(args.out, "--out")

    print(write_jsonl(args.variant, args.per_template, args.seed, args.out, args.templates))


def _add_prepare(commands: argparse._SubParsersAction) -> None:
    prepare = commands.add_parser("prepare", help="show the training samples a run would make, as token ids decode")
    prepare.add_argument("config", help="an experiment YAML")
    prepare.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    prepare.add_argument("--limit", type=int, help="use the first N problems (default: data.limit)")
    prepare.add_argument("--show", type=int, default=3, metavar="K", help="print the first K distinct samples")
    prepare.add_argument("--format", choices=["text", "jsonl"], default="text")
    prepare.set_defaults(handler=_prepare)


def _prepare(args: argparse.Namespace) -> None:
    from clozemath.data.prepare import show_prepared

    show_prepared(_one_experiment(args.config, args.overrides, "prepare"), args.limit, args.show,
                  args.format)


def _add_warm(commands: argparse._SubParsersAction) -> None:
    warm = commands.add_parser("warm", help="read the models a config names into this machine's caches (GGUF chunks "
                               "joined, GGUF weights dequantized), so that its trials here start without parsing them")
    warm.add_argument("config", help="an experiment or grid YAML")
    warm.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    warm.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                      help="the device whose dtype the weights are kept in (auto: cuda where there is one)")
    warm.add_argument("--data", action="store_true",
                      help="also prepare the training sets its run would prepare (Ray Data, on the Ray instance "
                      "RAY_ADDRESS names, else a local one) into the run's cache, <train.output_dir>/cache, so that "
                      "its driver and trials read them from there")
    warm.add_argument("--no-models", action="store_true",
                      help="with --data: the training sets alone (the models read by another `clozemath warm`)")
    warm.set_defaults(handler=_warm)


def _warm(args: argparse.Namespace) -> None:
    from clozemath.plan import load_plan

    if args.no_models and not args.data:
        raise ClozeMathError("warm --no-models: nothing left to warm; add --data (the training sets)")
    device = _device(args.device)
    plan = load_plan(args.config, args.overrides)
    if not args.no_models:
        _warm_models(plan, device)
    if args.data:
        _warm_data(plan)


def _warm_models(plan: RunPlan, device: str) -> None:
    """`clozemath warm`: each distinct model of the run read into this machine's caches."""
    import time

    from clozemath.model.load import warm_caches

    models = {model.model_dump_json(): model for model in (experiment.model for experiment in plan.experiments)}
    for k, model in enumerate(models.values()):
        started = time.monotonic()
        print(f"warm: {model.name} ({k + 1} of {len(models)}) for {device}...", flush=True)
        print(f"warm: {model.name}: {warm_caches(model, device)} in this machine's caches "
              f"({time.monotonic() - started:.0f} s)", flush=True)


def _warm_data(plan: RunPlan) -> None:
    """`clozemath warm --data`: the run's training sets prepared into its cache, as its driver would first."""
    import time

    from clozemath.plan import with_absolute_paths
    from clozemath.records import cache_folder
    from ray_jobs.run import prepare_training_sets, run_training_sets

    sets = run_training_sets([with_absolute_paths(e) for e in plan.experiments], plan.root)
    cache = cache_folder(plan.experiments[0].train.output_dir)
    started = time.monotonic()
    print(f"warm: the training sets of {plan.grid.name} into {cache}...", flush=True)
    prepared = prepare_training_sets(sets)
    print(f"warm: {plan.grid.name}: {len(prepared)} training set(s) in {cache} ({time.monotonic() - started:.0f} s)",
          flush=True)


def _add_report(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report", help="print a grid's results over seeds, how its answers were graded, the differences between its "
        "methods with 95%% intervals (over training seeds and test problems, and over problems alone), which of the "
        "paper's orderings hold, and the paper's Tables 1-4 from its tracked runs; plot accuracy against steps"
    )
    report.add_argument("--experiment", action="append", default=[],
                        help="the MLflow experiment (the grid's tracking.experiment); repeated: several grids reported "
                        "as one (e.g. Table 4's ablations beside the main grid's runs); left out, the --predictions "
                        "exports alone are reported (no tracking store needed)")
    from clozemath.config import TrackingConfig

    store = TrackingConfig.model_fields["uri"].default
    report.add_argument("--tracking-uri", default=store, help=f"default: {store} (a config's default store)")
    report.add_argument("--parent", metavar="RUN_ID", action="append", default=[],
                        help="the grid's MLflow run (default: the latest); repeated: grid runs of one experiment "
                        "reported as one (e.g. a seed added later by a grid of its own)")
    report.add_argument("--decoding", default="beam", choices=decoding_names(),
                        help="decoding of Tables 1, 3, 4, the orderings and the plot (default: beam)")
    report.add_argument("--latex", action="store_true", help="LaTeX tabulars instead of markdown")
    report.add_argument("--out", help="folder for the tables, summary.md, trials.json and the plot (default: "
                        "reports/<experiment>)")
    report.add_argument("--export-predictions", nargs="?", const="full", choices=["full", "compact"],
                        help="also write every trial's predictions to predictions.jsonl.gz there (compact: without "
                        "the generations)")
    report.add_argument("--predictions", metavar="FILE", action="append", default=[],
                        help="read the per-problem predictions from such an export instead of the runs' artifacts "
                        "(repeated: one per grid)")
    report.add_argument("--from", dest="folders", metavar="DIR", action="append", default=[],
                        help="instead of a store, a report folder written with --export-predictions (its trials.json, "
                        "steps.json.gz and predictions.jsonl.gz; or a folder holding it as report/); repeated: the "
                        "slices of a study reported as one, a trial two of them hold once")
    report.add_argument("--exclude-diverged", action="store_true",
                        help="leave out the runs whose training loss diverged (its smoothed loss at "
                        "train.divergence_factor times its lowest) and did not come back by the run's end, named in "
                        "the summary: the verdicts without them")
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> None:
    from clozemath.files import check_writable_folder
    from clozemath.report import report, report_folder
    from clozemath.tracking import check_tracking_uri

    if not args.experiment and not args.predictions and not args.folders:
        raise ClozeMathError("report: name an --experiment (or give --predictions exports, or --from report folders, "
                             "to report from alone)")
    check_writable_folder(report_folder(args.experiment, args.out, args.folders), "--out")
    if args.experiment and not args.folders:
        check_tracking_uri(args.tracking_uri, "--tracking-uri")

    report(args.experiment, args.tracking_uri, args.out, args.latex, args.parent, args.decoding,
           args.export_predictions, args.predictions, args.folders, args.exclude_diverged)


def _add_ls(commands: argparse._SubParsersAction) -> None:
    ls = commands.add_parser("ls", help="list what can be named in a config: models, methods, experiments, grids, "
                             "training sets, evaluation sets, decodings, objectives")
    ls.add_argument("kind", nargs="?", choices=LIST_KINDS, help="one kind only (default: all)")
    ls.set_defaults(handler=_ls)


LIST_KINDS = ("models", "methods", "experiments", "grids", "training-sets", "eval-sets", "decodings", "objectives")


def _ls(args: argparse.Namespace) -> None:
    from clozemath.data.objectives import OBJECTIVES
    from clozemath.plan import configs_root
    from clozemath.tasks import task_names

    root = configs_root()
    found = {
        "models": _yaml_names(root / "models"), "methods": _yaml_names(root / "methods"),
        "experiments": _yaml_names(root / "experiments"), "grids": _yaml_names(root / "grids"),
        "training-sets": list(training_set_names()), "eval-sets": list(task_names()),
        "decodings": list(decoding_names()), "objectives": list(OBJECTIVES.names()),
    }
    for kind in [args.kind] if args.kind else LIST_KINDS:
        where = f" ({root / kind}/)" if kind in ("models", "methods", "experiments", "grids") else ""
        print(f"{kind}{where}: {', '.join(found[kind]) or '(none)'}")


def _yaml_names(folder: os.PathLike[str] | str) -> list[str]:
    from pathlib import Path

    return sorted(path.stem for path in Path(folder).glob("*.yaml"))


def _add_config(commands: argparse._SubParsersAction) -> None:
    config = commands.add_parser("config", help="print the config a run would use: references resolved, overrides "
                                 "applied, defaults filled in (a grid: its trials, --full their configs)")
    config.add_argument("config", help="an experiment or grid YAML")
    config.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    config.add_argument("--full", action="store_true", help="a grid: every trial's whole config (YAML documents)")
    config.set_defaults(handler=_config)


def _config(args: argparse.Namespace) -> None:
    from clozemath.config import ExperimentConfig
    from clozemath.plan import load_plan
    from clozemath.safe_yaml import dump_yaml

    plan = load_plan(args.config, args.overrides)
    if isinstance(plan.config, ExperimentConfig):
        print(dump_yaml(plan.config), end="")
        return
    if args.full:
        print("\n---\n".join(dump_yaml(experiment) for experiment in plan.experiments), end="")
        return
    print(f"grid {plan.grid.name}: {len(plan.experiments)} trials (--full prints each one's config)")
    for experiment in plan.experiments:
        print(f"  {experiment.name}")


def _add_generate(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate", help="ask the model an experiment trained (its adapter, its prompt format) one or more questions")
    generate.add_argument("config", help="the experiment YAML the model was trained with (as given to `run`)")
    generate.add_argument("overrides", nargs="*", metavar="key=value",
                          help="dotted config overrides (as given to `run`; eval.adapter=PATH for another adapter)")
    generate.add_argument("--question", "-q", action="append", required=True,
                          help="a question (repeat for several)")
    generate.add_argument("--device", default="auto", help="cpu, cuda, ... (default: a GPU if there is one)")
    generate.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> None:
    from clozemath.eval.ask import ask

    for answer in ask(_one_experiment(args.config, args.overrides, "generate"), args.question, _device(args.device)):
        cut = " (cut at eval.max_new_tokens)" if answer.finish_reason == "length" else ""
        print(f"question: {answer.question}\n{answer.generation.strip()}\nanswer: {answer.answer or '(none found)'}"
              f"{cut}\n")


def _add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser("export", help="write an experiment's adapter merged into its base model, as a "
                                 "Hugging Face folder (transformers' from_pretrained loads it)")
    export.add_argument("config", help="the experiment YAML the model was trained with (as given to `run`)")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    export.add_argument("--out", required=True, help="a new folder to write")
    export.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> None:
    from clozemath.eval.evaluate import resolve_adapter
    from clozemath.model.load import export_merged

    config = _one_experiment(args.config, args.overrides, "export")
    adapter = resolve_adapter(config)
    if adapter is None:
        raise ClozeMathError(f"method '{config.method.name}' trains no adapter: nothing to merge")
    print(f"exported {export_merged(config.model, adapter, args.out)} (the adapter {adapter} merged into "
          f"{config.model.name})")


def _device(choice: str) -> str:
    """A `--device` choice, `auto` resolved: a GPU if there is one."""
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice


def _one_experiment(path: str, overrides: Sequence[str], command: str) -> ExperimentConfig:
    """The experiment a command that takes one acts on: an experiment's config, or the one trial of a grid its
    `axes.<axis>=<value>` overrides leave, or else the one trial of the grid that trains an adapter (the
    quickstart's, beside its base model)."""
    from clozemath.plan import load_plan

    plan = load_plan(path, list(overrides))
    candidates = plan.experiments
    if len(candidates) > 1:
        candidates = [experiment for experiment in candidates if experiment.method.trains]
    if len(candidates) != 1:
        axes = ", ".join(f"axes.{axis}=<one of: {', '.join(map(str, values))}>"
                         for axis, values in plan.grid.axes.items() if len(values) > 1)
        raise ClozeMathError(f"{path}: a grid of {len(plan.experiments)} trials; `{command}` takes one: pick it with "
                             f"{axes}")
    return candidates[0]


def _version() -> str:
    try:
        return importlib.metadata.version("clozemath")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clozemath", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"clozemath {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_ls(commands)
    _add_config(commands)
    _add_run(commands)
    _add_report(commands)
    _add_eval(commands)
    _add_generate(commands)
    _add_export(commands)
    _add_prepare(commands)
    _add_warm(commands)
    _add_data(commands)
    _add_score(commands)
    return parser


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Like `parse_args`, but `key=value` overrides may come before or after a subcommand's flags (argparse takes
    a positional list only in one piece: `prepare CONFIG --limit 40 method=clozemath` leaves `method=clozemath`)."""
    args, extra = parser.parse_known_args(argv)
    late = [arg for arg in extra if _is_override(arg)]
    if len(late) < len(extra) or (late and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    console.set_verbose(getattr(args, "verbose", False))
    handler: Handler = args.handler
    interrupts.reset()
    with interrupts.handled():  # SIGTERM and SIGHUP as Ctrl-C
        try:
            return int(handler(args) or 0)
        except ClozeMathError as exc:
            print(f"clozemath: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            interrupts.say("clozemath: interrupted")
            return interrupts.exit_code()

