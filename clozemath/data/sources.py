"""Problems of the training sets (`clozemath.data.training_sets`) and of GSM-P2's released instances, from a local
JSONL file or folder, or from the HF hub."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from clozemath.data.gold import numeric_gold
from clozemath.data.training_sets import TRAINING_SETS, TrainingSet, training_set_names
from clozemath.errors import ClozeMathError

DATA_DIR_ENV = "CLOZEMATH_DATA_DIR"


@dataclass(frozen=True)
class Problem:
    id: str
    dataset: str
    split: str
    question: str
    solution: str
    answer: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _field(row: dict[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str):
        raise ClozeMathError(f"{where}: missing field '{name}'" if value is None else f"{where}: '{name}' is not text")
    return value


def _training_problem(training_set: TrainingSet, row: dict[str, Any], index: int, split: str, where: str) -> Problem:
    solution = _field(row, training_set.solution, where)
    answer = training_set.gold(solution, where)
    question = _field(row, training_set.question, where)
    return Problem(f"{training_set.name}-{split}-{index}", training_set.name, split, question, solution, answer)


GSM_P2 = "gsm_p2"
_GSM_P2_HUB = ("apple/GSM-Symbolic", ("p2",))


def _gsm_p2(row: dict[str, Any], index: int, split: str, where: str) -> Problem:
    """Apple's released GSM-P2 instances (an evaluation set only): GSM8K's fields, numbered by template and instance."""
    solution = _field(row, "answer", where)
    problem_id = f"{GSM_P2}-{row.get('id', index)}-{row.get('instance', 0)}"
    answer = numeric_gold(solution, where)
    return Problem(problem_id, GSM_P2, split, _field(row, "question", where), solution, answer)


RowParser = Callable[[dict[str, Any], int, str, str], Problem]
"""(row, index in the split, split, where) -> the problem."""


def _parser(dataset: str) -> RowParser:
    """How a row of a set read from a file or the hub becomes a problem: the training sets', and the one evaluation
    set released as instances (GSM-P2)."""
    if dataset in TRAINING_SETS:
        return partial(_training_problem, TRAINING_SETS[dataset])
    if dataset == GSM_P2:
        return _gsm_p2
    if dataset in ("gsm_symbolic", "gsm_p1"):
        raise ClozeMathError(f"'{dataset}' is generated from templates, not read: see `clozemath data gsm-symbolic`")
    raise ClozeMathError(f"unknown dataset '{dataset}' (known: {', '.join((*training_set_names(), GSM_P2))})")


def _hub(dataset: str) -> tuple[str, tuple[str, ...]]:
    """The hub dataset and its configs a stored set comes from."""
    if dataset == GSM_P2:
        return _GSM_P2_HUB
    training_set = TRAINING_SETS[dataset]
    return training_set.hub, training_set.hub_configs


MAX_LINE_BYTES_ENV = "CLOZEMATH_MAX_LINE_BYTES"
MAX_LINE_BYTES = 1 << 20
"""The longest line a data or predictions file may hold (1 MiB; set `CLOZEMATH_MAX_LINE_BYTES` for more): MATH's
longest is 7.6 KB, a predictions line with a 4-shot prompt and 512 generated tokens about 10 KB. Preparing a
50 MB question took minutes and gigabytes."""
MAX_JSON_DEPTH_ENV = "CLOZEMATH_MAX_JSON_DEPTH"
MAX_JSON_DEPTH = 32
"""The deepest nesting of a line's JSON value (set `CLOZEMATH_MAX_JSON_DEPTH`): problems nest 1 deep, predictions 2."""
LIMIT_ENV_VARS = (MAX_LINE_BYTES_ENV, MAX_JSON_DEPTH_ENV)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""How a surrogate gets into a JSON line (UTF-8 cannot hold one): the rows without it, or without more brackets
than `MAX_JSON_DEPTH`, are not walked."""


def _env_limit(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ClozeMathError(f"{name}={text}: expected a whole number above 0")
    return int(text)


def _parsed(line: str, where: str, max_depth: int) -> Any:
    """A line's JSON value; a line that is no JSON, nests deeper than `max_depth`, or holds a number longer than
    Python reads (4,300 digits) is an error naming it."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ClozeMathError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ClozeMathError(f"{where}: JSON nested deeper than {max_depth} levels") from None
    except ValueError:  # an integer past `sys.get_int_max_str_digits()`
        raise ClozeMathError(
            f"{where}: a number of more than {sys.get_int_max_str_digits():,} digits, which no data holds"
        ) from None


