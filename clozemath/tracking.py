"""MLflow tracking: one run per experiment (a child of its grid's run when there is one), the flattened config as
params, metrics per step, artifacts (adapter, resolved config).

A run is a `TrackedRun` (its store and id, no global active run: an `MlflowClient` per call), so the same calls
work from the driver, from a Ray Train callback in another process, or from a Tune trial. Metric and tag names live
in `clozemath.records`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import socket
import sqlite3
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from clozemath.config import TRACKING_SCHEMES, TrackingConfig
from clozemath.errors import ClozeMathError
from clozemath.files import atomic_path, check_writable_folder, user_cache_root
from clozemath.records import (
    ABLATION_TAG,
    CONFIG_ARTIFACT,
    EXPERIMENT_KIND_TAG,
    HEADLINE_PERCENT,
    HEADLINE_TAG,
    LR_TAG,
    METHOD_TAG,
    MODEL_TAG,
    MODEL_TRAINING,
    NOTE_TAG,
    GRID_TAG,
    OPENING_TAG,
    PARENT_TAG,
    REPORT_DIR,
    ROLE_TAG,
    SEED_TAG,
    TRAIN_SET_TAG,
    TRIAL_ROLE,
    readable_params,
)
from clozemath.safe_yaml import dump_yaml

if TYPE_CHECKING:  # MLflow is imported where it is used: checking a store's URI needs none of it
    from mlflow import MlflowClient
    from mlflow.entities import Run

_BATCH = 100  # MLflow's limit of params per log_batch call
_MAX_PARAM_LENGTH = 6000


def resolved_uri(uri: str) -> str:
    """A relative SQLite or file store made absolute (against the current folder), so that every process that
    logs to the run, whatever its working folder, reaches the same store."""
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme):
            path = uri[len(scheme):]
            if not path.startswith("/"):
                return f"{scheme}{Path(path).resolve()}"
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


def _sqlite_path(uri: str) -> str | None:
    """A local SQLite store's file, else None."""
    resolved = resolved_uri(uri)
    path = resolved.removeprefix("sqlite:///")
    return None if path == resolved else path


PROBE_TIMEOUT_S = 3.0
"""How long a tracking server or database may take to accept a connection when a command starts: MLflow's own
client retries a server where nothing listens for about 5 minutes before it fails."""
FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
"""MLflow 3 refuses a folder store unless this is `true`."""
_DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient"}
"""The package to install for a database driver whose module is named otherwise (else the module's name)."""
_DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
"""Where a database server listens unless its URI says otherwise (each server's default)."""


def check_tracking_uri(uri: str, what: str = "tracking.uri") -> None:
    """Refuse, within a few seconds and before any work, a store MLflow would fail on only later, after minutes of
    retries or with a traceback: an unknown scheme, a folder store (MLflow 3 refuses them: often a mistyped URI such
    as `sqlite:/x.db`), a server or database where nothing answers, a database whose driver is not installed."""
    scheme, separator, _ = uri.partition("://")
    backend = scheme.split("+")[0]
    if not separator or backend == "file":
        if os.environ.get(FILE_STORE_ENV, "").lower() != "true":
            raise ClozeMathError(
                f"{what} '{uri}': a folder store, which MLflow 3 refuses; write sqlite:///<file>.db or "
                f"http(s)://host:port (or set {FILE_STORE_ENV}=true)"
            )
        return
    if backend not in TRACKING_SCHEMES:
        raise ClozeMathError(f"{what} '{uri}': unknown scheme '{scheme}' (known: {', '.join(TRACKING_SCHEMES)})")
    if backend == "sqlite":
        _check_sqlite(uri, what)
    elif backend in ("http", "https"):
        try:
            parts = urllib.parse.urlsplit(uri)
            host, port = parts.hostname, parts.port or (443 if backend == "https" else 80)
        except ValueError as exc:
            raise ClozeMathError(f"{what} '{uri}': not a URL ({exc})") from None
        if not host:
            raise ClozeMathError(f"{what} '{uri}': no host in it (write http://host:port)")
        _probe(host, port, uri, what, "a tracking server (`mlflow server --port ...`)")
        _check_answers(uri, what)
    elif backend != "databricks":
        _check_database(uri, what)


SQLITE_HEADER = b"SQLite format 3\x00"


