"""The `clozemath` command. Each subcommand parses its arguments here and calls one function elsewhere."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from clozemath.errors import ClozeMathError

Handler = Callable[[argparse.Namespace], int | None]


def _add_data(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="inspect and generate data")
    sub = data.add_subparsers(dest="data_command", required=True)

    stats = sub.add_parser("stats", help="segmentation and sample counts of a dataset split")
    stats.add_argument("--dataset", required=True, choices=["gsm8k", "math"])
    stats.add_argument("--split", default="train")
    stats.add_argument("--path", help="a JSONL file or folder (default: $CLOZEMATH_DATA_DIR/<dataset>/)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(handler=_data_stats)


def _data_stats(args: argparse.Namespace) -> None:
    from clozemath.data.stats import print_stats

    print_stats(args.dataset, args.split, args.path, as_json=args.json)


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="train one experiment on Ray (locally, or on the cluster at RAY_ADDRESS)")
    run.add_argument("config", help="an experiment YAML")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> None:
    from ray_jobs.run import run_command

    run_command(args.config, args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clozemath", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_data(commands)
    _add_run(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return int(handler(args) or 0)
    except ClozeMathError as exc:
        print(f"clozemath: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("clozemath: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
