"""The grid end to end on Ray (slow): the smoke grid (2 tiny models x base, ClozeMath) in the session's Ray, with its
MLflow parent and child runs; `clozemath report` on it; the grid through `ray start --head` + `ray job submit`; a
driver killed mid-grid, then `clozemath run` again restoring it without redoing the finished trial."""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from sqlalchemy.exc import OperationalError

from clozemath import tracking
from clozemath.cli import main
from clozemath.config import GridConfig, TrackingConfig, expand_grid, flatten, load_config
from clozemath.errors import ClozeMathError
import ray_jobs.grid
from ray_jobs.grid import (
    GridOutcome,
    QuietUserErrors,
    grid_key,
    run_grid,
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


def assert_grid_tracked(config: TrackingConfig, trials: list[str]) -> dict[str, Run]:
    """A finished parent run and one finished child run per trial, with its tags, metrics and artifacts; each step
    logged once, also where a trial resumed from a checkpoint and trained the steps after it again."""
    client = tracking.client(config.uri)
    (parent,) = tracking.find_runs(config, {"role": "grid"})
    assert parent.info.status == "FINISHED" and parent.data.tags["grid"] == "smoke-grid"
    assert parent.data.params["grid.trials"] == str(len(trials))
    runs = children(config)
    assert sorted(runs) == sorted(trials)
    for name, run in runs.items():
        tags = run.data.tags
        assert run.info.status == "FINISHED" and tags[tracking.PARENT_TAG] == parent.info.run_id
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
            # accuracy during training on the same 2 problems every 2 steps and at the end, apart from the full
            # evaluation at the last step
            curve = steps(config, run.info.run_id, "curve/gsm8k/beam/accuracy")
            evaluated = steps(config, run.info.run_id, "eval/gsm8k/beam/accuracy")
            assert logged == list(range(1, STEPS + 1)) and curve == [2, STEPS]
            assert set(evaluated) == {STEPS}
            params = run.data.params
            assert int(params["train.planned_steps"]) == STEPS and int(params["train.planned_tokens"]) > 0
    return runs


# --------------------------------------------------------------------------------------------------------------
# In this process's Ray


@pytest.fixture(scope="module")
def smoke_grid(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[GridOutcome, Path, GridConfig]:
    folder = tmp_path_factory.mktemp("grid")
    grid = load_config(SMOKE, [*SLICE, *store(folder)])
    assert isinstance(grid, GridConfig)
    return run_grid(grid, ROOT / "configs", SMOKE), folder, grid


@pytest.mark.slow
def test_smoke_grid_runs_to_the_end_tracked_as_parent_and_children(smoke_grid) -> None:
    outcome, folder, grid = smoke_grid
    experiments = [with_absolute_paths(e) for e in expand_grid(grid, ROOT / "configs", SMOKE)]
    assert [t.name for t in outcome.trials] == [e.name for e in experiments] and not outcome.failed
    runs = assert_grid_tracked(tracking_of(folder), [e.name for e in experiments])
    assert {t.name: t.run_id for t in outcome.trials} == {name: run.info.run_id for name, run in runs.items()}
    for experiment in experiments:  # params: the flattened, resolved config, for the MLflow UI to compare
        params = runs[experiment.name].data.params
        assert {key: params[key] for key in flatten(experiment)} == {k: str(v) for k, v in flatten(experiment).items()}
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

    def held(model: str, method: str, metric: str) -> str:
        return f"{100 * runs[(model, method)][metric]:.2f}"

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


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """`ray start --head --block` on ports and a temp folder of its own (apart from this session's Ray), with token
    authentication (Ray 2.60's default for local clusters) by a token of its own; stopped by ending that process."""
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
    with open(tmp_path / "head.log", "w") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for(lambda: subprocess.run([str(RAY), "job", "list", "--address", address], env=env,
                                        capture_output=True).returncode == 0, 120, "the Ray head", head, every=2)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head and the node's processes it started, all at once
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


@pytest.mark.slow
def test_the_grid_runs_as_a_ray_job(ray_head: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    address, env = ray_head
    overrides = ["axes.model=[tiny-llama]", *SLICE, *store(tmp_path)]
    job = subprocess.run(
        [str(RAY), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         sys.executable, "-m", "clozemath.cli", "run", "configs/grids/smoke.yaml", *overrides],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, (job.stdout + job.stderr)[-3000:]
    assert "ray: joined the cluster at " in job.stdout + job.stderr  # joined RAY_ADDRESS, started none
    trials = [f"smoke-grid/model=tiny-llama,method={m},dataset=gsm8k,seed=0" for m in ("base", "clozemath")]
    assert_grid_tracked(tracking_of(tmp_path), trials)


@pytest.mark.slow
def test_a_killed_driver_is_restored_without_redoing_finished_trials(tmp_path: Path) -> None:
    """The driver (and the Ray it started) is killed once the base trial has finished and the ClozeMath trial has
    passed its step-2 checkpoint; `clozemath run` again restores the grid: the base trial keeps its run, the
    ClozeMath trial logs on into its own run from its checkpoint, not from step 1."""
    config = tracking_of(tmp_path)
    command = [sys.executable, "-m", "clozemath.cli", "run", str(SMOKE), "axes.model=[tiny-llama]", *SLICE,
               *store(tmp_path)]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    base, trained = (f"smoke-grid/model=tiny-llama,method={m},dataset=gsm8k,seed=0" for m in ("base", "clozemath"))

    def base_done_and_trained_past_checkpoint() -> dict[str, Run] | None:
        if "trials, up to" not in (tmp_path / "first.log").read_text():  # the driver has set up the MLflow store
            return None
        try:
            runs = children(config)
        except (MlflowException, OperationalError):  # the store is busy with the driver's trials
            return None
        if base not in runs or runs[base].info.status != "FINISHED" or trained not in runs:
            return None
        return runs if max(steps(config, runs[trained].info.run_id, "train/loss"), default=0) >= 3 else None

    with open(tmp_path / "first.log", "w") as log:
        driver = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        before = wait_for(base_done_and_trained_past_checkpoint, 480, "the first trial", driver)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert before[trained].info.status == "RUNNING"

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resuming the grid" in again.stderr
    after = assert_grid_tracked(config, [base, trained])
    for name in (base, trained):  # the same runs: the finished one untouched, the interrupted one continued
        assert after[name].info.run_id == before[name].info.run_id
    assert after[base].info.start_time == before[base].info.start_time
    assert after[base].info.end_time == before[base].info.end_time
    assert after[trained].info.status == "FINISHED"
    logged = steps(config, after[trained].info.run_id, "train/loss")
    assert logged.count(1) == 1 and logged[-1] == STEPS, logged  # resumed from a checkpoint, not from scratch


@pytest.mark.slow
def test_ctrl_c_is_an_interruption_that_resumes_logging_each_step_once(tmp_path: Path) -> None:
    """Ctrl-C once the trial has passed its step-2 checkpoint: exit 130, the command to resume printed, the grid's
    and the trial's MLflow runs KILLED; the same command again resumes the trial into its run, each step logged
    once (steps 3.. are trained twice)."""
    config = tracking_of(tmp_path)
    command = ["clozemath", "run", str(SMOKE), "axes.model=[tiny-llama]", "axes.method=[clozemath]",
               "axes.dataset=[gsm8k]", *store(tmp_path)]
    python = [sys.executable, "-m", "clozemath.cli", *command[1:]]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    trained = "smoke-grid/model=tiny-llama,method=clozemath,dataset=gsm8k,seed=0"

    def past_checkpoint() -> dict[str, Run] | None:
        try:
            runs = children(config)
        except (MlflowException, OperationalError):
            return None
        if trained not in runs or max(steps(config, runs[trained].info.run_id, "train/loss"), default=0) < 3:
            return None
        return runs

    with open(tmp_path / "first.log", "w") as log:
        driver = subprocess.Popen(python, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        before = wait_for(past_checkpoint, 480, "step 3 of the trial", driver)
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=180) == 130
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    output = (tmp_path / "first.log").read_text()
    assert f"clozemath: interrupted; the grid resumes where it stopped with: {shlex.join(command)}\n" in output
    assert "MLflow parent run" not in output  # no outcome table: nothing reads as finished
    (parent,) = tracking.find_runs(config, {"role": "grid"})
    assert parent.info.status == "KILLED" and children(config)[trained].info.status == "KILLED"

    again = subprocess.run(python, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    after = assert_grid_tracked(config, [trained])
    assert after[trained].info.run_id == before[trained].info.run_id
    assert steps(config, after[trained].info.run_id, "train/loss") == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_trial_that_fails_on_a_user_mistake_fails_the_command_in_one_line(
    ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    experiment = ROOT / "configs" / "experiments" / "smoke.yaml"
    broken = tmp_path / "test.jsonl"
    broken.write_text("{not json\n")  # found by the trial that reads it (the driver only hashes the file)
    argv = ["run", str(experiment), "method=base", f"eval.sets=[{{dataset: gsm8k, path: {broken}}}]", *store(tmp_path)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(f"clozemath: error: 1 of 1 trials failed; smoke: {broken}:1: not valid JSON")
    assert f"smoke  failed: {broken}:1: not valid JSON" in captured.out
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
