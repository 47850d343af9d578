"""Join the Ray cluster at RAY_ADDRESS, or start one on this machine; either way carry the project's env vars."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil
import ray

from clozemath import console, interrupts
from clozemath.data.sources import LIMIT_ENV_VARS
from clozemath.errors import ClozeMathError
from ray_jobs import logs

CARRIED_ENV_VARS = (
    "CLOZEMATH_DATA_DIR", *LIMIT_ENV_VARS, "HF_HUB_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"
)
MIN_LOCAL_CPUS = 8
"""Logical CPUs of a local Ray: below about 8, Ray Data's operators and Ray Train's workers wait on each other."""
TRAIN_POLL_ENV_VAR = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
TRAIN_POLL_S = "0.05"
"""How often Ray Train's controller collects what the workers report (Ray's default: every 2 s). A worker's
`ray.train.report` waits until its previous report has been collected, so with the default no training step lasts
less than 2 s, which on a GPU is most of a run's time. A poll that goes unanswered is awaited, not failed."""
FOOTER_ACTORS_ENV_VAR = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FOOTER_ACTORS = "1"
"""Actors Ray Data (2.60) starts at each `read_parquet` to read the files' footers (its default: 32, each a Python
process that imports Ray, for many files on remote storage). A run's token ids are a few local files, read by every
trial and training worker: on 2 cores a fresh process's first read of 3 files took 8.7 s with 32, 4.8 s with one."""


def runtime_env() -> dict[str, dict[str, str]]:
    """The env vars of every task and actor of the job: the project's, a brisk Ray Train poll and one Parquet footer
    reader (unless set)."""
    env_vars = {name: os.environ[name] for name in CARRIED_ENV_VARS if name in os.environ}
    env_vars[TRAIN_POLL_ENV_VAR] = os.environ.get(TRAIN_POLL_ENV_VAR, TRAIN_POLL_S)
    env_vars[FOOTER_ACTORS_ENV_VAR] = os.environ.get(FOOTER_ACTORS_ENV_VAR, FOOTER_ACTORS)
    return {"env_vars": env_vars}


def init_ray() -> None:
    """Nothing when Ray is already up (a test session, a Tune trial); else join the cluster at RAY_ADDRESS, or start
    a Ray of this command's own (`address="local"`: never another command's or a notebook's Ray that runs on this
    machine, which `ray.init` would join); the line saying which is the command's first."""
    if ray.is_initialized():
        return
    os.environ.setdefault(FOOTER_ACTORS_ENV_VAR, FOOTER_ACTORS)  # this command's own reads
    env = runtime_env()
    env["env_vars"].update(logs.workers_env())
    address = os.environ.get("RAY_ADDRESS")
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address:
            _join(address, env)
        else:
            ray.init(address="local", num_cpus=max(MIN_LOCAL_CPUS, os.cpu_count() or 1), runtime_env=env)
            interrupts.stuck_when(_local_ray_gone(ray.get_runtime_context().gcs_address, _raylets()))
    except SystemExit as exc:  # ray.init's own SIGTERM handler, while Ray started: the command's instead
        if exc.code != signal.SIGTERM or not callable(on_sigterm):
            raise
        on_sigterm(signal.SIGTERM, None)
        raise
    finally:
        if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)  # the command's own (SIGTERM as Ctrl-C), not ray.init's exit
    logs.route_worker_output()
    resources = ray.cluster_resources()
    where = f"joined the cluster at {address}" if address else "started on this machine"
    console.phase(f"ray: {where} ({resources.get('CPU', 0):.0f} CPUs, {resources.get('GPU', 0):.0f} GPUs)")


def _raylets() -> list[psutil.Process]:
    """The raylet this command's `ray.init` started (a child of this process)."""
    raylets = []
    for child in psutil.Process().children():
        try:
            if child.name().startswith("raylet"):
                raylets.append(child)
        except psutil.Error:  # ended meanwhile
            pass
    return raylets


def _local_ray_gone(gcs_address: str, raylets: list[psutil.Process]) -> Callable[[], bool]:
    """Whether the Ray this command started is gone without it, while the command still holds it. A signal to the
    command's process group reaches Ray's processes too: within milliseconds its GCS stops listening (the process
    lingers, answering nothing: a call waits 60 s, then Ray ends the command, exit 1) and its raylet may end (the
    command's next call to it ends the command at once, exit 1, no word)."""
    host, port = gcs_address.rsplit(":", 1)

    def gone() -> bool:
        if not ray.is_initialized():
            return False
        if any(not raylet.is_running() or raylet.status() == psutil.STATUS_ZOMBIE for raylet in raylets):
            return True
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except ConnectionRefusedError:
            return True
        except OSError:  # slow to answer: busy, not gone
            return False
        return False

    return gone


def _join(address: str, env: dict[str, dict[str, str]]) -> None:
    """ray.init at RAY_ADDRESS, where a refused token is a one-line error: since Ray 2.59 `ray start` turns token
    authentication on for a local cluster, and a driver whose RAY_AUTH_MODE differs cannot join (Ray 2.60 says only
    "Failed to connect", the token's error only in the text of its cause), nor can one that wants a token and has
    none (an AuthenticationError of its own)."""
    try:
        ray.init(runtime_env=env)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        if "token" not in f"{exc!r} {exc.__cause__!r}".lower():
            raise
        mode = os.environ.get("RAY_AUTH_MODE", "disabled")
        raise ClozeMathError(
            f"the Ray cluster at {address} refused this driver (RAY_AUTH_MODE={mode}): set RAY_AUTH_MODE=token as "
            "the cluster was started, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN"
        ) from None


_REMOTE_USER_ERROR = re.compile(r"clozemath\.errors\.ClozeMathError: (.+)")


def _wrapped(exc: BaseException) -> list[BaseException]:
    """What Ray's exceptions wrap: a task's cause, Ray Train's per-worker failures and controller failure."""
    inner = [getattr(exc, "cause", None), getattr(exc, "controller_failure", None), exc.__cause__, exc.__context__]
    inner += list(getattr(exc, "worker_failures", {}).values())
    return [e for e in inner if isinstance(e, BaseException)]


def user_error(exc: BaseException) -> ClozeMathError | None:
    """The ClozeMathError a Ray task, actor or Train worker raised, found through Ray's wrappers; where only its
    text survived (a traceback in a message), its one line again."""
    seen: list[BaseException] = []
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if any(current is s for s in seen):
            continue
        seen.append(current)
        if type(current) is ClozeMathError:
            return current
        pending += _wrapped(current)
    for current in seen:
        found = _REMOTE_USER_ERROR.findall(str(current))
        if found:
            return ClozeMathError(found[-1])
    return None


@contextmanager
def user_errors_surfaced() -> Iterator[None]:
    """Re-raise a user mistake met inside Ray as the one-line ClozeMathError it is (the CLI prints it so)."""
    try:
        yield
    except Exception as exc:
        found = user_error(exc)
        if found is None:
            raise
        raise ClozeMathError(str(found)) from None
