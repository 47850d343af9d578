"""`bench/slices.py` and `bench/slice_lease.sh`: a plan of grids in slices, resumed from the committed results (what a
finished trial is, what is left of a slice and the overrides that run it), the sessions the slices need, and the
lease script's chain of commands (DRY_RUN: nothing run)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clozemath.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("bench_slices", ROOT / "bench" / "slices.py")
slices = importlib.util.module_from_spec(SPEC)
sys.modules["bench_slices"] = slices  # its dataclasses look their module up
SPEC.loader.exec_module(slices)

SMOKE = "configs/grids/smoke.yaml"
GSM8K_SETS = [("gsm8k", "beam"), ("gsm8k", "cot"), ("gsm_symbolic", "beam"), ("gsm_p1", "beam"), ("gsm_p2", "beam")]


def write_plan(tmp_path: Path, entries: dict[str, dict]) -> Path:
    plan = {"results": str(tmp_path / "results"), "card": "H200",
            "session": {"device_s": 1800, "start_s": 90, "ship_s": 210, "collect_s": 60}, "slices": entries}
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(plan))  # JSON is YAML
    return path


SMOKE_LR = load_plan(ROOT / SMOKE).experiments[0].train.lr


def commit(tmp_path: Path, folder: str, trials: dict[str, list[tuple[str, str]]], lr: float = SMOKE_LR) -> None:
    """A slice's report as committed: a trials.json holding each trial, trained at `lr`, with its accuracy on the
    (set, decoding)s given."""
    rows = [{"run_id": name, "run_name": f"{name} (readable)", "tags": {}, "params": {"name": name, "train.lr": str(lr)},
             "metrics": {f"eval/{s}/{d}/accuracy": 0.5 for s, d in sets}} for name, sets in trials.items()]
    (tmp_path / "results" / folder / "report").mkdir(parents=True)
    (tmp_path / "results" / folder / "report" / "trials.json").write_text(json.dumps(rows))


def described(plan: Path, name: str) -> dict[str, list[str]]:
    lines = slices.describe(slices.read_plan(plan), name).splitlines()
    found: dict[str, list[str]] = {}
    for line in lines:
        key, value = line.split("=", 1)
        found.setdefault(key, []).append(value)
    return found


def dry_chain(plan: Path, work: Path, *names: str, **env: str) -> tuple[str, dict[str, str]]:
    """`bench/slice_lease.sh chain NAMES` under DRY_RUN (its commands printed, none run): its console, and its
    environment for another call of the script."""
    env = {**os.environ, "DRY_RUN": "1", "WORK": str(work), "PLAN": str(plan), "PYTHON": sys.executable, **env}
    done = subprocess.run(["bash", "bench/slice_lease.sh", "chain", *names], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, env


def commands_of(console: str) -> list[str]:
    """The commands a dry chain printed, in order."""
    return [line.split("$ ", 1)[1] for line in console.splitlines() if "] $ " in line]


def test_a_slice_runs_only_its_unfinished_trials_and_a_trial_missing_a_set_is_unfinished(tmp_path: Path) -> None:
    """Of base, MFT and ClozeMath on tiny-llama: MFT has every set's accuracy (finished), ClozeMath only GSM8K beam's
    (cut while evaluating): what is left is base and ClozeMath, and the overrides expand to exactly those."""
    plan = write_plan(tmp_path, {"a": {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.dataset=[gsm8k]"]}})
    commit(tmp_path, "a", {"smoke-grid/model=tiny-llama,method=mft,dataset=gsm8k,seed=0": GSM8K_SETS,
                           "smoke-grid/model=tiny-llama,method=clozemath,dataset=gsm8k,seed=0": GSM8K_SETS[:1]})
    found = described(plan, "a")
    assert (found["grid"], found["experiment"], found["trials"], found["todo"]) == (
        [SMOKE], ["smoke-grid"], ["3"], ["2"])
    assert "rerun" not in found
    assert found["override"][-1] == "axes.method=[base, clozemath]"
    left = load_plan(ROOT / SMOKE, found["override"]).experiments
    assert sorted(e.method.name for e in left) == ["base", "clozemath"]


def test_what_is_left_runs_as_the_product_of_its_values_and_names_the_finished_trials_inside_it(tmp_path: Path) -> None:
    """Two models x MFT and ClozeMath, with one trial of each model finished on the diagonal: the unfinished two take
    both values of both axes, so nothing narrows and the two finished ones are named as run again; once all four
    are finished (in two folders), the slice is done."""
    plan = write_plan(tmp_path, {"b": {"grid": SMOKE, "set": ["axes.method=[mft,clozemath]", "axes.dataset=[gsm8k]"]}})
    name = "smoke-grid/model={},method={},dataset=gsm8k,seed=0"
    commit(tmp_path, "b", {name.format("tiny-llama", "mft"): GSM8K_SETS,
                           name.format("tiny-llama-b", "clozemath"): GSM8K_SETS})
    found = described(plan, "b")
    assert found["todo"] == ["2"] and found["override"] == ["axes.method=[mft,clozemath]", "axes.dataset=[gsm8k]"]
    finished = [name.format("tiny-llama", "mft"), name.format("tiny-llama-b", "clozemath")]
    assert sorted(found["rerun"]) == sorted(finished)
    commit(tmp_path, "b-2", {name.format("tiny-llama-b", "mft"): GSM8K_SETS,
                             name.format("tiny-llama", "clozemath"): GSM8K_SETS})
    assert described(plan, "b")["todo"] == ["0"] and "override" not in described(plan, "b")


def test_a_trial_committed_at_another_rate_is_not_finished(tmp_path: Path) -> None:
    """The rates are written into the grids after their slices are planned: a trial of the same name run at the
    placeholder rate before is not the trial the grid now holds."""
    plan = write_plan(tmp_path, {"c": {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.method=[mft]",
                                                              "axes.dataset=[gsm8k]"]}})
    commit(tmp_path, "c", {"smoke-grid/model=tiny-llama,method=mft,dataset=gsm8k,seed=0": GSM8K_SETS}, lr=SMOKE_LR * 3)
    assert described(plan, "c")["todo"] == ["1"]
    commit(tmp_path, "c-2", {"smoke-grid/model=tiny-llama,method=mft,dataset=gsm8k,seed=0": GSM8K_SETS})
    assert described(plan, "c")["todo"] == ["0"]


def test_rates_narrowed_from_what_is_left_read_back_as_numbers() -> None:
    """An axis of rates narrowed by the overrides: `5.0e-05` (a number to YAML), never `5e-05` (a string to it)."""
    flow = slices.flow([5e-05, 1e-4, 3e-4])
    assert flow == "[5.0e-05, 0.0001, 0.0003]"
    plan = load_plan(ROOT / "configs/grids/replication_qwen1.5b_rates.yaml",
                     ["axes.method=[it]", f"axes.train.lr={slices.flow([5e-05])}", "axes.train.seed=[1]"])
    assert [(e.train.lr, e.train.seed) for e in plan.experiments] == [(5e-05, 1)]


def estimate(name: str, minutes: float, reserve: bool = False) -> object:
    piece = slices.Slice(name, ROOT / SMOKE, [], reserve)
    return slices.SliceEstimate(piece, 3, minutes * 60, once_s=150)


def test_slices_are_packed_into_sessions_in_the_plans_order_the_reserve_apart(tmp_path: Path) -> None:
    """A session of 30 minutes, less 1.5 to start, 3.5 to ship, 1 to collect and 2.5 for Ray and the GGUF parse,
    leaves 21.5 for slices: 8 + 8 fit one, the next 8 starts another; a slice longer than a session has one alone;
    the reserve is in none."""
    plan = slices.read_plan(write_plan(tmp_path, {}))
    window, packed = slices.sessions(plan, [estimate("a", 8), estimate("b", 8), estimate("c", 8), estimate("d", 25),
                                            estimate("r", 5, reserve=True), estimate("e", 2)])
    assert window == pytest.approx(21.5 * 60)
    assert [[e.piece.name for e in group] for group in packed] == [["a", "b"], ["c"], ["d"], ["e"]]
    text = slices.estimate_text(plan, [estimate("a", 8), estimate("d", 25), estimate("r", 5, reserve=True)])
    assert "| d | smoke.yaml | 3 | - | 25.0 (over a session) | - | 2 |" in text
    assert "| r | smoke.yaml | 3 | - | 5.0 | - | reserve |" in text
    assert "Sessions: 2 " in text


def test_the_estimate_is_calibrated_a_finished_slice_is_in_no_session_and_its_measured_time_stands_beside(
        tmp_path: Path) -> None:
    """A plan calibrated x1.5: slice a (its one trial finished in the committed results, its console saying the grid
    ran 600 s, and a rerun of what was left 120 s) is done and packed nowhere; slice b's dry-run is scaled by 1.5."""
    name = "smoke-grid/model=tiny-llama,method=mft,dataset=gsm8k,seed=0"
    path = write_plan(tmp_path, {
        "a": {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.method=[mft]", "axes.dataset=[gsm8k]"]},
        "b": {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.method=[clozemath]", "axes.dataset=[gsm8k]"]}})
    raw = json.loads(path.read_text())
    raw["session"]["calibration"] = 1.5
    path.write_text(json.dumps(raw))
    commit(tmp_path, "a", {name: GSM8K_SETS})
    for folder, seconds in (("a", 600), ("a-2", 120)):
        (tmp_path / "results" / folder).mkdir(exist_ok=True)
        (tmp_path / "results" / folder / "driver.log").write_text(
            f"[08:19:03] $ python3 -m clozemath_cli run ...\ntrial x: finished\n[08:29:03] exit 0 after {seconds} s\n")
    plan = slices.read_plan(path)
    a, b = (slices.estimate_slice(plan, plan.slice(n)) for n in ("a", "b"))
    assert a.done and a.measured_s == 720 and not b.done and b.measured_s is None
    assert b.seconds == pytest.approx(1.5 * b.dry_run_s)
    window, packed = slices.sessions(plan, [a, b])
    assert [[e.piece.name for e in group] for group in packed] == [["b"]]
    text = slices.estimate_text(plan, [a, b])
    assert f"| a | smoke.yaml | 1 | {a.dry_run_s / 60:.1f} | {a.seconds / 60:.1f} | 12.0 | done |" in text
    assert "Left to run: " in text and "(1 slice, 1 trial); done: 1 slice;" in text
    assert "Sessions: 1 (" in text and "Sessions: none; every planned slice is done." in slices.estimate_text(plan, [a])


def test_every_slice_of_the_issue_46_plan_expands_and_they_cover_each_grid_once() -> None:
    """bench/slices_qwen1.5b.yaml: each slice names trials of its grid, no trial is in two slices (the reserve
    apart), and together they hold every trial of every grid they slice."""
    plan = slices.read_plan(slices.PLAN)
    seen: dict[str, str] = {}
    grids = set()
    for piece in plan.slices.values():
        trials = slices.slice_trials(plan, piece)
        assert trials.names(), piece.name
        grids.add(piece.grid)
        for name in trials.names():
            if not piece.reserve:
                assert seen.setdefault(name, piece.name) == piece.name, f"{name} in {seen[name]} and {piece.name}"
    every = {config.name for grid in grids for config in load_plan(grid).experiments}
    assert set(seen) == every


def test_the_lease_chain_skips_a_finished_slice_and_runs_what_is_left_of_another(tmp_path: Path) -> None:
    """`bench/slice_lease.sh chain a b` (DRY_RUN): slice a is finished in the committed results and skipped; slice b
    runs in its own folder and store, on the model's chunk files, narrowed to what is left, then its report; its model
    is read into the machine's caches (`clozemath warm`) beside its driver."""
    name = "smoke-grid/model=tiny-llama,method={},dataset=gsm8k,seed=0"
    plan = write_plan(tmp_path, {
        "a": {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.method=[mft]", "axes.dataset=[gsm8k]"]},
        "b": {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.dataset=[gsm8k]"]}})
    commit(tmp_path, "a", {name.format("mft"): GSM8K_SETS})
    work = tmp_path / "work"
    console, _ = dry_chain(plan, work, "a", "b", MODEL_CHUNKS="/tmp/qwen")
    assert "chain: a: every trial is finished in the committed results; skipped" in console
    commands = commands_of(console)
    assert commands[0].startswith("ray start --head")
    warm, run, report = commands[1:]
    store = f"sqlite:///{work}/b/mlruns.db"
    assert warm.endswith(f"-m clozemath_cli warm {SMOKE} model.gguf_chunks.packages=null "
                         "model.gguf_chunks.files=/tmp/qwen/part*.bin axes.model=[tiny-llama] axes.dataset=[gsm8k] "
                         "axes.method=[base, clozemath]")  # the first slice left to run, its model read beforehand
    assert run.endswith(f"-m clozemath_cli run {SMOKE} model.gguf_chunks.packages=null "
                        f"model.gguf_chunks.files=/tmp/qwen/part*.bin train.output_dir={work}/b/runs "
                        f"tracking.uri={store} axes.model=[tiny-llama] axes.dataset=[gsm8k] "
                        "axes.method=[base, clozemath]")
    assert report.endswith(f"report --experiment smoke-grid --tracking-uri {store} --decoding beam "
                           f"--out {work}/b/report --export-predictions full")
    assert (work / "done").exists() and not (work / "a").exists()
    usage = subprocess.run(["bash", "bench/slice_lease.sh", "start"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_a_chain_told_its_sessions_seconds_skips_a_slice_whose_estimate_passes_them(tmp_path: Path) -> None:
    """SESSION_S=600: slice a (estimated 300 s) runs, slice b (900 s) would be cut by the session's end, losing its
    trials, so it is skipped and said; slice c (100 s) still runs after it; a slice with no estimate runs, said so.
    The estimates are those `bench/slices.py estimate` saved, read back by `describe`."""
    sliced = {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.dataset=[gsm8k]"]}
    methods = {"a": "[mft]", "b": "[clozemath]", "c": "[it]", "d": "[base]"}
    plan_path = write_plan(tmp_path, {name: {"grid": SMOKE, "set": [*sliced["set"], f"axes.method={method}"]}
                                      for name, method in methods.items()})
    plan = slices.read_plan(plan_path)
    pieces = [plan.slice(name) for name in "abc"]
    slices.save_estimates(plan, [slices.SliceEstimate(p, 1, s, 0) for p, s in zip(pieces, (300.4, 900, 100))])
    assert described(plan_path, "b")["estimate_s"] == ["900"] and "estimate_s" not in described(plan_path, "d")
    console, env = dry_chain(plan_path, tmp_path / "work", "a", "b", "c", "d", MODEL_CHUNKS="", SESSION_S="600")
    runs = [command for command in commands_of(console) if "-m clozemath_cli run " in command]
    assert [run.rsplit("axes.method=", 1)[1] for run in runs] == ["[mft]", "[it]", "[base]"]
    assert "chain: b: skipped: its estimate, 900 s, is more than the session's" in console
    assert "chain: d: no estimate (bench/slices.py estimate); run anyway" in console
    bad = subprocess.run(["bash", "bench/slice_lease.sh", "start", "a"], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "SESSION_S": "25min"})
    assert bad.returncode == 2 and bad.stderr.strip() == "slice_lease: SESSION_S=25min: not a whole number of seconds"


def test_waiting_on_a_machine_without_the_chain_returns_at_once_and_a_dead_chain_is_said_stopped(
        tmp_path: Path) -> None:
    """A `wait` that reaches a fresh machine (the one running the chain went back between calls) must not spend its
    seconds of device time waiting on nothing; one whose chain process died says so instead of 'running'."""
    work = tmp_path / "work"
    env = {**os.environ, "WORK": str(work), "PYTHON": sys.executable}
    fresh = subprocess.run(["bash", "bench/slice_lease.sh", "wait", "300"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert fresh.returncode == 3 and "chain: none on this machine" in fresh.stdout
    work.mkdir()
    (work / "chain.log").write_text("chain: [10:00:00] slice a\n")
    (work / "chain.pid").write_text("999999999\n")  # above any pid_max: no such process
    dead = subprocess.run(["bash", "bench/slice_lease.sh", "wait", "300"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert dead.returncode == 4, dead.stdout
    assert "ended without finishing" in dead.stdout and dead.stdout.rstrip().endswith("chain: stopped")


def test_a_chains_later_slices_have_their_training_sets_prepared_while_the_first_runs(tmp_path: Path) -> None:
    """`chain b c` (DRY_RUN): b's model is read first (`clozemath warm`), then c's training sets are prepared into the
    chain's one data cache (`clozemath warm --data --no-models`, c's own folder), which every slice's run folder
    links to, so that c's driver reads them there."""
    plan = write_plan(tmp_path, {
        name: {"grid": SMOKE, "set": ["axes.model=[tiny-llama]", "axes.dataset=[gsm8k]", f"axes.method={method}"]}
        for name, method in (("b", "[mft]"), ("c", "[clozemath]"))})
    work = tmp_path / "work"
    console, _ = dry_chain(plan, work, "b", "c", MODEL_CHUNKS="")
    commands = [command.split(" -m clozemath_cli ", 1)[-1] for command in commands_of(console)]
    sliced = "axes.model=[tiny-llama] axes.dataset=[gsm8k]"
    assert commands[1:4] == [
        f"warm {SMOKE} {sliced} axes.method=[mft]",
        f"warm --data --no-models {SMOKE} train.output_dir={work}/c/runs {sliced} axes.method=[clozemath]",
        f"run {SMOKE} train.output_dir={work}/b/runs tracking.uri=sqlite:///{work}/b/mlruns.db {sliced} "
        "axes.method=[mft]",
    ]
    for name in "bc":
        link = work / name / "runs" / "cache"
        assert link.is_symlink() and link.resolve() == (work / "cache").resolve()


def test_collect_waits_for_a_finished_slices_report_instead_of_writing_another_beside_it(tmp_path: Path) -> None:
    """A slice whose driver is done (`driven`) has its report written in the background while the next slice starts;
    `collect` meanwhile waits for it (`done`) rather than reporting from a snapshot into the same folder, and packs
    the report that the chain wrote."""
    import sqlite3
    import tarfile
    import time

    work, out = tmp_path / "work", tmp_path / "out"
    folder = work / "a"
    (folder / "report").mkdir(parents=True)
    out.mkdir()
    sqlite3.connect(folder / "mlruns.db").close()
    (folder / "experiment").write_text("smoke-grid beam\n")
    (folder / "report.log").write_text("the chain's report\n")
    (folder / "driven").touch()
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "PYTHON": sys.executable}
    started = time.monotonic()
    collecting = subprocess.Popen(["bash", "bench/slice_lease.sh", "collect"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)
    assert collecting.poll() is None  # waiting for the report
    (folder / "done").touch()
    assert collecting.wait(timeout=60) == 0 and time.monotonic() - started >= 3
    with tarfile.open(out / "a.tar.gz") as packed:
        assert packed.extractfile("report.log").read() == b"the chain's report\n"


def test_unpack_commits_a_slices_report_and_consoles_compact_and_a_second_part_beside_the_first(
        tmp_path: Path) -> None:
    """A session's tarball of a real slice (budget3x-s1, as committed, with its generations and a store beside) goes
    to `<slice>/` with its report, the predictions compact and the same trials, without the store; beside a part of
    the slice with other trials, to `<slice>-2/`; the same tarball again, a tarball of no slice, or one without a
    report, is one error and writes nothing."""
    import gzip
    import tarfile

    committed = ROOT / "bench" / "results" / "replication_qwen1.5b_slices" / "budget3x-s1"
    source = tmp_path / "session"
    shutil.copytree(committed, source)
    full = [json.loads(line) for line in gzip.open(source / "report" / "predictions.jsonl.gz", "rt")]
    with gzip.open(source / "report" / "predictions.jsonl.gz", "wt") as stream:  # as the chain exports them: full
        stream.writelines(json.dumps({**row, "generation": "The answer is 42."}) + "\n" for row in full)
    (source / "mlruns.db.gz").write_bytes(b"a store")
    tarball = tmp_path / "out" / "budget3x-s1.tar.gz"
    tarball.parent.mkdir()
    with tarfile.open(tarball, "w:gz") as archive:
        for name in ("report", "driver.log", "report.log", "mlruns.db.gz"):
            archive.add(source / name, arcname=name)
    path = write_plan(tmp_path, {"budget3x-s1": {"grid": "configs/grids/replication_qwen1.5b_budget.yaml",
                                                 "set": ["axes.arm=[budget3x]", "axes.train.seed=[1]"]}})
    plan = slices.read_plan(path)

    commit(tmp_path, "budget3x-s1", {"another trial": [("gsm8k", "greedy")]})  # a first part, cut by its session

    said = slices.unpack(plan, tarball)
    first = tmp_path / "results" / "budget3x-s1-2"
    assert said == "budget3x-s1.tar.gz -> results/budget3x-s1-2: 3 trials, beam"
    assert sorted(p.name for p in first.iterdir()) == ["driver.log", "report", "report.log"]
    assert (first / "driver.log").read_bytes() == (committed / "driver.log").read_bytes()
    rows = [json.loads(line) for line in gzip.open(first / "report" / "predictions.jsonl.gz", "rt")]
    assert len(rows) == len(full) and not any("generation" in row for row in rows)
    assert {(r["run_id"], r["id"], r["decoding"], r["correct"]) for r in rows} == \
        {(r["run_id"], r["id"], r["decoding"], r["correct"]) for r in full}
    trials = json.loads((first / "report" / "trials.json").read_text())
    assert sorted(t["run_id"] for t in trials) == sorted(t["run_id"] for t in
                                                         json.loads((committed / "report" / "trials.json").read_text()))
    assert all(slices.finished(c, slices.committed_metrics(plan.results))
               for c in load_plan(ROOT / "configs/grids/replication_qwen1.5b_budget.yaml",
                                  ["axes.arm=[budget3x]", "axes.train.seed=[1]"]).experiments)

    with pytest.raises(slices.ClozeMathError, match="its trials are all in results/budget3x-s1-2 already"):
        slices.unpack(plan, tarball)

    stray = tmp_path / "out" / "nowhere.tar.gz"
    shutil.copy(tarball, stray)
    with pytest.raises(slices.ClozeMathError, match="no slice 'nowhere' in the plan"):
        slices.unpack(plan, stray)
    empty = tmp_path / "out" / "budget3x-s1.tar.gz"
    with tarfile.open(empty, "w:gz") as archive:
        archive.add(source / "driver.log", arcname="driver.log")
    with pytest.raises(slices.ClozeMathError, match=r"budget3x-s1.tar.gz: no report/trials.json in it"):
        slices.unpack(plan, empty)
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["budget3x-s1", "budget3x-s1-2"]
