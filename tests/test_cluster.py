"""A grid at cluster scale, on one machine (slow): concurrent trials against the stores a grid logs to, a local SQLite
file (in WAL mode) and an MLflow tracking server on 127.0.0.1 (SQLite backend, artifacts served), every metric of every
step found; then a run on a Ray cluster of several nodes (`ray.cluster_utils.Cluster`, as Ray's own tests do),
tracked on that server with its checkpoints in `train.storage`, whose training node is removed mid-training: the run
resumes from its last checkpoint on the node that is left, trains to its planned step and is evaluated."""

from __future__ import annotations

import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import cloudpickle
from ray.train import UserCallback

from clozemath import records, tracking
from clozemath.config import ExperimentConfig, TrackingConfig
from clozemath.plan import load_config
from ray_jobs.cluster import runtime_env
from ray_jobs.reports import STEPS_KEY
from ray_jobs.run import run_experiment

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "smoke.yaml"
TRIALS, STEPS = 4, 40
METRICS = ("train/loss", "train/lr", "train/tokens_per_s", "train/pad_share")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="module")
def tracking_server(server_folder: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with a SQLite backend and served artifacts (in `server_folder`); its URI. One for
    the module: starting it takes a busy 2-core machine minutes."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{server_folder / 'server.db'}", "--serve-artifacts",
        "--artifacts-destination", str(server_folder / "served"), "--workers", "1",
    ]
    with open(server_folder / "server.log", "w") as log:
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
                    raise AssertionError((server_folder / "server.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def log_like_a_trial(uri: str, experiment: str, parent: str, index: int, folder: str) -> str:
    """What a trial logs: its child run, the four training metrics at every step, an artifact, the end."""
    config = TrackingConfig(uri=uri, experiment=experiment)
    run = tracking.start_run(config, f"trial-{index}", parent, {"role": "trial", "trial": str(index)})
    for step in range(1, STEPS + 1):
        run.log_metrics(step, {name: index + step / 1000 for name in METRICS})
    artifact = Path(folder) / f"trial-{index}"
    artifact.mkdir()
    (artifact / "predictions.jsonl").write_text(f'{{"trial": {index}}}\n')
    run.log_artifacts(artifact, "eval")
    run.end()
    return run.run_id


def assert_trials_at_once_are_all_found(uri: str, tmp_path: Path) -> None:
    config = TrackingConfig(uri=uri, experiment="concurrent")
    parent = tracking.start_run(config, "grid", tags={"role": "grid"}).run_id
    with ProcessPoolExecutor(TRIALS) as pool:
        futures = [pool.submit(log_like_a_trial, uri, "concurrent", parent, i, str(tmp_path)) for i in range(TRIALS)]
        run_ids = [future.result(timeout=300) for future in futures]
    client = tracking.client(uri)
    found = tracking.find_runs(config, {records.PARENT_TAG: parent})
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


def create_experiment_at_once(uri: str, name: str, barrier: Any, results: Any) -> None:
    """A grid driver's first contacts with the store, at the same moment as the others': it looks for its earlier
    run (the 2026-11-28 lease's Table 4 driver failed there, "table mcp_servers already exists"), then asks for its
    experiment. Whichever comes first creates a new SQLite file's tables."""
    import mlflow  # noqa: F401  (imported before the barrier: the calls, not the imports, meet)

    config = TrackingConfig(uri=uri, experiment=name)
    barrier.wait()
    try:
        assert tracking.find_runs(config, {"grid": name}) == []
        tracking.experiment_id(config)
        results.put((name, "created"))
    except Exception as exc:  # noqa: BLE001  (the failure is what the test reports)
        results.put((name, f"{type(exc).__name__}: {exc}"[:200]))


def test_drivers_that_start_together_on_a_new_sqlite_store_each_create_their_experiment(tmp_path: Path) -> None:
    """Two grids' drivers started together on a fresh store (the 2026-11-27 lease: the Table 4 grid's failed with
    MLflow's "Circular dependency detected"; without the lock, 4 rounds of 3 failed 4 times on CPU; with the lock
    around the experiment alone, 3 rounds of 3 failed 3 times, at the first lookup)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    names = ["main", "table4", "lr"]
    barrier, results = spawn.Barrier(len(names)), spawn.Queue()
    drivers = [spawn.Process(target=create_experiment_at_once, args=(uri, name, barrier, results)) for name in names]
    for driver in drivers:
        driver.start()
    outcomes = dict(results.get(timeout=120) for _ in drivers)
    for driver in drivers:
        driver.join(timeout=60)
    assert outcomes == {name: "created" for name in names}
    assert sorted(e.name for e in tracking.client(uri).search_experiments()) == sorted(["Default", *names])


def _made_by_migrations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The SQLite files whose tables MLflow's migrations make from now on, in this process."""
    import mlflow.store.db.utils as db_utils

    made: list[str] = []
    migrate = db_utils._initialize_tables

    def counted(engine: Any) -> None:
        made.append(str(engine.url.database))
        migrate(engine)

    monkeypatch.setattr(db_utils, "_initialize_tables", counted)
    return made


def test_new_sqlite_stores_are_copies_of_an_empty_one_migrated_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's migrations (~5 s on 2 cores) run once per MLflow version, for the empty store in the user's cache,
    not for every new store; each store's default experiment is its own, as MLflow makes it for a store it creates."""
    monkeypatch.setenv("CLOZEMATH_CACHE_DIR", str(tmp_path / "cache"))
    made = _made_by_migrations(monkeypatch)
    configs = [TrackingConfig(uri=f"sqlite:///{tmp_path / name / 'mlruns.db'}", experiment=name)
               for name in ("first", "second")]
    for config in configs:
        tracking.experiment_id(config)
    assert len(made) == 1 and Path(made[0]).parent == tmp_path / "cache" / "mlflow"
    for config in configs:
        experiments = {e.name: e for e in tracking.client(config.uri).search_experiments()}
        assert sorted(experiments) == sorted(["Default", config.experiment])
        assert experiments["Default"].experiment_id == "0" and not experiments["Default"].tags
        assert experiments[config.experiment].artifact_location == tracking.artifact_location(config)


def test_a_cache_that_cannot_be_written_leaves_the_store_to_mlflows_migrations(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("CLOZEMATH_CACHE_DIR", str(tmp_path / "cache"))
    made = _made_by_migrations(monkeypatch)
    (tmp_path / "store").mkdir()
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'store' / 'mlruns.db'}", experiment="kept")
    tracking.experiment_id(config)
    assert made == [str(tmp_path / "store" / "mlruns.db")]
    assert sorted(e.name for e in tracking.client(config.uri).search_experiments()) == ["Default", "kept"]


def test_four_trials_at_once_on_a_tracking_server(tracking_server: str, server_folder: Path, tmp_path: Path) -> None:
    assert_trials_at_once_are_all_found(tracking_server, tmp_path)
    assert list((server_folder / "served").rglob("predictions.jsonl"))  # the server holds the artifacts


# --------------------------------------------------------------------------------------------------------------
# Losing a node

RUN_STEPS, CHECKPOINT_EVERY = 12, 2
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                   "health_check_failure_threshold": 3}
"""A dead node is noticed in about 3 s (Ray's default: about 15 s)."""


class ReportedSteps(UserCallback):
    """On the Train controller: each report's steps, a JSON line each, in the order they came."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps([step["step"] for step in metrics[0][STEPS_KEY]]) + "\n")


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the controller cannot import this test module


def reported(path: Path) -> list[int]:
    return [step for line in path.read_text().splitlines() for step in json.loads(line)] if path.exists() else []


def restarts(steps: list[int]) -> list[int]:
    """Where a restarted worker group took up again: the positions of steps not after the one before them."""
    return [at for at in range(1, len(steps)) if steps[at] <= steps[at - 1]]


def test_a_run_tracked_on_a_server_resumes_on_another_node_when_its_node_is_lost(
    smoke_samples: Path, tracking_server: str, ray_of_its_own: None, tmp_path: Path
) -> None:
    """The run trains on samples prepared earlier (in the session's Ray, before it is shut down for this test)."""
    from ray.cluster_utils import Cluster

    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")
    # The head runs the driver and the Train controller, as a real cluster's head with no CPUs for work; the run
    # trains on the one node with CPUs, which is removed after the step-2 checkpoint; another node then comes up.
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
    try:
        training_node = cluster.add_node(num_cpus=4)
        ray.init(address=cluster.address, runtime_env=runtime_env())
        storage = tmp_path / "shared"
        config = load_config(SMOKE, [
            f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_server}", f"train.storage={storage}",
            "data.limit=4",  # the data of `smoke_samples`
            f"train.max_steps={RUN_STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.report_every=1",
            "eval.max_new_tokens=4",
        ])
        assert isinstance(config, ExperimentConfig) and config.train.max_failures == 1
        log = tmp_path / "reported.jsonl"
        # The run in a thread; this one (Ray adds nodes from the main thread only) removes a node and adds one.
        with ThreadPoolExecutor(1) as driver:
            training = driver.submit(run_experiment, config, train_callbacks=[ReportedSteps(log)])
            deadline = time.monotonic() + 300
            while max(reported(log), default=0) <= CHECKPOINT_EVERY and time.monotonic() < deadline:
                if training.done():
                    break
                time.sleep(0.1)
            lost = max(reported(log), default=0)
            cluster.remove_node(training_node, allow_graceful=False)
            gone_by = max(reported(log), default=0)  # the steps its workers reported before they died
            cluster.add_node(num_cpus=4)
            outcome = training.result(timeout=600)
        alive = [node for node in ray.nodes() if node["Alive"]]
    finally:
        ray.shutdown()
        cluster.shutdown()

    assert len(alive) == 2 and training_node.node_id not in {node["NodeID"] for node in alive}
    steps = reported(log)
    assert CHECKPOINT_EVERY < lost <= gone_by < RUN_STEPS, (lost, gone_by, steps)  # lost mid-training, after the
    # step-2 checkpoint: the steps after `gone_by` were trained by new workers on the new node
    restarted = restarts(steps)  # where they took up: from a checkpoint the lost workers reached, not from step 1
    if restarted:
        (at,) = restarted
        again = steps[at]
        assert (again - 1) % CHECKPOINT_EVERY == 0 and CHECKPOINT_EVERY < again <= steps[at - 1] + 1, steps
        assert steps[:at] == list(range(1, steps[at - 1] + 1)) and steps[at:] == list(range(again, RUN_STEPS + 1))
    else:  # lost right after a checkpoint's step was reported (seen on 2 busy cores): they took up at the next step
        assert steps == list(range(1, RUN_STEPS + 1)), (gone_by, steps)
    assert list(storage.rglob("checkpoint_*")) and not (outcome.adapter.parent / "ray").exists()  # in train.storage

    client = tracking.client(tracking_server)  # every step of the run once on the server, its evaluation, artifacts
    for name in METRICS:
        logged = sorted(m.step for m in client.get_metric_history(outcome.run_id, name))
        assert logged == list(range(1, RUN_STEPS + 1)), name
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["eval/gsm8k/greedy/total"] == 4
    assert {"config.yaml", "adapter", "eval"} <= {a.path for a in client.list_artifacts(outcome.run_id)}
    assert "adapter/adapter_model.safetensors" in {a.path for a in client.list_artifacts(outcome.run_id, "adapter")}


# --------------------------------------------------------------------------------------------------------------
# A job across nodes


def test_a_two_worker_run_trains_across_two_nodes(smoke_samples: Path, ray_of_its_own: None, tmp_path: Path) -> None:
    """Two Train workers on two nodes of one CPU each (a head with none): neither node holds both, so the run's
    workers are on both nodes, and their collectives (gloo) cross between them. It trains its steps, checkpoints in
    `train.storage` and writes the adapter."""
    from ray.cluster_utils import Cluster

    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        ray.init(address=cluster.address, runtime_env=runtime_env())
        config = load_config(SMOKE, [
            f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlruns.db'}",
            f"train.storage={tmp_path / 'shared'}", "data.limit=4", "train.num_workers=2", "train.max_steps=4",
            "train.zero_stage=auto",  # the workers agree on a stage across the nodes (2: no card to fit)
            "train.checkpoint_every=2", "eval.sets=[]",
        ])
        cpus = {node["NodeID"]: node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]}
        outcome = run_experiment(config)
    finally:
        ray.shutdown()
        cluster.shutdown()

    assert sorted(cpus[node.node_id] for node in nodes) == [1, 1] and sum(cpus.values()) == 2  # one worker a node
    client = tracking.client(config.tracking.uri)
    assert sorted(m.step for m in client.get_metric_history(outcome.run_id, "train/loss")) == [1, 2, 3, 4]
    assert (outcome.adapter / "adapter_model.safetensors").is_file()
    assert list((tmp_path / "shared").rglob("checkpoint_*"))
