"""The grid end to end on Ray (slow): the smoke grid (2 tiny models x base, ClozeMath) as a Ray job (`ray start
--head` + `ray job submit`), with its MLflow parent and child runs; `clozemath report` on it; a driver interrupted
(Ctrl-C), then killed mid-grid, then `clozemath run` again restoring it without redoing the finished trial."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from sqlalchemy.exc import OperationalError

from clozemath import records, tracking
from clozemath_cli import main
from clozemath.config import GridConfig, TrackingConfig
from clozemath.errors import ClozeMathError
from clozemath.plan import expand_grid, load_config
from clozemath.records import readable_params
from conftest import run_command
import ray_jobs.grid
from ray_jobs.grid import (
    QuietUserErrors,
    end_interrupted,
    grid_key,
    in_start_order,
    warn_local_store_on_a_cluster,
    with_absolute_paths,
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "grids" / "smoke.yaml"
SLICE = ["axes.method=[base,clozemath]", "axes.dataset=[gsm8k]"]
"""2 tiny models x {base, ClozeMath} on GSM8K: 4 trials, 2 of them trained."""
STEPS = 4
RAY = Path(sys.executable).parent / "ray"


def store(folder: Path) -> list[str]:
    return [f"train.output_dir={folder / 'runs'}", f"tracking.uri=sqlite:///{folder / 'mlruns.db'}"]


def tracking_of(folder: Path) -> TrackingConfig:
    return TrackingConfig(uri=f"sqlite:///{folder / 'mlruns.db'}", experiment="smoke-grid")


def children(config: TrackingConfig) -> dict[str, Run]:
    """The trial runs by trial name (asserting there is one run per trial)."""
    runs = tracking.find_runs(config, {"role": "trial"})
    by_trial = {run.data.tags["trial"]: run for run in runs}
    assert len(by_trial) == len(runs), [run.data.tags["trial"] for run in runs]
    return by_trial


def steps(config: TrackingConfig, run_id: str, metric: str) -> list[int]:
    history = tracking.client(config.uri).get_metric_history(run_id, metric)
    return [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def assert_grid_tracked(config: TrackingConfig, trials: list[str], planned: int = STEPS) -> dict[str, Run]:
    """A finished parent run and one finished child run per trial, with its tags, metrics and artifacts; each of the
    `planned` steps logged once, also where a trial resumed from a checkpoint and trained the steps after it again."""
    client = tracking.client(config.uri)
    (parent,) = tracking.find_runs(config, {"role": "grid"})
    assert parent.info.status == "FINISHED" and parent.data.tags["grid"] == "smoke-grid"
    assert parent.data.params["grid.trials"] == str(len(trials))
    runs = children(config)
    assert sorted(runs) == sorted(trials)
    for name, run in runs.items():
        tags = run.data.tags
        assert run.info.status == "FINISHED" and tags[records.PARENT_TAG] == parent.info.run_id
        point = f"model={tags['model']},method={tags['method']},dataset={tags['train_set']},seed={tags['seed']}"
        assert name == f"smoke-grid/{point}"
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "eval"} <= artifacts
        predictions = {a.path for a in client.list_artifacts(run.info.run_id, "eval/predictions")}
        assert "eval/predictions/gsm8k.jsonl" in predictions
        metrics = run.data.metrics
        if tags["method"] == "base":  # as lm-evaluation-harness runs it: greedy, its two GSM8K filters
            assert metrics["eval/gsm8k/greedy/total"] == 2 and "eval/gsm8k/greedy/flexible-extract" in metrics
            assert "adapter" not in artifacts and steps(config, run.info.run_id, "eval/gsm8k/greedy/accuracy") == [0]
        else:
            assert metrics["eval/gsm8k/beam/total"] == metrics["eval/gsm8k/cot/total"] == 2
            assert 0.0 <= metrics["eval/gsm8k/beam/accuracy"] <= 1.0
            assert "adapter" in artifacts
            assert {f"eval/{s}/beam/accuracy" for s in ("gsm_symbolic", "gsm_p1", "gsm_p2")} <= set(metrics)
            assert "eval/gsm_p1/cot/accuracy" not in metrics  # CoT-decoding on GSM8K only
            logged = steps(config, run.info.run_id, "train/loss")
            # accuracy during training on the same 2 problems every 2 steps (the last one among them), apart from
            # the full evaluation at the last step
            curve = steps(config, run.info.run_id, "curve/gsm8k/beam/accuracy")
            evaluated = steps(config, run.info.run_id, "eval/gsm8k/beam/accuracy")
            assert logged == list(range(1, planned + 1)) and curve == list(range(2, planned + 1, 2))
            assert set(evaluated) == {planned}
            params = run.data.params
            assert int(params["train.planned_steps"]) == planned and int(params["train.planned_tokens"]) > 0
    return runs


# --------------------------------------------------------------------------------------------------------------
# The smoke grid as a Ray job on a cluster of its own (`ray start --head` below)


@pytest.fixture(scope="module")
def smoke_grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, GridConfig]:
    """The smoke grid's slice, submitted as a Ray job (`ray job submit ... -- clozemath run ...`) to a cluster started
    for it: the job's output, the folder of its runs and MLflow store, the grid."""
    folder = tmp_path_factory.mktemp("grid")
    overrides = [*SLICE, *store(folder)]
    with ray_head(tmp_path_factory.mktemp("head")) as (address, gcs, env):
        no_token = {key: value for key, value in env.items() if key != "RAY_AUTH_TOKEN"}
        home = tmp_path_factory.mktemp("home")  # no ~/.ray/auth_token there
        for mode, driver_env in (("disabled", env), ("token", {**no_token, "HOME": str(home)})):
            refused = subprocess.run(  # a driver without the cluster's token, as `ray start` users meet it; Ray
                # retries its first call to the GCS once a second, 20 times unless RAY_gcs_server_port_wait_time_s says
                [sys.executable, "-m", "clozemath_cli", "run", "configs/grids/smoke.yaml", *overrides], cwd=ROOT,
                env={**driver_env, "RAY_ADDRESS": gcs, "RAY_AUTH_MODE": mode, "RAY_gcs_server_port_wait_time_s": "2"},
                capture_output=True, text=True, timeout=300,
            )
            assert refused.returncode == 2, refused.stderr[-3000:]
            assert "Traceback" not in refused.stderr and refused.stderr.strip().splitlines()[-1] == (
                f"clozemath: error: the Ray cluster at {gcs} refused this driver (RAY_AUTH_MODE={mode}): set "
                "RAY_AUTH_MODE=token as the cluster was started, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN"
            )
        job = subprocess.run(
            [str(RAY), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
             sys.executable, "-m", "clozemath_cli", "run", "configs/grids/smoke.yaml", *overrides],
            env=env, capture_output=True, text=True, timeout=1200,
        )
    grid = load_config(SMOKE, overrides)
    assert isinstance(grid, GridConfig)
    return job, folder, grid


