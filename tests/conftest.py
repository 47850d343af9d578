"""Shared fixtures: one Ray instance for the whole test session (starting Ray costs seconds; on a 2-core machine
it needs 8 logical CPUs or Ray Data and Ray Train wait on each other)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    from ray_jobs.cluster import runtime_env

    ray.init(num_cpus=8, runtime_env=runtime_env())
    yield
    ray.shutdown()
