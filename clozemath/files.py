"""Output files written whole or not at all: into a temporary file beside the target, then renamed over it, so that
a failure (or Ctrl-C) midway leaves the file that was there before, never a truncated one."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from clozemath.errors import ClozeMathError

CACHE_ENV_VAR = "CLOZEMATH_CACHE_DIR"


def user_cache_root() -> Path:
    """`$CLOZEMATH_CACHE_DIR`, else the user's cache folder (`$XDG_CACHE_HOME/clozemath`, `~/.cache/clozemath`)."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "clozemath"


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh path in `path`'s folder (same suffix) to write; renamed onto `path` when the block succeeds, removed
    when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{uuid.uuid4().hex[:8]}.{path.name}")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[TextIO]:
    """A UTF-8 text handle whose content replaces `path` only once the block succeeds."""
    with atomic_path(path) as temporary, temporary.open("w", encoding="utf-8") as handle:
        yield handle


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_writer(path) as handle:
        handle.write(text)


@contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """A fresh folder beside `target` to fill; renamed to `target` (which must not exist) when the block succeeds,
    removed when it fails."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{uuid.uuid4().hex[:8]}.{target.name}")
    staging.mkdir()
    try:
        yield staging
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_folder_atomic(source: str | Path, target: str | Path) -> None:
    """Copy the folder `source` to `target`, replacing what was there only once the copy is whole.

    The copy is written beside `target`, then renamed into place: a failed copy leaves the old `target` as it was.
    Replacing an existing folder takes two renames (old aside, new in); a crash between them leaves the old folder
    beside, under a dot name, never nothing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{uuid.uuid4().hex[:8]}.{target.name}")
    old = target.with_name(f".{uuid.uuid4().hex[:8]}.{target.name}.old")
    try:
        shutil.copytree(source, staging)
        if not target.exists():
            os.rename(staging, target)
            return
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_writable_folder(path: str | Path, what: str) -> None:
    """Refuse, before anything starts, a folder that cannot be made or written: one under a file, or in a folder
    this user may not write."""
    try:
        existing = Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # a symbolic link that leads to itself (RuntimeError before Python 3.13)
        raise ClozeMathError(f"{what}: cannot make the folder '{path}': {exc}") from None
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ClozeMathError(f"{what}: cannot make the folder '{path}': '{existing}' is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ClozeMathError(f"{what}: cannot write in '{existing}'")


def check_writable_file(path: str | Path, what: str) -> None:
    """Refuse, before anything starts, an output file that cannot be written whole: a folder where it should be, or
    a folder for it that cannot be made or written (it is written beside, then renamed: `atomic_path`)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ClozeMathError(f"{what}: '{path}' is a folder; name the file to write")
    check_writable_folder(target.parent, what)


@contextmanager
def staging_folder(target: Path) -> Iterator[Path]:
    """A fresh folder beside `target` (under a dot name) to build it in, removed when the block ends: rename it onto
    `target` within the block to keep it. A lock file beside it is held while it is built (the kernel's lock, which
    ends with its process however that ends), so that `remove_abandoned_staging` tells a folder still being built
    from one whose process died."""
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    lock = staging.with_name(f"{staging.name}{_STAGING_LOCK}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            staging.mkdir()
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            lock.unlink(missing_ok=True)


_STAGING_LOCK = ".building"


def remove_abandoned_staging(folder: Path, wait_s: float = 0.0) -> list[Path]:
    """Remove the staging folders (`staging_folder`) in `folder` whose process has ended, waiting up to `wait_s` for
    those whose process is ending; the ones removed."""
    removed = []
    deadline = time.monotonic() + wait_s
    for lock in sorted(Path(folder).glob(f".*{_STAGING_LOCK}")):
        try:
            handle = open(lock)
        except FileNotFoundError:  # its build just ended
            continue
        with handle:
            if not _locked_by_then(handle, deadline):
                continue  # still being built
            staging = lock.with_name(lock.name.removesuffix(_STAGING_LOCK))
            shutil.rmtree(staging, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(staging)
    return removed


def _locked_by_then(handle: TextIO, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


STORAGE_FAULTS = ("No space left on device", "Read-only file system", "Disk quota exceeded")


def storage_fault_advice(message: str, where: Path | None = None) -> str:
    """`message`, and where it tells of a full or read-only disk, the folder that was written (`where`, if the
    message names no path), what is kept and the way on."""
    if not any(fault in message for fault in STORAGE_FAULTS):
        return message
    written = f" (writing under {where})" if where is not None and "/" not in message else ""
    return (f"{message}{written}; what finished is kept (checkpoints, adapter, predictions written so far): free "
            "space or make the folder writable, then run the same command to go on")