def _check_sqlite(uri: str, what: str) -> None:
    """A SQLite store MLflow can open: a database file (or none yet) in a folder this user can write (SQLite keeps
    its journal beside it, and the store's creation lock is there), not a folder or another kind of file."""
    path = _sqlite_path(uri)
    if path is None or path in ("", ":memory:"):
        return
    file = Path(path)
    if file.is_dir():
        raise ClozeMathError(f"{what} '{uri}': '{file}' is a folder, not a database file; name a file (.db) in it")
    if file.exists():
        try:
            with file.open("rb") as handle:
                head = handle.read(len(SQLITE_HEADER))
        except OSError as exc:
            raise ClozeMathError(f"{what} '{uri}': '{file}' cannot be read ({exc.strerror})") from None
        if head and head != SQLITE_HEADER:
            raise ClozeMathError(f"{what} '{uri}': '{file}' is not a SQLite database; point {what} at another file")
    check_writable_folder(file.parent, f"{what} '{uri}'")


ANSWER_TIMEOUT_S = 10.0
"""How long a tracking server that accepts connections may take to answer a request when a command starts."""


def _check_answers(uri: str, what: str) -> None:
    """A tracking server that accepts connections answers a request in time (any answer: its health page, an error;
    a TLS or proxy failure is MLflow's to report, with its own settings)."""
    import requests

    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=ANSWER_TIMEOUT_S)
    except requests.exceptions.Timeout:
        raise ClozeMathError(
            f"{what} '{uri}': the server accepts connections but gives no answer within {ANSWER_TIMEOUT_S:.0f} s: "
            f"restart it or point {what} elsewhere"
        ) from None
    except requests.exceptions.RequestException:
        pass


def _check_database(uri: str, what: str) -> None:
    """A database store: SQLAlchemy reads the URI and imports its driver (as MLflow will), then its server is
    probed."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        dialect = url.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise ClozeMathError(f"{what} '{uri}': not a database URI SQLAlchemy reads ({exc})") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        module = exc.name or dialect.driver
        raise ClozeMathError(
            f"{what} '{uri}': its database driver '{module}' is not installed "
            f"(pip install '{_DRIVER_PACKAGES.get(module, module)}')"
        ) from None
    if url.host:
        port = url.port or _DATABASE_PORTS.get(url.get_backend_name())
        _probe(url.host, port, uri, what, "its database server")


def _probe(host: str, port: int | None, uri: str, what: str, server: str) -> None:
    if port is None:
        return
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        raise ClozeMathError(
            f"{what} '{uri}': nothing answers at {host}:{port} within {PROBE_TIMEOUT_S:.0f} s ({reason}): start "
            f"{server} or point {what} elsewhere"
        ) from None


def artifact_location(tracking: TrackingConfig) -> str | None:
    """The configured artifact location, else `mlartifacts/` beside a local SQLite store (None: MLflow decides)."""
    if tracking.artifact_location is not None:
        location = tracking.artifact_location
        return location if "://" in location else Path(location).resolve().as_uri()
    path = _sqlite_path(tracking.uri)
    return None if path is None else (Path(path).parent / "mlartifacts").as_uri()


HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "12", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
"""A request to a tracking server ends within about 25 s (12 s without an answer, one retry): MLflow's own defaults
(120 s, 7 retries with a doubling backoff) waited on a server that accepts connections but never answers for far
longer than a user does. Set the variables to override."""
BUSY_WAIT_S = 600.0
"""How long a call waits, retrying with a growing pause, for a SQLite store that another writer holds."""


def client(uri: str) -> MlflowClient:
    """A client of the store, whose tables this process has made sure of first (`_store_ready`)."""
    from mlflow import MlflowClient

    for name, value in HTTP_LIMITS.items():
        os.environ.setdefault(name, value)
    resolved = resolved_uri(uri)
    answered(resolved, lambda: _store_ready(resolved))
    return MlflowClient(tracking_uri=resolved)


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    while exc is not None and not any(exc is seen for seen in found):
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def _busy(exc: BaseException) -> bool:
    """A SQLite store another writer holds."""
    return any("database is locked" in str(error) or "database is busy" in str(error) for error in _chain(exc))


def _unanswered(exc: BaseException) -> bool:
    """A tracking server that did not answer (MLflow's retries spent)."""
    import requests

    return any(isinstance(error, requests.exceptions.RequestException) or "Max retries exceeded" in str(error)
               or "timed out" in str(error).lower() for error in _chain(exc))


T = TypeVar("T")
_unanswering: set[str] = set()
"""The tracking servers that did not answer this process."""
UNANSWERED_MEMORY_S = 600.0
"""How long a server that did not answer one process (a trial) is checked quickly by the others (the grid's driver,
the next trials), instead of each waiting out `HTTP_LIMITS` again."""
HEALTH_TIMEOUT_S = 3.0


def _unanswered_mark(uri: str) -> Path:
    """Where processes on this machine leave word that the server at `uri` did not answer."""
    return Path(tempfile.gettempdir()) / "clozemath-tracking" / hashlib.sha256(uri.encode()).hexdigest()[:16]


def _remember_unanswered(uri: str) -> None:
    _unanswering.add(uri)
    mark = _unanswered_mark(uri)
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(uri)
    except OSError:
        pass  # only a shortcut for the other processes


def _known_unanswering(uri: str) -> bool:
    """This process found the server silent, or another did lately and its health check still gets no answer in
    `HEALTH_TIMEOUT_S` (a server that answers again clears the mark)."""
    if uri in _unanswering:
        return True
    mark = _unanswered_mark(uri)
    try:
        recent = time.time() - mark.stat().st_mtime < UNANSWERED_MEMORY_S
    except OSError:
        return False
    if not recent:
        return False
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S):
            pass
    except (OSError, ValueError):  # no answer, or no HTTP server to ask
        _unanswering.add(uri)
        return True
    mark.unlink(missing_ok=True)
    return False