@pytest.mark.slow
def test_the_smoke_grid_runs_as_a_ray_job_to_the_end_tracked_as_parent_and_children(smoke_grid) -> None:
    job, folder, grid = smoke_grid
    output = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in output, output[-3000:]
    assert "ray: joined the cluster at " in output  # joined RAY_ADDRESS, started none
    experiments = [with_absolute_paths(e) for e in expand_grid(grid, ROOT / "configs", SMOKE)]
    runs = assert_grid_tracked(tracking_of(folder), [e.name for e in experiments])
    summary = re.findall(r"^  (\S+) +(finished|failed: .*?) +.*run (\S+)$", job.stdout, re.MULTILINE)
    assert summary == [(e.name, "finished", runs[e.name].info.run_id) for e in in_start_order(experiments)], (
        job.stdout[-3000:])  # the trials as Tune started them: the base model's first
    for experiment in experiments:  # params: the resolved config, readable, for the MLflow UI to compare
        params = runs[experiment.name].data.params
        assert {key: params[key] for key in readable_params(experiment)} == readable_params(experiment)
    data_lines = re.findall(r"^\[smoke-grid/model=(\S+),method=clozemath,\S+\] data: \d+ samples .*, (.+)$", output,
                            re.MULTILINE)  # the second model shares the first one's tokenizer: its samples too
    assert data_lines == [("tiny-llama", "prepared afresh"), ("tiny-llama-b", "from the cache")], output[-3000:]
    trained = runs["smoke-grid/model=tiny-llama-b,method=clozemath,dataset=gsm8k,seed=0"]
    assert trained.data.params["model.random_init.hidden_size"] == "48"
    run_folder = folder / "runs" / "smoke-grid" / "model=tiny-llama,method=clozemath,dataset=gsm8k,seed=0"
    assert (run_folder / "adapter").is_dir()


