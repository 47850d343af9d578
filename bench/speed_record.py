"""`bench/results/speed.json`: the headline ratios the README quotes, one object each, written by the benchmarks.

Each object: `claim` (what is compared, in words), `model`, `card`, `ours` and `baseline` (each: `name`, `settings`,
`value`, `unit`, and what else the benchmark measured beside it, e.g. `peak_gib`), `ratio` (ours / baseline) and the
`command` that reproduces it. A benchmark run replaces the object of the same claim, model and card, and appends the
others; the file is rewritten whole (never left half written). `python bench/speed_record.py FILE...` merges the
files a GPU machine wrote into `bench/results/speed.json` the same way.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from clozemath.errors import ClozeMathError  # noqa: E402
from clozemath.files import write_text_atomic  # noqa: E402

SPEED_JSON = ROOT / "bench" / "results" / "speed.json"


@dataclass(frozen=True)
class Side:
    """One side of a comparison."""

    name: str
    settings: str
    value: float
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)
    """Measured beside the value (peak memory, MFU, bandwidth share)."""

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        return {**{k: v for k, v in values.items() if k != "extra"}, **self.extra}


@dataclass(frozen=True)
class Headline:
    claim: str
    model: str
    card: str
    ours: Side
    baseline: Side
    command: str

    @property
    def ratio(self) -> float:
        return self.ours.value / self.baseline.value

    def as_dict(self) -> dict[str, Any]:
        return {
            "claim": self.claim, "model": self.model, "card": self.card, "ours": self.ours.as_dict(),
            "baseline": self.baseline.as_dict(), "ratio": round(self.ratio, 3), "command": self.command,
        }


def command_line(script: str, argv: Sequence[str]) -> str:
    """How the run was started, as one shell command (`python bench/<script> ...`)."""
    return shlex.join(["python", f"bench/{script}", *argv])


def read_headlines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        headlines = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ClozeMathError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(headlines, list) or not all(isinstance(h, dict) for h in headlines):
        raise ClozeMathError(f"{path}: not a list of headline objects")
    return headlines


def record(headlines: Sequence[Headline], path: Path = SPEED_JSON) -> None:
    """Replace the objects of the same (claim, model, card) in `path` with these, append the new ones."""
    merge_into(path, [headline.as_dict() for headline in headlines])


def merge_into(path: Path, headlines: Sequence[dict[str, Any]]) -> None:
    kept = read_headlines(path)
    for new in headlines:
        key = (new["claim"], new["model"], new["card"])
        same = [i for i, old in enumerate(kept) if (old.get("claim"), old.get("model"), old.get("card")) == key]
        if same:
            kept[same[0]] = new
            kept = [old for i, old in enumerate(kept) if i not in same[1:]]
        else:
            kept.append(new)
    write_text_atomic(path, json.dumps(kept, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """`python bench/speed_record.py FILE... [--into PATH]`: the headlines of speed.json files written elsewhere (a GPU
    machine's) merged into `bench/results/speed.json`, later files replacing earlier objects of the same claim."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--into", type=Path, default=SPEED_JSON, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        for path in args.files:
            if not path.exists():
                raise ClozeMathError(f"{path}: no such file")
            merge_into(args.into, read_headlines(path))
    except ClozeMathError as exc:
        print(f"speed_record: error: {exc}", file=sys.stderr)
        return 2
    return 0


def failure_note(exc: BaseException) -> str:
    """The one line a measurement that failed leaves in its table's row (the traceback goes to stderr)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".replace("|", "/")


if __name__ == "__main__":
    sys.exit(main())
