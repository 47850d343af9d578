"""Join the Ray cluster at RAY_ADDRESS, or start one on this machine; either way carry the project's env vars."""

from __future__ import annotations

import os

import ray

CARRIED_ENV_VARS = ("CLOZEMATH_DATA_DIR", "HF_HUB_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
MIN_LOCAL_CPUS = 8
"""Logical CPUs of a local Ray: below about 8, Ray Data's operators and Ray Train's workers wait on each other."""


def runtime_env() -> dict[str, dict[str, str]]:
    return {"env_vars": {name: os.environ[name] for name in CARRIED_ENV_VARS if name in os.environ}}


def init_ray() -> None:
    """Nothing when Ray is already up (a test session, a Tune trial); else join RAY_ADDRESS or start locally."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env())
    else:
        ray.init(num_cpus=max(MIN_LOCAL_CPUS, os.cpu_count() or 1), runtime_env=runtime_env())
