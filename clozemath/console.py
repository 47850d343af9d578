"""The console a person watches: a line when a phase starts, a progress bar per training run and per evaluation set
(with what its work does between moves: `status`), our warnings (once), and a closing summary. What the libraries
print goes to log files instead (`quiet_console`).

Any process may call `phase`, `progress`, `status` and `warn`. The process that owns the console draws at once; a Ray
worker of a job whose driver routes its output (the driver sets `EVENTS_ENV_VAR` for the job) prints the event as one
marked line, which Ray forwards to the driver, whose router hands it to `replay`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

EVENTS_ENV_VAR = "CLOZEMATH_CONSOLE_EVENTS"
MARKER = "::clozemath-console::"
BAR_WIDTH = 20
SPARSE_STEPS = 10
"""Off a terminal (a log, a captured console) a bar prints a line each time it passes another tenth of its total."""
SPARSE_EVERY_S = 30.0
"""... and when it moved and this long has passed since its last line (a tenth of a long run takes minutes)."""
WORKER_MOVE_EVERY_S = 0.5
"""A Ray worker sends a bar's move within a percent of its last one sent no sooner than this after it."""
STATUS_EVERY_S = 10.0
"""A bar's status (`status`: a batch decoding between two predictions) reaches the console at most this often: a
sign of life at least this often while the bar itself stands still (a batch of generations that all loop to
`max_new_tokens` moves it once in minutes on a CPU)."""


@dataclass
class _Bar:
    started: float
    first_done: int
    label: str = ""
    done: int = 0
    total: int = 0
    stats: tuple[str, ...] = ()
    rate_unit: str | None = None
    status: str | None = None
    """What its work does now (`status`), shown after its numbers until the next one."""
    printed_step: int = -1
    printed_at: float = 0.0
    printed_done: int = -1
    printed_status: str | None = None


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Console:
    """Draws events on a terminal (bars redrawn in place) or, elsewhere, as sparse plain lines."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        """`out`, `err`: default to this process's `sys.stdout` and `sys.stderr` of the moment."""
        self._out = out
        self._err = err
        self.bars: dict[str, _Bar] = {}
        self.drawn: str | None = None
        """On a terminal: the bar line under the cursor, not yet ended."""
        self.warned: set[str] = set()
        self.phases: set[str] = set()

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    @property
    def live(self) -> bool:
        """On a terminal: bars are redrawn in place."""
        return _is_terminal(self.err)

    def line(self, text: str, stream: TextIO | None = None) -> None:
        self._end_drawn()
        print(text, file=stream or self.err, flush=True)

    def phase(self, text: str, once: bool = False) -> None:
        if not (once and text in self.phases):
            self.phases.add(text)
            self.line(text)

    def warn(self, text: str) -> None:
        if text not in self.warned:
            self.warned.add(text)
            self.line(f"warning: {text}")

    def progress(
        self, key: str, label: str, done: int, total: int, stats: Sequence[str] = (), rate_unit: str | None = None,
        at: float | None = None,
    ) -> None:
        """`at`: when the step happened (`time.time()` where it happened, default now). A worker's events reach the
        driver in bursts, so the driver's own clock would give rates of millions a second."""
        now = time.time() if at is None else at
        bar = self.bars.get(key)
        if bar is None:  # a new bar: its clock starts at its first step
            bar = self.bars[key] = _Bar(now, done)
        bar.label, bar.done, bar.total, bar.stats, bar.rate_unit = label, done, total, tuple(stats), rate_unit
        self._draw(key, bar, now)

    def status(self, key: str, text: str, at: float | None = None) -> None:
        """Show `text` after the numbers of bar `key` (redrawn now) until its next status; `at`: `progress`'s. A bar
        not drawn, or ended, takes none."""
        bar = self.bars.get(key)
        if bar is not None:
            bar.status = text
            self._draw(key, bar, time.time() if at is None else at)

    def _draw(self, key: str, bar: _Bar, now: float) -> None:
        """On a terminal: the bar redrawn in place. Elsewhere: a line at its first step, each tenth, its end, and when
        it moved (or its status changed) `SPARSE_EVERY_S` after its last line."""
        done, total = bar.done, bar.total
        finished = done >= total
        text = self._bar_text(bar, now)
        if self.live:
            self.err.write(("\n" if self.drawn not in (None, key) else "\r\x1b[K") + text)
            self.drawn = key
            if finished:
                self.err.write("\n")
                self.drawn = None
            self.err.flush()
        else:
            step = SPARSE_STEPS if finished else math.floor(SPARSE_STEPS * done / max(total, 1))
            moved = done > bar.printed_done or bar.status != bar.printed_status
            if step > bar.printed_step or (moved and now - bar.printed_at >= SPARSE_EVERY_S):
                bar.printed_step, bar.printed_at = max(step, bar.printed_step), now
                bar.printed_done, bar.printed_status = done, bar.status
                print(text, file=self.err, flush=True)
        if finished:
            del self.bars[key]

    def _bar_text(self, bar: _Bar, now: float) -> str:
        done, total = bar.done, bar.total
        share = min(1.0, done / max(total, 1))
        filled = round(BAR_WIDTH * share)
        parts = [f"{bar.label} {done}/{total} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:4.0%}", *bar.stats]
        elapsed = now - bar.started
        rate = (done - bar.first_done) / elapsed if elapsed > 0 and done > bar.first_done else None
        if rate is not None and bar.rate_unit is not None:
            parts.append(f"{rate:.2f} {bar.rate_unit}/s")
        if done >= total and done > bar.first_done:
            parts.append(f"in {_duration(elapsed)}")
        elif rate is not None and done < total:
            parts.append(f"ETA {_duration((total - done) / rate)}")
        if bar.status is not None and done < total:
            parts.append(f"· {bar.status}")
        return "  ".join(parts)

    def _end_drawn(self) -> None:
        if self.drawn is not None:
            self.err.write("\n")
            self.drawn = None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


