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


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    from ray_jobs.cluster import runtime_env

    ray.init(num_cpus=8, runtime_env=runtime_env())
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models: threads only add overhead, and much more so on a shared 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
