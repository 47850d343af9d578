"""A command's log files: `<folder>/driver.log` (what the command's own process prints: Ray, Tune, MLflow) and
`<folder>/workers.log` (what Ray's workers print, forwarded to the driver by Ray's `log_to_driver`).

Ray prints its workers' output on the driver's console; instead the driver writes it to `workers.log` and draws the
console events among it (`clozemath.console`). With `--verbose` Ray prints it as well, as it does by default.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from clozemath import console
from clozemath.errors import ClozeMathError
from clozemath.files import storage_fault_advice
from clozemath.records import DRIVER_LOG, WORKERS_LOG

QUIET_WORKERS_ENV = {"RAY_DATA_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
"""The libraries' own switches for their bars (Ray Data's, one per operator redrawn every second; the Hugging Face
hub's downloads; any tqdm, such as transformers' GGUF de-quantizing), which would fill the workers' log with
redraws: our bars say how far a run is."""
RAY_PRINTER = "ray_print_logs"
"""The handler `ray.init` registers to print the workers' output (`ray._private.worker.connect`)."""
ROUTER = "clozemath_worker_output"

_folder: Path | None = None
_workers_log: TextIO | None = None
"""Open while this command's Ray is up (None: Ray was up before it, its output goes where it went)."""


@contextmanager
def logged(folder: Path) -> Iterator[None]:
    """Run a command with its output in `folder`'s log files and a quiet console (unless verbose). A Ray this
    command started is shut down before the console is given back: what Ray prints then goes to the log too. A
    failure's traceback goes to the driver's log; one that is no user mistake reaches the console as one line
    naming that log (verbose: as it is)."""
    global _folder
    _folder = folder
    try:
        with console.quiet_console(folder / DRIVER_LOG):
            try:
                yield
            except Exception as exc:
                if console.verbose() or isinstance(exc, ClozeMathError):
                    raise
                traceback.print_exc()  # into the driver's log: the process's stderr is the log here
                line = storage_fault_advice(f"{type(exc).__name__}: {_first_line(exc)}", folder.parent)
                raise ClozeMathError(f"{line} (the traceback is in {folder / DRIVER_LOG})") from None
            finally:
                _stop_routing()
    finally:
        _folder = None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


def workers_env() -> dict[str, str]:
    """Env vars for the job's workers when the driver routes their output: send console events; unless verbose,
    keep quiet where the libraries can."""
    if _folder is None:
        return {}
    return {console.EVENTS_ENV_VAR: "1", **({} if console.verbose() else QUIET_WORKERS_ENV)}


def _line_prefix(batch: dict[str, Any]) -> str:
    """Ray's own `(name pid=...)` prefix."""
    name = batch.get("actor_name") or batch.get("task_name")
    return f"({name} pid={batch.get('pid')})" if name else f"(pid={batch.get('pid')})"


def route_worker_output() -> None:
    """After `ray.init` (with `log_to_driver`): the workers' output into `workers.log`, their console events onto the
    console; with `--verbose` Ray's printing of the rest stays."""
    global _workers_log
    if _folder is None:
        return
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    _folder.mkdir(parents=True, exist_ok=True)
    log = _workers_log = open(_folder / WORKERS_LOG, "a", buffering=1, encoding="utf-8", errors="replace")

    def route(batch: dict[str, Any]) -> None:
        prefix = _line_prefix(batch)
        lines = batch.get("lines", [])
        if batch.get("pid") == "autoscaler":  # its status every few seconds: only its events, as Ray prints them
            lines = list(ray_worker.filter_autoscaler_events(lines))
        others = []
        for line in lines:
            log.write(f"{prefix} {line}\n")
            if not console.replay(line):
                others.append(line)
        if console.verbose() and others:
            ray_worker.print_to_stdstream({**batch, "lines": others}, ignore_prefix=False)

    dispatcher.remove_handler(RAY_PRINTER)
    dispatcher.add_handler(ROUTER, route)


def _stop_routing() -> None:
    """Shut down the Ray this command started (Ray prints what it held back), then close the workers' log."""
    global _workers_log
    if _workers_log is None:
        return
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    ray.shutdown()
    dispatcher.remove_handler(ROUTER)
    _workers_log.close()
    _workers_log = None