def markdown_row(text: str, *labels: str) -> list[str]:
    for line in text.splitlines():
        cells = [cell.strip().strip("*") for cell in line.strip("|").split("|")]
        if cells[: len(labels)] == list(labels):
            return cells[len(labels):]
    raise AssertionError(f"no row {labels} in\n{text}")


@pytest.mark.slow
def test_report_prints_what_the_child_runs_hold(smoke_grid, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, folder, _ = smoke_grid
    config = tracking_of(folder)
    assert main(["report", "--experiment", "smoke-grid", "--tracking-uri", config.uri, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    runs = {(r.data.tags["model"], r.data.tags["method"]): r.data.metrics for r in children(config).values()}

    def held(model: str, method: str, metric: str) -> str:  # one seed a cell: "value (1)"
        return f"{100 * runs[(model, method)][metric]:.2f} (1)"

    models = ["tiny-llama", "tiny-llama-b"]
    table1, rest = out.split("**Table 2")
    assert "| Training set | Method | tiny-llama | tiny-llama-b |" in table1
    for method, label, decoding in (("base", "Base", "greedy"), ("clozemath", "ClozeMath", "beam")):
        assert markdown_row(table1, "GSM8K", label) == [held(m, method, f"eval/gsm8k/{decoding}/accuracy")
                                                        for m in models]
    table2, table3 = rest.split("**Table 3")[0], rest.split("**Table 3")[1].split("**Table 4")[0]
    assert "| Model | ClozeMath |" in table2  # fine-tuned methods only, as in the paper
    for model in models:
        assert markdown_row(table2, model) == [held(model, "clozemath", "eval/gsm8k/cot/accuracy")]
    assert markdown_row(table3, "GSM8K", "GSM-P1", "ClozeMath") == [held(m, "clozemath", "eval/gsm_p1/beam/accuracy")
                                                                    for m in models]
    assert (tmp_path / "accuracy_vs_steps.png").stat().st_size > 0


@pytest.mark.slow
def test_the_grids_trials_split_into_two_slices_report_as_the_grid_from_their_folders(
    smoke_grid, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The smoke grid's 4 trials as two slices, each a store of its own (a copy of the grid's keeping 2 trials, one of
    each model, one of each method), reported into its folder as bench/slice_lease.sh does; `--from` both folders
    makes the grid's own report, byte for byte: its tables, the compute table, Figure 3 and every step."""
    import sqlite3

    _, folder, _ = smoke_grid
    runs = children(tracking_of(folder))
    halves = {"a": {("tiny-llama", "base"), ("tiny-llama-b", "clozemath")},
              "b": {("tiny-llama", "clozemath"), ("tiny-llama-b", "base")}}
    argv = ["report", "--experiment", "smoke-grid", "--export-predictions"]
    for name, kept in halves.items():
        copy = tmp_path / f"{name}.db"
        with sqlite3.connect(folder / "mlruns.db") as source, sqlite3.connect(copy) as target:
            source.backup(target)
        client = tracking.client(f"sqlite:///{copy}")
        for run in runs.values():
            if (run.data.tags["model"], run.data.tags["method"]) not in kept:
                client.delete_run(run.info.run_id)
        assert main([*argv, "--tracking-uri", f"sqlite:///{copy}", "--out", str(tmp_path / name)]) == 0
    assert main([*argv, "--tracking-uri", tracking_of(folder).uri, "--out", str(tmp_path / "grid")]) == 0
    capsys.readouterr()
    assert main(["report", "--from", str(tmp_path / "a"), "--from", str(tmp_path / "b"), "--export-predictions",
                 "--out", str(tmp_path / "merged")]) == 0
    assert "2 report folders: 4 trials" in capsys.readouterr().out
    for name in ("tables.md", "summary.md", "trials.json", "steps.json.gz", "accuracy_vs_steps.png",
                 "predictions.jsonl.gz"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "grid" / name).read_bytes(), name
    compute = (tmp_path / "merged" / "tables.md").read_text().split("**Compute")[1]
    for model in ("tiny-llama", "tiny-llama-b"):
        params = next(r.data.params for r in runs.values() if r.data.tags["model"] == model
                      and r.data.tags["method"] == "clozemath")
        assert (f"| GSM8K | {model} | ClozeMath | 0 | {STEPS} | {int(params['train.trained_tokens']):,} | "
                f"{int(params['train.planned_tokens']):,} |") in compute
    with gzip.open(tmp_path / "merged" / "steps.json.gz", "rt", encoding="utf-8") as handle:
        exported = json.load(handle)
    assert [t["method"] for t in exported] == ["clozemath", "clozemath"]
    for trial in exported:  # Figure 3's points: the curve at steps 2 and 4, as the store holds it
        curve = trial["curve/gsm8k/beam/accuracy"]
        stored = steps(tracking_of(folder), trial["run_id"], "curve/gsm8k/beam/accuracy")
        assert [s for s, value in zip(trial["step"], curve) if value is not None] == stored == [2, 4]


# --------------------------------------------------------------------------------------------------------------
# Subprocesses: a Ray cluster of their own, the command line


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition, timeout: float, what: str, process: subprocess.Popen | None = None, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} while waiting for {what}")
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def ray_head(folder: Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    """`ray start --head --block` on ports and a temp folder of its own (apart from this session's Ray), with token
    authentication (Ray 2.60's default for local clusters) by a token of its own; stopped by ending that process.
    Yields the dashboard's address (for `ray job`), the cluster's (for RAY_ADDRESS) and the env with the token."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_ADDRESS": ""}
    del env["RAY_ADDRESS"]
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths live under it
    dashboard = free_port()
    ports = {
        "--port": free_port(), "--dashboard-port": dashboard, "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(), "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(), "--object-manager-port": free_port(),
    }
    command = [str(RAY), "start", "--head", "--block", "--num-cpus=8", f"--temp-dir={temp}", "--disable-usage-stats",
               "--include-dashboard=true", *(f"{flag}={port}" for flag, port in ports.items())]
    with open(folder / "head.log", "w") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for(lambda: subprocess.run([str(RAY), "job", "list", "--address", address], env=env,
                                        capture_output=True).returncode == 0, 120, "the Ray head", head, every=2)
        yield address, f"127.0.0.1:{ports['--port']}", env
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head and the node's processes it started, all at once
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_an_interrupted_grid_keeps_a_trial_run_killed_that_the_trial_ends_failed_after_the_mark(
    tmp_path: Path
) -> None:
    """The order a suite run met once: the driver marked the trial's run KILLED, and the trial, still unwinding, ended
    it FAILED 31 ms later. Here the trial's write comes 0.3 s after the driver starts marking."""
    import threading

    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="interrupted")
    parent = tracking.start_run(config, "grid", tags={"role": "grid"})
    trial = tracking.start_run(config, "grid/trial", parent_run_id=parent.run_id)
    finished = tracking.start_run(config, "grid/finished", parent_run_id=parent.run_id)
    finished.end(succeeded=True)

    def late_failure() -> None:
        time.sleep(0.3)
        trial.end(succeeded=False)

    unwinding = threading.Thread(target=late_failure)
    unwinding.start()
    ray_jobs.grid.end_interrupted(config, parent, settle_s=1.5)
    unwinding.join()
    assert (parent.status(), trial.status(), finished.status()) == ("KILLED", "KILLED", "FINISHED")


INTERRUPTED_STEPS = 12
"""The interrupted grid trains 12 steps: room for two interruptions, each past a checkpoint (every 2 steps), though
each lands some steps after the test saw the step it waited for (on a loaded machine the first driver's trial went on
from step 3 to step 6 before Ctrl-C stopped it)."""


@pytest.mark.slow
def test_an_interrupted_or_killed_driver_resumes_the_grid_without_redoing_finished_trials(
    smoke_grid, tmp_path: Path
) -> None:
    """Ctrl-C once the base trial has finished and the ClozeMath trial has passed its step-2 checkpoint: exit 130,
    the command to resume printed, the grid's and the trial's MLflow runs KILLED. The same command resumes the grid;
    its driver (and the Ray it started) is then killed once the trial has logged a step of its own, past the first
    driver's last (its run reopened: RUNNING, never ended by a process of the first driver). The same command once
    more restores the grid: the base trial keeps its run untouched, the ClozeMath trial logs on into its own run from
    its checkpoint and ends, each step logged once (steps after a checkpoint are trained twice). The trained trial's
    samples come from the smoke grid's cache (the same data and method)."""
    shutil.copytree(smoke_grid[1] / "runs" / "cache", tmp_path / "runs" / "cache")
    config = tracking_of(tmp_path)
    overrides = [str(SMOKE), "axes.model=[tiny-llama]", *SLICE, *store(tmp_path),
                 f"train.max_steps={INTERRUPTED_STEPS}"]
    python = [sys.executable, "-m", "clozemath_cli", "run", *overrides]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    base, trained = (f"smoke-grid/model=tiny-llama,method={m},dataset=gsm8k,seed=0" for m in ("base", "clozemath"))

    def trained_past(step: int, log: Path) -> Callable[[], dict[str, Run] | None]:
        def check() -> dict[str, Run] | None:
            if not any(line in log.read_text() for line in ("trials, up to", "resuming the grid")):
                return None  # the driver has not set up the MLflow store yet
            try:
                runs = children(config)
            except (MlflowException, OperationalError):  # the store is busy with the driver's trials
                return None
            if base not in runs or runs[base].info.status != "FINISHED" or trained not in runs:
                return None
            return runs if max(steps(config, runs[trained].info.run_id, "train/loss"), default=0) > step else None
        return check

    def start(log: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(python, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    first = start(tmp_path / "first.log")
    try:
        before = wait_for(trained_past(2, tmp_path / "first.log"), 480, "step 3 of the trained trial", first)
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=180) == 130
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    output = (tmp_path / "first.log").read_text()
    resume = shlex.join(["clozemath", "run", *overrides])
    assert f"clozemath: interrupted; the grid resumes where it stopped with: {resume}\n" in output
    assert "MLflow parent run" not in output  # no outcome table: nothing reads as finished
    (parent,) = tracking.find_runs(config, {"role": "grid"})
    interrupted = children(config)
    assert parent.info.status == "KILLED" and interrupted[trained].info.status == "KILLED"
    assert interrupted[base].info.status == "FINISHED"
    through = max(steps(config, interrupted[trained].info.run_id, "train/loss"))  # Ctrl-C lands steps after step 3
    assert through < INTERRUPTED_STEPS, "the first driver's trial trained every step before Ctrl-C stopped it"

    second = start(tmp_path / "second.log")
    try:  # a step past the first driver's last: the second one's, logged into the run it reopened
        killed = wait_for(trained_past(through, tmp_path / "second.log"), 480, f"step {through + 1}", second)
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
    assert "resuming the grid" in (tmp_path / "second.log").read_text()
    assert killed[trained].info.status == "RUNNING"

    code, console = run_command(["run", *overrides], 360, tmp_path / "runs")
    assert code == 0, console[-3000:]
    assert "resuming the grid" in console
    after = assert_grid_tracked(config, [base, trained], planned=INTERRUPTED_STEPS)  # each step logged once
    for name in (base, trained):  # the same runs: the finished one untouched, the interrupted one continued
        assert after[name].info.run_id == killed[name].info.run_id == before[name].info.run_id
    assert after[base].info.start_time == before[base].info.start_time
    assert after[base].info.end_time == before[base].info.end_time
    assert after[trained].info.status == "FINISHED"


@pytest.mark.slow
def test_a_trial_that_fails_on_a_user_mistake_fails_the_command_in_one_line(
    ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    experiment = ROOT / "configs" / "experiments" / "smoke.yaml"
    broken = tmp_path / "test.jsonl"
    first = (Path(os.environ["CLOZEMATH_DATA_DIR"]) / "gsm8k" / "test.jsonl").read_text().splitlines()[0]
    broken.write_text(f"{first}\n{{not json\n")  # line 2: found by the trial that reads it (the driver, line 1)
    argv = ["run", str(experiment), "method=base", f"eval.sets=[{{dataset: gsm8k, path: {broken}}}]", *store(tmp_path)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(f"clozemath: error: 1 of 1 trials failed; smoke: {broken}:2: not valid JSON")
    assert f"smoke  failed: {broken}:2: not valid JSON" in captured.out
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="smoke")
    (parent,) = tracking.find_runs(config, {"role": "grid"})
    (child,) = tracking.find_runs(config, {"role": "trial"})
    assert (parent.info.status, child.info.status) == ("FAILED", "FAILED")


def test_tune_keeps_quiet_about_a_user_mistake_only() -> None:
    def record(error: BaseException) -> logging.LogRecord:
        exc_info = (type(error), error, None)
        return logging.LogRecord("tune", logging.ERROR, __file__, 1, "Trial task failed", None, exc_info)

    quiet = QuietUserErrors()
    assert not quiet.filter(record(ClozeMathError("/nowhere: no such data file")))
    assert quiet.filter(record(RuntimeError("CUDA out of memory")))
    assert quiet.filter(logging.LogRecord("tune", logging.INFO, __file__, 1, "Trial started", None, None))


def test_the_base_model_is_evaluated_among_the_first_trials_tune_starts() -> None:
    """The matched grid lists base last of its 16 trials; on one GPU (5 trials at a time) it would wait for eleven
    trainings and evaluate alone at the end. Tune's grid search starts the trials in the order they are given."""
    from ray import tune
    from ray.tune.search.variant_generator import generate_variants

    from clozemath.plan import load_plan

    experiments = load_plan(ROOT / "configs/grids/replication_matched.yaml").experiments
    assert [e.method.name for e in experiments][-1] == "base" and len(experiments) == 16
    ordered = in_start_order(experiments)
    started = [spec["trial"] for _, spec in generate_variants({"trial": tune.grid_search([e.name for e in ordered])})]
    assert started[0] == next(e.name for e in experiments if e.method.name == "base")
    assert started[1:] == [e.name for e in experiments if e.method.trains]


def test_the_grid_key_holds_the_data_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointing a finished grid at other data (or at none) must not restore its old results."""
    data, shared = tmp_path / "data", Path(os.environ["CLOZEMATH_DATA_DIR"])
    shutil.copytree(shared / "gsm8k", data / "gsm8k")
    (data / "gsm_symbolic").symlink_to(shared / "gsm_symbolic")  # the evaluation sets' templates
    monkeypatch.setenv("CLOZEMATH_DATA_DIR", str(data))
    grid = load_config(SMOKE, [*SLICE, "axes.model=[tiny-llama]"])
    experiments = [with_absolute_paths(e) for e in expand_grid(grid, ROOT / "configs", SMOKE)]
    key = grid_key(experiments)
    assert grid_key(experiments) == key
    train = data / "gsm8k" / "train.jsonl"
    train.write_bytes(train.read_bytes().replace(b"Natalia", b"Natalie", 1))  # one letter of one problem
    edited = grid_key(experiments)
    assert edited != key
    moved = tmp_path / "elsewhere"
    shutil.copytree(data, moved)  # the same bytes in another folder: another data location
    monkeypatch.setenv("CLOZEMATH_DATA_DIR", str(moved))
    assert grid_key(experiments) not in (key, edited)
    monkeypatch.setenv("CLOZEMATH_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ClozeMathError, match="nowhere/gsm8k/train.jsonl: no such data file"):
        grid_key(experiments)


def test_a_local_store_on_several_nodes_is_warned_about(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    nodes = [{"Alive": True}, {"Alive": True}, {"Alive": False}]
    monkeypatch.setattr(ray_jobs.grid.ray, "nodes", lambda: nodes)
    warn_local_store_on_a_cluster("sqlite:////shared/mlruns.db")
    assert "warning: 2 Ray nodes log to the local store sqlite:////shared/mlruns.db" in capsys.readouterr().err
    warn_local_store_on_a_cluster("http://head:5000")
    monkeypatch.setattr(ray_jobs.grid.ray, "nodes", lambda: nodes[:1])
    warn_local_store_on_a_cluster("sqlite:////tmp/mlruns.db")
    assert capsys.readouterr().err == ""


def test_after_a_ctrl_c_every_trial_run_not_finished_is_killed(tmp_path: Path) -> None:
    """Also a run its trial ended FAILED before the grid saw the interruption (its Train run died of the shutdown):
    it resumes with the grid, as the others do."""
    config = tracking_of(tmp_path)
    parent = tracking.start_run(config, "grid", tags={"role": "grid"})
    trials = {status: tracking.start_run(config, status, parent.run_id, {"role": "trial", "trial": status})
              for status in ("FINISHED", "FAILED", "RUNNING")}
    trials["FINISHED"].end(succeeded=True)
    trials["FAILED"].end(succeeded=False)
    end_interrupted(config, parent)
    assert {name: run.info.status for name, run in children(config).items()} == {
        "FINISHED": "FINISHED", "FAILED": "KILLED", "RUNNING": "KILLED"}
    assert tracking.client(config.uri).get_run(parent.run_id).info.status == "KILLED"


def test_a_trial_failing_after_the_driver_killed_its_run_leaves_it_killed(tmp_path: Path) -> None:
    """The other order: the driver marks the run KILLED first, then the trial's Train run dies of the shutdown."""
    config = tracking_of(tmp_path)
    run = tracking.start_run(config, "trial", tags={"role": "trial", "trial": "t"})
    with pytest.raises(RuntimeError), run.ended_on_exit():
        run.end(status="KILLED")
        raise RuntimeError("the Train controller died")
    assert run.status() == "KILLED"
    with pytest.raises(RuntimeError), tracking.reopen_run(config.uri, run.run_id).ended_on_exit():
        raise RuntimeError("a failure of its own, once resumed")
    assert run.status() == "FAILED"


def test_a_trial_of_an_earlier_driver_ending_after_the_next_one_reopened_its_run_leaves_it_running(
    tmp_path: Path
) -> None:
    """A process of an interrupted driver that outlives it (its trial still unwinding) must not end the run the next
    driver has reopened and logs into, whichever way it ends; each opening ends it only while it is the latest."""
    config = tracking_of(tmp_path)
    first = tracking.start_run(config, "trial", tags={"role": "trial", "trial": "t"})
    with pytest.raises(RuntimeError), first.ended_on_exit():
        first.end(status="KILLED")  # the first driver, interrupted
        second = tracking.reopen_run(config.uri, first.run_id)  # the next driver, resuming the grid
        raise RuntimeError("the first driver's Train run dies late")
    first.end(succeeded=True)
    assert second.status() == "RUNNING"
    third = tracking.reopen_run(config.uri, first.run_id)
    second.end(status="KILLED")
    assert third.status() == "RUNNING"
    third.end(succeeded=True)
    assert first.status() == "FINISHED"
    assert tracking.client(config.uri).get_run(first.run_id).data.tags[records.OPENING_TAG] == "3"