_console: Console | None = None
_lock = threading.RLock()
"""Ray's log thread draws the workers' events while the main thread draws its own."""


def console() -> Console:
    """The console this process draws on: the one `quiet_console` set up, else one on stdout and stderr."""
    global _console
    if _console is None:
        _console = Console()
    return _console


def _emit(event: dict[str, Any]) -> None:
    if os.environ.get(EVENTS_ENV_VAR) and _console is None:  # a Ray worker: the driver draws it
        sys.stdout.write(MARKER + json.dumps(event) + "\n")  # not `print`, which Ray Train sends to stderr too
        sys.stdout.flush()
    else:
        _handle(event)


def _handle(event: dict[str, Any]) -> None:
    kind = event.pop("kind")
    with _lock:
        if kind == "phase":
            console().phase(event["text"], event.get("once", False))
        elif kind == "warn":
            console().warn(event["text"])
        elif kind == "progress":
            console().progress(**event)
        elif kind == "status":
            console().status(**event)


def phase(text: str, once: bool = False) -> None:
    """One line saying what the run does now; `once`: not again when the same line comes again (the evaluation
    actors of one trial each load the model: one line says it)."""
    _emit({"kind": "phase", "text": text, "once": once})


def warn(text: str) -> None:
    """A warning of ours: on the console once, however many workers send it."""
    _emit({"kind": "warn", "text": text})


def progress(
    key: str, label: str, done: int, total: int, stats: Sequence[str] = (), rate_unit: str | None = None
) -> None:
    """Move the bar `key` to `done` of `total` (`stats`: shown after it, e.g. "loss 2.31"; `rate_unit`: show the rate
    of `done` per second in this unit). A bar ends when `done` reaches `total`. In a Ray worker a move is sent only
    where it shows (`_Sent.shows`): an evaluation moves its bar once a prediction, hundreds a second on a GPU."""
    now = time.time()
    if done >= total:
        _statuses.last.pop(key, None)
    if os.environ.get(EVENTS_ENV_VAR) and _console is None and not _sent.shows(key, done, total, now):
        return
    _emit({"kind": "progress", "key": key, "label": label, "done": done, "total": total, "stats": list(stats),
           "rate_unit": rate_unit, "at": now})


def status(key: str, text: str) -> None:
    """What the work of bar `key` does between its moves (e.g. "greedy decoding 5 problems, token 180/256"), shown
    after its numbers until the next. Callers may call it at every step: a new text is sent `STATUS_EVERY_S` after the
    last one of the bar at the soonest (`_Statuses`), in any process."""
    now = time.time()
    if _statuses.due(key, text, now):
        _emit({"kind": "status", "key": key, "text": text, "at": now})