def _check_value(row: Any, where: str, max_depth: int) -> None:
    """Within `max_depth`, and no text holding a lone surrogate (JSON's `\\ud800` escape without its pair: no
    character, and the tokenizer fails on it)."""
    stack: list[tuple[Any, int, str]] = [(row, 1, "")]
    while stack:
        value, depth, key = stack.pop()
        if depth > max_depth:
            raise ClozeMathError(f"{where}: JSON nested deeper than {max_depth} levels")
        if isinstance(value, dict):
            stack.extend((item, depth + 1, key or str(name)) for name, item in value.items())
            stack.extend((name, depth + 1, key or "a key") for name in value)
        elif isinstance(value, list):
            stack.extend((item, depth + 1, key) for item in value)
        elif isinstance(value, str) and (found := _LONE_SURROGATE.search(value)):
            field = f"field '{key}'" if key else "the value"
            raise ClozeMathError(
                f"{where}: {field} holds a lone surrogate (\\u{ord(found.group()):04x} at character "
                f"{found.start() + 1}), which is no text"
            )


def read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (`file:line`, row) for each non-empty line (of the gzip-compressed text of a `.gz` file); a line that is
    too long (`MAX_LINE_BYTES`), not UTF-8 text, not a JSON object, nested too deep (`MAX_JSON_DEPTH`), or holding a
    number or a character Python cannot take is an error naming it."""
    max_bytes = _env_limit(MAX_LINE_BYTES_ENV, MAX_LINE_BYTES)
    max_depth = _env_limit(MAX_JSON_DEPTH_ENV, MAX_JSON_DEPTH)
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(max_bytes + 2), b""), start=1):
            where = f"{path}:{number}"
            if len(raw.rstrip(b"\r\n")) > max_bytes:
                raise ClozeMathError(
                    f"{where}: a line longer than {max_bytes:,} bytes (set {MAX_LINE_BYTES_ENV} to allow more)"
                )
            line = decoded(raw, where)
            if not line.strip():
                continue
            row = _parsed(line, where, max_depth)
            if not isinstance(row, dict):
                raise ClozeMathError(f"{where}: expected a JSON object")
            if line.count("[") + line.count("{") > max_depth or _SURROGATE_ESCAPE.search(line):
                _check_value(row, where, max_depth)
            yield where, row


def decoded(raw: bytes, where: str) -> str:
    """`raw` as UTF-8 text; else an error naming `where` and the first byte that is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClozeMathError(
            f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
        ) from None


_SLICED_SPLIT = re.compile(r"(?P<name>[^\[\]]+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]")


def split_slice(split: str) -> tuple[str, slice]:
    """A split's name and the slice of its problems (in file order) a run takes: `train[:-500]` trains on all but
    the last 500 GSM8K train problems, `train[-500:]` evaluates those as a validation set. A plain name takes all."""
    match = _SLICED_SPLIT.fullmatch(split)
    if match is None:
        if "[" in split or "]" in split:
            raise ClozeMathError(f"split '{split}': write a slice of problems as name[start:stop], e.g. train[-500:]")
        return split, slice(None)
    return match["name"], slice(_bound(match["start"]), _bound(match["stop"]))


def _bound(text: str) -> int | None:
    return int(text) if text else None


def local_file(dataset: str, split: str, path: str | Path | None = None) -> Path | None:
    """The JSONL to read: `path` (a file, or a folder holding `<split>.jsonl`), else the data dir's, else None."""
    split, _ = split_slice(split)
    if path is not None:
        candidate = Path(path)
        if candidate.is_dir():
            candidate = candidate / f"{split}.jsonl"
        if not candidate.is_file():
            raise ClozeMathError(f"{candidate}: no such data file")
        return candidate
    root = os.environ.get(DATA_DIR_ENV)
    if not root:
        return None
    if dataset == GSM_P2:
        candidate = Path(root) / "gsm_symbolic" / "GSM_p2.jsonl"
    else:
        candidate = Path(root) / dataset / f"{split}.jsonl"
    if not candidate.is_file():
        raise ClozeMathError(f"{candidate}: no such data file (from {DATA_DIR_ENV}={root})")
    return candidate


