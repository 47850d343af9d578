"""Concurrent trials against the stores a grid logs to (slow): a local SQLite file (in WAL mode) and an MLflow
tracking server on 127.0.0.1 (SQLite backend, artifacts served); every metric of every step must be found."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from clozemath import tracking
from clozemath.cli import main
from clozemath.config import TrackingConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TRIALS, STEPS = 4, 40
METRICS = ("train/loss", "train/lr", "train/tokens_per_s", "train/pad_share")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def tracking_server(tmp_path: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with a SQLite backend and served artifacts; its URI."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--serve-artifacts",
        "--artifacts-destination", str(tmp_path / "served"), "--workers", "1",
    ]
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a busy 2-core machine takes minutes to start it
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "server.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def log_like_a_trial(uri: str, experiment: str, parent: str, index: int, folder: str) -> str:
    """What a trial logs: its child run, the four training metrics at every step, an artifact, the end."""
    config = TrackingConfig(uri=uri, experiment=experiment)
    run_id = tracking.start_run(config, f"trial-{index}", parent, {"role": "trial", "trial": str(index)})
    for step in range(1, STEPS + 1):
        tracking.log_metrics(uri, run_id, step, {name: index + step / 1000 for name in METRICS})
    artifact = Path(folder) / f"trial-{index}"
    artifact.mkdir()
    (artifact / "predictions.jsonl").write_text(f'{{"trial": {index}}}\n')
    tracking.log_artifacts(uri, run_id, artifact, "eval")
    tracking.end_run(uri, run_id)
    return run_id


def assert_trials_at_once_are_all_found(uri: str, tmp_path: Path) -> None:
    config = TrackingConfig(uri=uri, experiment="concurrent")
    parent = tracking.start_run(config, "grid", tags={"role": "grid"})
    with ProcessPoolExecutor(TRIALS) as pool:
        futures = [pool.submit(log_like_a_trial, uri, "concurrent", parent, i, str(tmp_path)) for i in range(TRIALS)]
        run_ids = [future.result(timeout=300) for future in futures]
    client = tracking.client(uri)
    found = tracking.find_runs(config, {tracking.PARENT_TAG: parent})
    assert sorted(run.info.run_id for run in found) == sorted(run_ids)
    for index, run_id in enumerate(run_ids):
        assert client.get_run(run_id).info.status == "FINISHED"
        for name in METRICS:
            history = client.get_metric_history(run_id, name)
            assert sorted((m.step, m.value) for m in history) == [(s, index + s / 1000) for s in range(1, STEPS + 1)]
        assert [a.path for a in client.list_artifacts(run_id, "eval")] == ["eval/predictions.jsonl"]


def test_four_trials_at_once_on_a_sqlite_store_in_wal_mode(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    assert_trials_at_once_are_all_found(uri, tmp_path)
    with sqlite3.connect(tmp_path / "mlruns.db") as database:
        assert database.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_four_trials_at_once_on_a_tracking_server(tracking_server: str, tmp_path: Path) -> None:
    assert_trials_at_once_are_all_found(tracking_server, tmp_path)
    assert list((tmp_path / "served").rglob("predictions.jsonl"))  # the server holds the artifacts


def test_a_run_tracks_every_step_on_a_tracking_server(
    ray_session: None, tracking_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`clozemath run` (a grid of one, trained 4 steps and evaluated) against the server."""
    experiment = ROOT / "configs" / "experiments" / "smoke.yaml"
    argv = ["run", str(experiment), "train.max_steps=4", "train.checkpoint_every=2", "eval.max_new_tokens=4",
            f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_server}"]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    config = TrackingConfig(uri=tracking_server, experiment="smoke")
    (run,) = tracking.find_runs(config, {"role": "trial"})
    client = tracking.client(tracking_server)
    for name in METRICS:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, name)) == [1, 2, 3, 4], name
    assert run.data.metrics["eval/gsm8k/greedy/total"] == 4
    assert {"config.yaml", "adapter", "eval"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
