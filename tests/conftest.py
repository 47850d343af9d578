"""Shared fixtures: one Ray instance for the whole test session (starting Ray costs seconds; on a 2-core machine
it needs 8 logical CPUs or Ray Data and Ray Train wait on each other)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from clozemath import interrupts
from clozemath.config import ExperimentConfig
from clozemath.plan import load_config
from tests.tiering import (  # noqa: F401  (pytest's hooks: the test tiers)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_fixture_setup,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
)

if TYPE_CHECKING:
    from ray_jobs.preprocess import TokenizedSet

# The tests read the real data beside the checkout (`../shared/data`) unless CLOZEMATH_DATA_DIR says otherwise.
_SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "CLOZEMATH_DATA_DIR" not in os.environ and _SHARED_DATA.is_dir():
    os.environ["CLOZEMATH_DATA_DIR"] = str(_SHARED_DATA)

# Ray Data 2.60 reads Parquet footers on a pool of 32 actors per `read_parquet` (each a Python process that imports
# Ray); the tests' caches are a file or two, and on a 2-core machine starting that pool cost 10-15 s per read
# (measured: 12-16 s to read 50 rows, 2 s with one actor). A run's jobs read with one (`ray_jobs.cluster`); set here
# too, before any Ray starts: the heads the tests start (`ray start`) inherit it, and so do their workers.
os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
# Ray Train 2.60 starts a preemption watcher actor (another process) with every worker group: it reports spot-node
# preemption notices, which no test machine gets (a lost node is noticed by Ray's health checks, not by it).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def start_session_ray() -> None:
    import ray

    from ray_jobs.cluster import runtime_env

    # "local": a Ray of the session's own, never a cluster `ray start` left running on this machine (ray.init joins
    # one it finds) or RAY_ADDRESS's
    ray.init(address="local", num_cpus=8, runtime_env=runtime_env())


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    start_session_ray()
    yield
    ray.shutdown()


@pytest.fixture
def ray_of_its_own() -> Iterator[None]:
    """For a test that starts a Ray of its own (a multi-node `Cluster`): the session's Ray, if up, is shut down for
    it and started again after, for the tests that follow."""
    import ray

    was_up = ray.is_initialized()
    ray.shutdown()
    yield
    ray.shutdown()
    if was_up:
        start_session_ray()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models: threads only add overhead, and much more so on a shared 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ROOT = Path(__file__).resolve().parents[1]
SMOKE = "configs/experiments/smoke.yaml"
LEARNS = ["model.random_init.initializer_range=0.2", "data.limit=4", "train.num_workers=2"]
"""A few problems seen for several epochs, and a tiny model whose logits can grow (see `copy_rows` in
tests/test_train.py): the loss of 8 steps falls clearly."""
EVERY_4_STEPS = ["eval.every_steps=4", "eval.during_training_limit=2"]
"""Accuracy during training on 2 problems at steps 4 and 8: the 2 workers decode one each under ZeRO-2 and sum their
counts; under ZeRO-3 (each holds a shard of every parameter) both decode both, in step."""
SMOKE_RUN = [*LEARNS, "train.zero_stage=2", *EVERY_4_STEPS]
"""The session's `clozemath run` (`smoke_run`): 2 ZeRO-2 workers learn for 8 steps, evaluated at steps 4 and 8."""


@pytest.fixture(scope="session")
def smoke_prepared(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> TokenizedSet:
    """The samples of the smoke experiment on `LEARNS`' data, prepared afresh (Ray Data, once a session) into a cache
    folder of their own."""
    from ray_jobs.preprocess import preprocess

    return preprocess(load_config(ROOT / SMOKE, LEARNS), tmp_path_factory.mktemp("smoke_samples"))


@pytest.fixture(scope="session")
def smoke_samples(smoke_prepared: TokenizedSet) -> Path:
    """The cache folder holding `smoke_prepared`. A test about what comes after preparing copies it into its run's
    `<train.output_dir>/cache`: the run reads them from there."""
    return smoke_prepared.folder.parent


def start_command(args: list[str], console: Path) -> subprocess.Popen:
    """`python -m clozemath_cli ARGS` started with a Ray of its own (no `RAY_ADDRESS`) in a session of its own (its
    process group: what `timeout` and Slurm signal), stdout and stderr as one stream into the file `console`. A file,
    not a pipe: a process the command left behind cannot keep a test waiting."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    with open(console, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "clozemath_cli", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def ended(process: subprocess.Popen, seconds: float, console: Path, runs: Path) -> int:
    """The exit code of a command `start_command` started, once it ends. One that has not ended after `seconds`
    fails the test with the stacks of its threads (`interrupts.STACKS_SIGNAL`, printed onto its console), the end of
    its console and of the logs under `runs` (its `train.output_dir`); its process group, its Ray included, is
    ended, so the rest of the suite keeps its CPUs."""
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        process.send_signal(interrupts.STACKS_SIGNAL)
        time.sleep(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        logs = sorted(runs.glob("*/logs/*.log"))
        pytest.fail(f"clozemath {' '.join(map(str, process.args[3:5]))} did not end in {seconds:.0f} s; the end of "
                    f"its console ({console}):\n{console.read_text(errors='replace')[-12000:]}"
                    + "".join(f"\n---- {log}:\n{log.read_text(errors='replace')[-4000:]}" for log in logs))


def run_command(args: list[str], timeout: float, runs: Path) -> tuple[int, str]:
    """`python -m clozemath_cli ARGS` (`start_command`) run to its end: its exit code and console. Not ended after
    `timeout` seconds: the test fails as `ended` says."""
    with tempfile.TemporaryDirectory() as folder:
        console = Path(folder) / "console.log"
        code = ended(start_command(args, console), timeout, console, runs)
        return code, console.read_text()


def run_smoke(folder: Path, *overrides: str) -> tuple[int, list[str]]:
    """`clozemath run` on the smoke experiment in a fresh process (its own Ray), its outputs under `folder`; its
    exit code and console, stdout and stderr as one stream."""
    code, console = run_command(["run", SMOKE, f"train.output_dir={folder / 'runs'}",
                                 f"tracking.uri=sqlite:///{folder / 'mlruns.db'}", *overrides], 480, folder / "runs")
    return code, console.splitlines()


@dataclass(frozen=True)
class SmokeRun:
    code: int
    lines: list[str]
    """Its console: stdout and stderr as one stream."""
    folder: Path
    """Its `train.output_dir` is `runs/` in it, its MLflow store `mlruns.db`."""

    def config(self) -> ExperimentConfig:
        """The experiment as the run's trial resolved it (absolute paths)."""
        from ray_jobs.grid import with_absolute_paths

        store = [f"train.output_dir={self.folder / 'runs'}", f"tracking.uri=sqlite:///{self.folder / 'mlruns.db'}"]
        config = load_config(ROOT / SMOKE, [*store, *SMOKE_RUN])
        assert isinstance(config, ExperimentConfig)
        return with_absolute_paths(config)


@pytest.fixture(scope="session")
def smoke_run(smoke_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    """`clozemath run` on the smoke experiment (`SMOKE_RUN`), once a session: tests/test_console.py reads its console
    and log files, tests/test_train.py its training, MLflow run and adapter. Its samples come from `smoke_samples`
    (how a run's console reads when they are prepared afresh: the smoke grid's job)."""
    folder = tmp_path_factory.mktemp("smoke")
    shutil.copytree(smoke_samples, folder / "runs" / "cache")
    return SmokeRun(*run_smoke(folder, *SMOKE_RUN), folder)
