"""Shared fixtures: one Ray instance for the whole test session (starting Ray costs seconds; on a 2-core machine
it needs 8 logical CPUs or Ray Data and Ray Train wait on each other)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests read the real data beside the checkout (`../shared/data`) unless CLOZEMATH_DATA_DIR says otherwise.
_SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "CLOZEMATH_DATA_DIR" not in os.environ and _SHARED_DATA.is_dir():
    os.environ["CLOZEMATH_DATA_DIR"] = str(_SHARED_DATA)

# Ray Data 2.60 reads Parquet footers on a pool of 32 actors per `read_parquet` (each a Python process that imports
# Ray); the tests' caches are a file or two, and on a 2-core machine starting that pool cost 10-15 s per read
# (measured: 12-16 s to read 50 rows, 2 s with one actor). Set here, before any Ray starts: the session's Ray, the
# heads and the `clozemath run` processes the tests start all inherit it, and so do their workers.
os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
# Ray Train 2.60 starts a preemption watcher actor (another process) with every worker group: it reports spot-node
# preemption notices, which no test machine gets (a lost node is noticed by Ray's health checks, not by it).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def start_session_ray() -> None:
    import ray

    from ray_jobs.cluster import runtime_env

    ray.init(num_cpus=8, runtime_env=runtime_env())


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


@pytest.fixture(scope="session")
def smoke_samples(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding the smoke experiment's prepared samples (Ray Data, once a session). A test about what
    comes after preparing copies it into its run's `<train.output_dir>/cache`: the run reads them from there."""
    from clozemath.config import load_config
    from ray_jobs.preprocess import preprocess

    cache = tmp_path_factory.mktemp("smoke_samples")
    preprocess(load_config(Path(__file__).resolve().parents[1] / "configs" / "experiments" / "smoke.yaml"), cache)
    return cache