def answered(uri: str, call: Callable[[], T], busy_wait_s: float = BUSY_WAIT_S) -> T:
    """`call()` (an MLflow call to the store at `uri`), retried with a growing pause while a SQLite store is held by
    another writer (up to `busy_wait_s`); a server that does not answer (`HTTP_LIMITS`) or a store busy beyond that
    is one line naming it."""
    deadline, pause = time.monotonic() + busy_wait_s, 0.5
    while True:
        try:
            if _known_unanswering(uri):  # once is enough: a run's last calls, the driver's after a trial's, wait no more
                raise ConnectionError(f"{uri}: Max retries exceeded before")
            return call()
        except Exception as exc:
            if _busy(exc) and time.monotonic() + pause < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 15.0)
                continue
            if _busy(exc):
                raise ClozeMathError(
                    f"tracking store '{uri}': held by another writer for {busy_wait_s:.0f} s; what the run made "
                    "stays in its folder under train.output_dir: run the same command once the store is free to log "
                    "it (nothing finished is trained or evaluated again)"
                ) from None
            if _unanswered(exc):
                _remember_unanswered(uri)
                tries = int(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")) + 1
                raise ClozeMathError(
                    f"tracking server '{uri}' stopped answering (no answer within "
                    f"{os.environ.get('MLFLOW_HTTP_REQUEST_TIMEOUT')} s, {tries} tries); what the run made stays in "
                    "its folder under train.output_dir: start the server again and run the same command to log on"
                ) from None
            raise


@functools.cache
def _store_ready(uri: str) -> None:
    """The process's first contact with a store, under the creation lock: whichever call comes first (a grid's
    driver looks for its earlier run before it asks for its experiment) creates a new SQLite file's tables."""
    from mlflow import MlflowClient

    with _creating(uri):
        path = _sqlite_path(uri)
        if path is not None and not Path(path).exists():
            try:
                _copy_empty_store(Path(path))
            except (OSError, sqlite3.Error):  # a cache that cannot be written only costs the speed-up: MLflow
                pass  # creates the tables itself
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # creates a SQLite store's tables
    write_ahead_log(uri)


def _copy_empty_store(path: Path) -> None:
    """A new SQLite store begins as a copy of one with MLflow's tables and nothing in them, made once per MLflow
    version in the user's cache: creating the tables runs MLflow's migrations, ~5 s on 2 cores for every new store
    (a first run into a folder, each test's). MLflow then adds the default experiment to the copy, with its own
    artifact root, as it does to a store it creates. Called under `_creating`'s lock; the copy is also renamed into
    place whole, so a process that opens the store without the lock never meets half a file."""
    import mlflow
    from filelock import FileLock
    from mlflow import MlflowClient

    empty = user_cache_root() / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    with FileLock(f"{empty}.lock"):
        if not empty.is_file():
            with atomic_path(empty) as building:
                MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments(max_results=1)
                with closing(sqlite3.connect(building)) as database, database:  # the default experiment: the copy's
                    database.execute("delete from experiment_tags where experiment_id = 0")
                    database.execute("delete from experiments where experiment_id = 0")
    with atomic_path(path) as copying:
        shutil.copyfile(empty, copying)


def experiment_id(tracking: TrackingConfig) -> str:
    """The experiment's id, creating it (with an explicit artifact location) when it does not exist yet; either way a
    model-training experiment (`EXPERIMENT_KIND_TAG`), so that the MLflow UI opens it on its runs table."""
    mlflow = client(tracking.uri)
    found = answered(tracking.uri, lambda: mlflow.get_experiment_by_name(tracking.experiment))
    if found is not None:
        if found.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING:  # one made before the tag, or by hand
            set_experiment_tags(tracking.uri, found.experiment_id, {EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        return found.experiment_id
    from mlflow.exceptions import MlflowException

    try:
        return answered(tracking.uri, lambda: mlflow.create_experiment(
            tracking.experiment, artifact_location=artifact_location(tracking),
            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING}))
    except MlflowException:  # created concurrently (grid trials start together)
        return answered(tracking.uri, lambda: mlflow.get_experiment_by_name(tracking.experiment)).experiment_id


def set_experiment_tags(uri: str, experiment: str, tags: Mapping[str, str]) -> None:
    """Set tags of the experiment (by id): its kind, its description (`NOTE_TAG`), a saved view of its runs table."""
    mlflow = client(uri)
    for key, value in tags.items():
        answered(uri, lambda: mlflow.set_experiment_tag(experiment, key, value))


NOTE_START = "**clozemath grid "
"""How the experiment descriptions clozemath writes begin (and the only ones it writes over)."""


def describe_experiment(tracking: TrackingConfig, grid_run: TrackedRun, grid: str, report_files: list[str],
                        view: str) -> None:
    """The experiment's description (`NOTE_TAG`, shown above its runs table): where the grid's trials are compared
    (`view`, `trials_view`'s) and which grid run holds the report among its artifacts. A description a person wrote
    (one that is not ours) is left as it is."""
    experiment = experiment_id(tracking)
    held = answered(tracking.uri, lambda: client(tracking.uri).get_experiment(experiment)).tags.get(NOTE_TAG)
    if held and not held.startswith(NOTE_START):
        return
    run = answered(tracking.uri, lambda: client(tracking.uri).get_run(grid_run.run_id))
    folder = f"#/experiments/{experiment}/runs/{grid_run.run_id}/artifacts"
    files = ", ".join(f"[{name}]({folder}/{REPORT_DIR}/{name}?{MODEL_TRAINING_PAGE})" for name in report_files)
    note = (
        f"{NOTE_START}`{grid}`**: [its trials side by side]({view}) (the view "
        f"'{_view_name(grid)}'), each named by what varies between them, with its headline accuracy in percent "
        f"(`{HEADLINE_PERCENT}`, of `{HEADLINE_TAG}`) and its `{ABLATION_TAG}` (the paper's row), `{METHOD_TAG}`, "
        f"`{SEED_TAG}`, `{LR_TAG}`, `{MODEL_TAG}` and `{TRAIN_SET_TAG}`. The report is among the artifacts of the grid "
        f"run [{run.info.run_name}]({folder}?{MODEL_TRAINING_PAGE}) (`{grid_run.run_id}`), in `{REPORT_DIR}/`: {files}. Made again, or "
        f"with other grids: `clozemath report --experiment {tracking.experiment} --tracking-uri "
        f"{resolved_uri(tracking.uri)}`."
    )
    set_experiment_tags(tracking.uri, experiment, {NOTE_TAG: note})


VIEW_TAG_PREFIX, VIEW_KEY_PARAM = "mlflow.sharedViewState.", "viewStateShareKey"
"""A saved view of an experiment's runs table, as the MLflow UI (3.x) saves one: an experiment tag holding its
name and its state (columns, filter, order), opened by `#/experiments/<id>/runs?viewStateShareKey=<key>` and listed
under the table's Views."""
MODEL_TRAINING_PAGE = "workflowType=machine_learning"
"""The MLflow UI's switch to its model-training pages: 3.17 opens an experiment on GenAI's traces overview unless
the URL (or the user's last choice) says otherwise, whatever the experiment's kind tag says."""
VIEW_COLUMNS = (f"metrics.`{HEADLINE_PERCENT}`", *(f"tags.`{tag}`" for tag in (
    ABLATION_TAG, METHOD_TAG, SEED_TAG, LR_TAG, MODEL_TAG, TRAIN_SET_TAG, HEADLINE_TAG)))
"""The columns a trial is compared by (the UI's column ids: `metrics.`, `tags.`, then the name in backquotes)."""
VIEW_WIDTHS = {"tags.`mlflow.runName`": 240, f"metrics.`{HEADLINE_PERCENT}`": 110, f"tags.`{ABLATION_TAG}`": 230,
               f"tags.`{METHOD_TAG}`": 130, f"tags.`{SEED_TAG}`": 55, f"tags.`{LR_TAG}`": 60,
               f"tags.`{MODEL_TAG}`": 100, f"tags.`{TRAIN_SET_TAG}`": 85, f"tags.`{HEADLINE_TAG}`": 115}
"""Pixels: every column whole in a 1600-pixel window beside MLflow's own (run names such as `clozemath_causal · seed
0`, the paper's longest row name)."""


def _view_key(grid: str) -> str:
    return "clozemath-" + re.sub(r"[^A-Za-z0-9_-]+", "-", grid)


def _view_name(grid: str) -> str:
    return f"clozemath: {grid} trials"


def trials_view(tracking: TrackingConfig, grid: str) -> str:
    """The UI's address (after its host) of the grid's trials side by side: the model-training runs table of the
    experiment, opened on a saved view (written here) that shows the trials alone with the columns they are
    compared by (`VIEW_COLUMNS`), in the paper's method order within each model."""
    experiment = experiment_id(tracking)
    state = {
        "searchFilter": f"tags.`{ROLE_TAG}` = '{TRIAL_ROLE}' and tags.`{GRID_TAG}` = {_quoted(grid)}",
        "orderByKey": f"tags.`{METHOD_TAG}`", "orderByAsc": True,
        "selectedColumns": list(VIEW_COLUMNS), "columnOrder": ["tags.`mlflow.runName`", *VIEW_COLUMNS],
        "columnWidths": VIEW_WIDTHS,
    }
    now = int(time.time() * 1000)
    saved = {"name": _view_name(grid), "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
    set_experiment_tags(tracking.uri, experiment, {f"{VIEW_TAG_PREFIX}{_view_key(grid)}": json.dumps(saved)})
    return f"#/experiments/{experiment}/runs?{MODEL_TRAINING_PAGE}&{VIEW_KEY_PARAM}={_view_key(grid)}"


@contextmanager
def _creating(uri: str) -> Iterator[None]:
    """One process at a time creates a new SQLite store's tables: two drivers that start together on a fresh file
    (a grid and Table 4's beside it) both ran MLflow's migrations and one failed ("duplicate column name",
    "Circular dependency detected", "table mcp_servers already exists"). The lock file stays beside the store."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        yield


def write_ahead_log(uri: str) -> None:
    """Put a SQLite store in WAL mode (it stays so): a reader (a trial looking for its run, `mlflow ui`, the report)
    no longer blocks the trials that write, and writers queue (MLflow waits up to 20 s for the lock). Several
    machines need a tracking server: SQLite locks do not hold on network file systems."""
    path = _sqlite_path(uri)
    if path is None:
        return
    try:
        with closing(sqlite3.connect(path, timeout=20)) as database:
            database.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError:  # busy beyond the timeout: the next run sets it
        pass


@dataclass(frozen=True)
class TrackedRun:
    """One MLflow run: what is logged to it goes through here. Plain data (a store and a run id), so it travels to
    other processes (a Ray Train controller callback, a Tune trial) and each call opens its own client. `uri` is
    resolved where the run was started or reopened, so that a process in another folder reaches the same store."""

    uri: str
    run_id: str
    opening: int | None = None
    """The opening of the run this handle was made by (`start_run`: 1, `reopen_run`: the next); it ends the run only
    while that is the run's latest (`OPENING_TAG`). None: whichever (a grid's driver ending its trials' runs)."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, str(value)[:_MAX_PARAM_LENGTH]) for key, value in params.items()]
        mlflow = client(self.uri)
        for start in range(0, len(items), _BATCH):
            answered(self.uri, lambda: mlflow.log_batch(self.run_id, params=items[start : start + _BATCH]))

    def log_config(self, config: BaseModel) -> None:
        """The config as readable params (`readable_params`) and the resolved config as `config.yaml`. A run logged
        into again (a trial resumed) keeps the params it has: MLflow refuses to change one, and a run begun by an
        older version spelled some otherwise."""
        logged = answered(self.uri, lambda: client(self.uri).get_run(self.run_id)).data.params
        self.log_params({key: value for key, value in readable_params(config).items() if key not in logged})
        self.log_text(dump_yaml(config), CONFIG_ARTIFACT)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if not metrics:
            return
        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        answered(self.uri, lambda: client(self.uri).log_batch(self.run_id, metrics=items))

    def last_step(self, metric: str) -> int:
        """The last step at which the run logged `metric` (0 if never)."""
        history = answered(self.uri, lambda: client(self.uri).get_metric_history(self.run_id, metric))
        return max((m.step for m in history), default=0)

    def history(self, metric: str) -> list[float]:
        """The run's values of `metric`, by step."""
        logged = answered(self.uri, lambda: client(self.uri).get_metric_history(self.run_id, metric))
        return [m.value for m in sorted(logged, key=lambda m: (m.step, m.timestamp))]

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        answered(self.uri, lambda: client(self.uri).log_artifacts(self.run_id, str(folder), artifact_path=artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        answered(self.uri, lambda: client(self.uri).log_text(self.run_id, text, artifact_file))

    def end(self, succeeded: bool = True, status: str | None = None) -> None:
        """End the run FINISHED or FAILED (`succeeded`), or with the given `status` (KILLED: interrupted); not if
        another driver has reopened it since this handle's opening: a trial of an interrupted driver still ending
        (a Ray process outliving it) would end the run the next driver logs into. (A reopening between the check and
        the write is not excluded: MLflow has no conditional write; a driver reopens a run seconds after it starts.)"""
        if self.opening is not None and self.opening != _opening(self._run()):
            return
        final = status or ("FINISHED" if succeeded else "FAILED")
        answered(self.uri, lambda: client(self.uri).set_terminated(self.run_id, status=final))

    def _run(self) -> Run:
        return answered(self.uri, lambda: client(self.uri).get_run(self.run_id))

    def status(self) -> str:
        return self._run().info.status

    @contextmanager
    def ended_on_exit(self) -> Iterator[TrackedRun]:
        """The run, ended FINISHED when the block completes and FAILED when it raises (Ctrl-C included), unless
        it was ended KILLED meanwhile (a grid's driver interrupted: the trial's failure is the interruption's)."""
        succeeded = False
        try:
            yield self
            succeeded = True
        finally:
            if succeeded or self.status() != "KILLED":
                self.end(succeeded)


def start_run(
    tracking: TrackingConfig, name: str, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None
) -> TrackedRun:
    """Create a run (running) in the config's experiment."""
    all_tags = dict(tags or {})
    if parent_run_id is not None:
        all_tags[PARENT_TAG] = parent_run_id
    experiment = experiment_id(tracking)
    run = answered(tracking.uri, lambda: client(tracking.uri).create_run(experiment, tags=all_tags, run_name=name))
    return TrackedRun(resolved_uri(tracking.uri), run.info.run_id, opening=1)


def reopen_run(uri: str, run_id: str) -> TrackedRun:
    """Mark a run running again (a trial resumed after its driver died logs on into the run it had), as its next
    opening (`OPENING_TAG`, bumped first): the handles of earlier openings no longer end it."""
    from mlflow.entities import RunStatus

    mlflow = client(uri)
    opening = _opening(answered(uri, lambda: mlflow.get_run(run_id))) + 1
    answered(uri, lambda: mlflow.set_tag(run_id, OPENING_TAG, str(opening)))
    answered(uri, lambda: mlflow.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING)))
    return TrackedRun(resolved_uri(uri), run_id, opening)


def _opening(run: Run) -> int:
    """The run's latest opening: 1 until a driver reopens it."""
    return int(run.data.tags.get(OPENING_TAG, "1"))


def find_runs(tracking: TrackingConfig, tags: Mapping[str, str]) -> list[Run]:
    """The runs of the config's experiment carrying all these tags, newest first (none if it does not exist)."""
    mlflow = client(tracking.uri)
    experiment = answered(tracking.uri, lambda: mlflow.get_experiment_by_name(tracking.experiment))
    if experiment is None:
        return []
    query = " and ".join(f"tags.`{key}` = {_quoted(value)}" for key, value in tags.items())
    newest_first = ["attributes.start_time DESC"]
    return list(answered(tracking.uri, lambda: mlflow.search_runs(
        [experiment.experiment_id], filter_string=query, order_by=newest_first)))


def _quoted(value: str) -> str:
    """A value in MLflow's search syntax, quoted with a quote it does not hold (a name with an apostrophe,
    `o'brien`, broke the search after Ray had started). MLflow's search cannot hold both quotes: names with both are
    refused with the config (`clozemath.config`)."""
    if "'" in value and '"' in value:
        raise ClozeMathError(f"{value!r}: holds both quotes (' and \"), which MLflow's search cannot find")
    return f'"{value}"' if "'" in value else f"'{value}'"