class _Sent:
    """The bar moves a worker has sent: a move is sent when it reaches a new percent of its bar, ends it, or comes
    `WORKER_MOVE_EVERY_S` after the last one sent (what a live bar redraws, and more than the sparse console prints);
    a bar's every move would be a line of the worker's log shipped to the driver."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, float]] = {}
        """A bar's last move sent: its percent, when."""

    def shows(self, key: str, done: int, total: int, now: float) -> bool:
        percent = math.floor(100 * done / max(total, 1))
        sent = self.last.get(key)
        if done >= total:
            self.last.pop(key, None)
            return True
        if sent is not None and percent <= sent[0] and now - sent[1] < WORKER_MOVE_EVERY_S:
            return False
        self.last[key] = (percent, now)
        return True


_sent = _Sent()


class _Statuses:
    """The statuses this process has sent, to send a bar's next one no sooner than `STATUS_EVERY_S` after its last
    (a GPU makes hundreds of steps a second) and none that says nothing new."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[str, float]] = {}
        """A bar's last status sent: its text, when (forgotten when the bar ends)."""

    def due(self, key: str, text: str, now: float) -> bool:
        sent = self.last.get(key)
        if sent is not None and (text == sent[0] or now - sent[1] < STATUS_EVERY_S):
            return False
        self.last[key] = (text, now)
        return True


_statuses = _Statuses()


class _WarningsToConsole(logging.Handler):
    """The warnings our own modules log (`clozemath.*`): on the console, once each."""

    def emit(self, record: logging.LogRecord) -> None:
        warn(record.getMessage())


_OURS = logging.getLogger("clozemath")
if not any(isinstance(handler, _WarningsToConsole) for handler in _OURS.handlers):
    _OURS.addHandler(_WarningsToConsole(logging.WARNING))


def replay(line: str) -> bool:
    """Draw the event a worker's output line carries; False for any other line."""
    marker = line.find(MARKER)
    if marker < 0:
        return False
    try:
        event = json.loads(line[marker + len(MARKER):])
    except json.JSONDecodeError:
        return False
    _handle(event)
    return True


def result(text: str) -> None:
    """Part of the command's result (a table, the summary): on stdout."""
    with _lock:
        console().line(text, console().out)


# --------------------------------------------------------------------------------------------------------------
# Quiet mode: this process's own output into a log file

_verbose = False


def set_verbose(verbose: bool) -> None:
    global _verbose
    _verbose = verbose


def verbose() -> bool:
    """`--verbose`: everything the libraries print reaches the console, as it comes."""
    return _verbose


def _terminal_copy(stream: TextIO, fd: int) -> TextIO:
    """A stream to the console that survives `fd` being pointed elsewhere (a captured stream has no fd: itself)."""
    try:
        if stream.fileno() != fd:
            return stream
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return stream
    stream.flush()
    return open(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                errors="replace")


class _LogStream(io.TextIOBase):
    """The log as this process's `sys.stdout` and `sys.stderr`: a log that can no longer be written (a full disk)
    is said once on the console, and the command goes on (its own line at the end included), never lost to it."""

    def __init__(self, log: TextIO, path: Path) -> None:
        self.log, self.path, self.failed = log, path, False

    def write(self, text: str) -> int:
        if not self.failed:
            try:
                self.log.write(text)
            except OSError as exc:
                self._failed(exc)
        return len(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.log.flush()
            except OSError as exc:
                self._failed(exc)

    def fileno(self) -> int:
        return self.log.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return self.log.encoding

    def _failed(self, exc: OSError) -> None:
        self.failed = True
        console().warn(f"{self.path}: the log cannot be written ({exc.strerror}); it stops here")


@contextmanager
def quiet_console(log_file: Path) -> Iterator[None]:
    """Everything this process prints, Python's and native code's alike (file descriptors 1 and 2), goes to
    `log_file` (appended to); the console shows only what goes through this module. Nothing changes when verbose."""
    if _verbose:
        yield
        return
    global _console
    log_file.parent.mkdir(parents=True, exist_ok=True)
    previous = _console
    _console = Console(_terminal_copy(sys.stdout, 1), _terminal_copy(sys.stderr, 2))
    streams = sys.stdout, sys.stderr
    for stream in streams:
        stream.flush()
    saved = os.dup(1), os.dup(2)
    log = open(log_file, "a", buffering=1, encoding="utf-8", errors="replace")
    stream = _LogStream(log, log_file)
    stream.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
    stream.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = stream
    try:
        yield
    finally:
        stream.flush()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        try:
            log.close()
        except OSError:  # what it held back cannot be written: `stream` said so
            pass
        _console._end_drawn()
        for copy, original in zip((_console.out, _console.err), streams):
            if copy is not original:
                copy.close()
        _console = previous