def fingerprint(files: Iterable[Path]) -> str:
    """A hash of the files' locations and bytes, read a block at a time (a data file of gigabytes takes no more
    memory than a small one)."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.resolve()}\0".encode())
        with file.open("rb") as handle:
            hashlib.file_digest(handle, lambda: digest)
    return digest.hexdigest()[:16]


def data_identity(dataset: str, split: str, path: str | Path | None = None) -> str:
    """Where a split is read from and what it holds (`<file> <hash of its bytes>`), or the hub dataset it comes from;
    a missing file is an error."""
    file = local_file(dataset, split, path)
    if file is None:
        return f"hub:{_hub(dataset)[0]}/{split_slice(split)[0]}"
    next(read_jsonl(file), None)  # its first line within the budgets before all of it is read (a 2 GB line, say)
    return f"{file.resolve()} {fingerprint([file])}"


MAX_IDS_BYTES = 1 << 24
"""The largest ids file read (16 MiB: a million ids)."""


def read_problem_ids(path: str | Path) -> list[str]:
    """The problem ids an ids file lists (`eval.sets[].ids`): the first word of each line, in the file's order;
    blank lines and what follows `#` are left out. A file that is missing, not text, empty or lists an id twice is
    an error naming it."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_IDS_BYTES:
            raise ClozeMathError(f"{file}: an ids file over {MAX_IDS_BYTES >> 20} MiB")
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClozeMathError(f"{file}: no such ids file") from None
    except UnicodeDecodeError:
        raise ClozeMathError(f"{file}: an ids file, not UTF-8 text") from None
    except OSError as exc:
        raise ClozeMathError(f"{file}: cannot be read ({exc.strerror})") from None
    ids: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if words[0] in ids:
            raise ClozeMathError(f"{file}:{number}: '{words[0]}' listed again (first on line {ids[words[0]]})")
        ids[words[0]] = number
    if not ids:
        raise ClozeMathError(f"{file}: no problem ids in it")
    return list(ids)


def listed_problems(problems: list[Problem], path: str | Path, what: str) -> list[Problem]:
    """The problems of a set (`what`, e.g. `math/test`) that an ids file lists, in the set's order; an id the set
    does not hold is an error naming it."""
    ids = read_problem_ids(path)
    held = {problem.id for problem in problems}
    missing = [problem_id for problem_id in ids if problem_id not in held]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ClozeMathError(f"{path}: '{missing[0]}'{more} not among the {len(problems):,} problems of {what} "
                             f"(its ids run {problems[0].id} ... {problems[-1].id})")
    wanted = set(ids)
    return [problem for problem in problems if problem.id in wanted]


def ids_identity(path: str | Path) -> str:
    """Which problems an ids file chooses: where it is and a hash of its bytes (a missing file is an error)."""
    file = Path(path)
    read_problem_ids(file)
    return f"{file.resolve()} {fingerprint([file])}"


def _hub_rows(dataset: str, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    from datasets import load_dataset

    name, configs = _hub(dataset)
    for config in configs:
        hub_split = "test" if dataset == GSM_P2 else split
        try:
            rows = load_dataset(name, config, split=hub_split)
        except Exception as exc:  # noqa: BLE001 - any hub failure becomes one line naming the dataset
            raise ClozeMathError(
                f"cannot load {name} ({config}, {hub_split}) from the HF hub: {type(exc).__name__}; "
                f"set {DATA_DIR_ENV} or data.path to a local copy"
            ) from None
        for index, row in enumerate(rows):
            yield f"{name}[{config}/{hub_split}]:{index}", row


def load_problems(
    dataset: str, split: str, path: str | Path | None = None, limit: int | None = None
) -> list[Problem]:
    """Problems of one split (or of a slice of it: `split_slice`), in file order; `limit` keeps the first N. A
    problem's id is its place in the whole split, sliced or not."""
    parse = _parser(dataset)
    if limit is not None and limit < 1:
        raise ClozeMathError(f"a limit of {limit} problems: take at least 1")
    name, part = split_slice(split)
    file = local_file(dataset, name, path)
    rows = read_jsonl(file) if file is not None else _hub_rows(dataset, name)
    problems = []
    for index, (where, row) in enumerate(rows):
        if part == slice(None) and limit is not None and index >= limit:
            break  # no slice to take: read no further than the limit
        problems.append(parse(row, index, name, where))
    if not problems:
        raise ClozeMathError(f"{file or dataset}: no problems in it (an empty file)")
    sliced = problems[part][:limit]
    if not sliced:
        raise ClozeMathError(f"{file or dataset}: split '{split}' holds none of its {len(problems)} problems")
    return sliced
