"""math-verify under a hard wall-clock timeout that works from any thread.

math-verify's own timeout is `signal.alarm`, which only works in the main thread, and no signal can interrupt a
long computation inside C (sympy raising `9^{9^9}` to an exact integer). So each check runs in a child process
that this module kills when it overruns: a pool of long-lived workers, one per concurrent caller, each started
once (about a second to import sympy) and answering one JSON line per check (well under a millisecond of overhead).
A killed worker is replaced at once, in the background. Run as a script, this file is the worker: it imports
nothing from clozemath, so it starts from the bare file whatever the caller's package layout.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
WORKER_MEMORY_LIMIT_BYTES = 1 << 30
"""A worker's address space: sympy and math-verify take about 200 MB; a check that needs more (an expression built
to expand) fails as a mismatch, and the fallback grades it."""


class WorkerFailed(RuntimeError):
    """The worker could not start, or its protocol broke."""


class _Worker:
    """One child process running `_serve`, used by one thread at a time."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__)],  # -P: don't put this package's folder on sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # read straight from its fd, never through the file object, so select() is exact
        )
        self._buffer = b""
        self._ready = False

    def check(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        """`verify(parse(gold), parse(pred))`, or None if it ran past `timeout_s` or the worker died."""
        if not self._ready:
            if self._read_line(time.monotonic() + STARTUP_TIMEOUT_S) != b"ready":
                raise WorkerFailed(f"the math-verify worker did not start (is math-verify installed for {sys.executable}?)")
            self._ready = True
        try:
            self._process.stdin.write(json.dumps([gold, pred]).encode() + b"\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            return None
        line = self._read_line(time.monotonic() + timeout_s)
        return None if line is None else bool(json.loads(line))

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line from the worker, or None at the deadline or at end of file."""
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._process.stdin.close()
        self._process.stdout.close()


class _Pool:
    """Idle workers shared by the threads of one process; a thread takes one, or starts one if none is idle."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def check(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        with self._lock:
            worker = self._idle.pop() if self._idle else _Worker()
        try:
            result = worker.check(gold, pred, timeout_s)
        except BaseException:
            worker.close()
            raise
        if result is None:  # overran or died: kill it, and start its successor now so it is warm when needed
            worker.close()
            worker = _Worker()
        with self._lock:
            self._idle.append(worker)
        return result

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.close()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _current_pool() -> _Pool:
    """This process's pool; a forked child starts its own rather than sharing its parent's pipes."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()
            atexit.register(_pool.close)
        return _pool


FILE_BUDGET_S = 10.0
ITEM_BUDGET_S = 0.1
"""The math-verify checks of a file of N predictions may take FILE_BUDGET_S + N x ITEM_BUDGET_S seconds in all
(`file_budget_s`): regrading the 5,000 MATH test answers takes 12 s on 2 cores (23 s one at a time; 510 s allowed),
but 30 answers built to run each check to its 5 s timeout took 184 s one after another (13 s allowed)."""


def file_budget_s(items: int) -> float:
    return FILE_BUDGET_S + items * ITEM_BUDGET_S


def grading_threads() -> int:
    """As many threads as this process may use cores (each math-verify check runs in a worker process of its own)."""
    return max(1, min(len(os.sched_getaffinity(0)), 8))


@dataclass
class Budget:
    """The time the math-verify checks of one file may take together (`total_budget`), and how many of them ran past
    their time or found none left: each of those is graded by the fallback."""

    seconds: float
    deadline: float
    timed_out: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def count_timeout(self) -> None:
        with self._lock:
            self.timed_out += 1


_budget: Budget | None = None


@contextmanager
def total_budget(seconds: float) -> Iterator[Budget]:
    """Within the block, math-verify's checks (from any thread) share `seconds` in all: a check gets at most what is
    left, and none once it is spent. The budget counts the checks that timed out."""
    global _budget
    outer, _budget = _budget, Budget(seconds, time.monotonic() + seconds)
    try:
        yield _budget
    finally:
        _budget = outer


def verify_latex(gold: str, pred: str, timeout_s: float) -> bool | None:
    """Whether math-verify finds the LaTeX answer `pred` equal to `gold` (each one bare answer, as inside
    `\\boxed{}`): True/False, or None if the check ran past `timeout_s` seconds (the worker is then killed), or
    past what is left of the `total_budget` it runs in."""
    budget = _budget
    if budget is not None:
        timeout_s = min(timeout_s, budget.left())
        if timeout_s <= 0:
            budget.count_timeout()
            return None
    try:
        verdict = _current_pool().check(gold, pred, timeout_s)
    except WorkerFailed as exc:
        from clozemath.errors import ClozeMathError  # here, not above: the worker runs this file on its own

        raise ClozeMathError(str(exc)) from None
    if verdict is None and budget is not None:
        budget.count_timeout()
    elif verdict is None:
        logger.warning("math-verify ran past %.1f s on gold %.80r vs prediction %.80r", timeout_s, gold, pred)
    return verdict


def _serve() -> None:
    """Worker loop: read `[gold, pred]` JSON lines from stdin, answer each with `true`/`false` on stdout."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle; end of stdin ends this loop
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints, from Python or C, goes to stderr, never into the protocol
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = WORKER_MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    logging.disable(logging.CRITICAL)  # math-verify warns that its own timeout is off: this process is the timeout

    from math_verify import parse, verify

    def boxed(answer: str) -> list:
        return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)

    protocol.write("ready\n")
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            equal = verify(boxed(gold), boxed(pred), timeout_seconds=None)
        except Exception:  # noqa: BLE001 - a check that breaks (MemoryError, RecursionError) is a mismatch
            equal = False
        protocol.write("true\n" if equal else "false\n")


if __name__ == "__main__":
    _serve()
