"""Output files written whole or not at all: into a temporary file beside the target, then renamed over it, so that
a failure (or Ctrl-C) midway leaves the file that was there before, never a truncated one."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


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
