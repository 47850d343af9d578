"""Signals that end a command: SIGTERM (what Slurm, Kubernetes, `docker stop` and `timeout` send) and SIGHUP (a
closed terminal) are taken as Ctrl-C, and a command that cannot unwind is ended all the same.

Ctrl-C reaches a command's process group, and Ray's processes block it; SIGTERM or SIGHUP sent to the whole group
also end the Ray the command started, and a call into that Ray ends the command with exit 1 and no word (Ray's own
exit), its MLflow runs left RUNNING. So the first of them also starts a watchdog: once the command's Ray is gone
(`stuck_when`) or after `UNWIND_S`, it runs what was registered to end (`on_stuck`: the grid marks its MLflow runs
KILLED), prints the command's one line, ends the processes it started and exits 128 + the signal. Where the Ray is
gone at once (the signal went to the group), the command's own thread waits for the watchdog instead of unwinding.

A command that seems stuck prints where each of its threads is on SIGUSR2 (`kill -USR2 PID`) and goes on.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from clozemath import console

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
STACKS_SIGNAL = signal.SIGUSR2
"""Prints the stacks of the command's threads where its stderr went when it started (the terminal, also once the
command's output goes to its log). Not SIGABRT, where Ray's own handler prints nothing, nor SIGUSR1, which stops a
Ray Tune run."""
UNWIND_S = 25.0
"""How long a command may take to unwind after a signal before the watchdog ends it (an interrupted grid takes a
few seconds: Tune saves its state, the runs are marked KILLED)."""
RAY_GONE_WAIT_S = 1.0
"""How long the handler looks whether the signal ended the command's Ray too before it unwinds as Ctrl-C does (sent
to the process group, it does within milliseconds)."""
CLEANUP_S = 10.0
"""How long the watchdog waits on what was registered to end (one that waits on a lock the interrupted thread holds
would keep the command from ending)."""

_received: int | None = None
_said = False
_message = "clozemath: interrupted"
_cleanups: list[Callable[[], None]] = []
_stuck_checks: list[Callable[[], bool]] = []


def received() -> int | None:
    """The signal that is ending this command (None: none, or Ctrl-C)."""
    return _received


def exit_code() -> int:
    """128 + the signal: 143 after SIGTERM, 129 after SIGHUP, 130 after Ctrl-C."""
    return 128 + (_received or signal.SIGINT)


def say(message: str) -> None:
    """The command's last line when interrupted (`message`; default: `clozemath: interrupted`), printed once."""
    global _said
    if not _said:
        _said = True
        try:
            console.console().line(message)  # on the terminal, also while the process's output goes to its log
        except (OSError, ValueError):  # a terminal closed (SIGHUP): nothing to print on
            pass


def set_message(message: str) -> None:
    """What `say` prints if the watchdog ends the command (the command's own line: how to resume)."""
    global _message
    _message = message


@contextmanager
def on_stuck(cleanup: Callable[[], None]) -> Iterator[None]:
    """While the block runs, `cleanup` is what the watchdog runs before it ends a command that cannot unwind."""
    _cleanups.append(cleanup)
    try:
        yield
    finally:
        _cleanups.remove(cleanup)


def stuck_when(check: Callable[[], bool]) -> None:
    """`check()` true after a signal: the command cannot unwind (its Ray is gone); the watchdog ends it at once."""
    _stuck_checks.append(check)


def reset() -> None:
    """A new command in this process (tests call `main` again)."""
    global _received, _said, _message
    _received, _said, _message = None, False, "clozemath: interrupted"
    _stuck_checks.clear()


def handle(signum: int, frame: FrameType | None) -> None:
    """The handler of `ENDING_SIGNALS`: what Ctrl-C does (whatever handles SIGINT now: Tune stopping its trials and
    saving its state, else a KeyboardInterrupt), and the watchdog."""
    global _received
    first = _received is None
    _received = signum
    if first:
        threading.Thread(target=_watch, args=(signum,), name="clozemath-signal-watchdog", daemon=True).start()
        if _stuck_within(RAY_GONE_WAIT_S):  # the watchdog ends the command: this thread's next call into the Ray
            threading.Event().wait()  # that is gone would end it first, exit 1 and no word
    on_sigint = signal.getsignal(signal.SIGINT)
    if not callable(on_sigint):
        raise KeyboardInterrupt
    on_sigint(signal.SIGINT, frame)


@contextmanager
def handled() -> Iterator[None]:
    """`handle` installed for `ENDING_SIGNALS`, and the stacks printed on `STACKS_SIGNAL`, while the block runs (the
    command)."""
    previous = {number: signal.signal(number, handle) for number in ENDING_SIGNALS}
    try:
        with _stacks_on_signal():
            yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextmanager
def _stacks_on_signal() -> Iterator[None]:
    try:
        stderr = os.dup(2)  # where it goes now: the command's log replaces file descriptor 2 once it is quiet
    except OSError:  # none to print on
        yield
        return
    faulthandler.register(STACKS_SIGNAL, file=stderr, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(STACKS_SIGNAL)
        os.close(stderr)


def _stuck() -> bool:
    for check in list(_stuck_checks):
        try:
            if check():
                return True
        except Exception:  # noqa: BLE001 - a check that fails says nothing
            pass
    return False


def _stuck_within(seconds: float) -> bool:
    """Whether the command's Ray is gone within `seconds` (False at once where no Ray of its own was registered)."""
    if not _stuck_checks:
        return False
    deadline = time.monotonic() + seconds
    while not _stuck():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _watch(signum: int) -> None:
    deadline = time.monotonic() + UNWIND_S
    while time.monotonic() < deadline and not _stuck():
        time.sleep(0.2)
    cleaning = threading.Thread(target=_clean_up, name="clozemath-signal-cleanup", daemon=True)
    cleaning.start()
    cleaning.join(CLEANUP_S)
    say(_message)
    _end_children()
    os._exit(128 + signum)


def _clean_up() -> None:
    for cleanup in list(_cleanups):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the command ends all the same
            pass


def _end_children() -> None:
    """Kill what this process started and is left (Ray's processes that outlived the signal)."""
    try:
        import psutil  # DeepSpeed's and Ray's dependency

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - nothing to end then
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
