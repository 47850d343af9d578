"""Where a model's files are (a hub id, a local folder, a GGUF file or its chunks, a folder inside an installed
package) and its tokenizer, read once a process.

Apart from `clozemath.model.load` (models, LoRA): what reads only a tokenizer (a grid's driver checking its models,
preparing data) imports neither peft nor the model classes, ~5-10 s of a process's start on 2 cores.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import struct
import threading
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HFValidationError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clozemath.config import ModelConfig
from clozemath.errors import ClozeMathError
from clozemath.model.chunks import joined_gguf
from clozemath.model.gguf_cache import load_gguf_tokenizer

PACKAGE_PREFIX = "package:"


def resolve_location(spec: str) -> str:
    """`package:<module>[/sub/dir]` -> that folder inside the installed package; any other spec unchanged."""
    if not spec.startswith(PACKAGE_PREFIX):
        return spec
    module, _, sub = spec[len(PACKAGE_PREFIX) :].partition("/")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ClozeMathError(f"{spec}: package '{module}' is not installed")
    roots = list(found.submodule_search_locations or [Path(found.origin).parent])
    folder = Path(roots[0]) / sub
    if not folder.exists():
        raise ClozeMathError(f"{spec}: no such folder {folder}")
    return str(folder)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer: `cfg.tokenizer` if set, else the one beside the weights (inside the GGUF file if any).

    Read once a process and copied for each caller (a copy ~0.15 s): a GGUF file's tokenizer takes ~7 s to read, and
    a grid's driver prepared its training sets in threads that each read it, under the GIL 55 s before any data was
    touched (SmolLM2, 4 threads, 2 cores). A copy each, because loading a model adds special tokens to it."""
    if cfg.tokenizer is not None:
        location, gguf_file = _checked_location(cfg.tokenizer, None, "tokenizer path")
    else:
        location, gguf_file = weights_location(cfg)
    key = (location, gguf_file, _modified(location, gguf_file))
    with _TOKENIZERS_LOCK:  # the other threads wait for the first reader instead of reading it too
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = _read_tokenizer(location, gguf_file)
    return copy.deepcopy(_TOKENIZERS[key])


def _read_tokenizer(location: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    def read(folder: str, gguf: str | None) -> PreTrainedTokenizerBase:
        return from_pretrained(AutoTokenizer, folder, gguf_file=gguf)

    if gguf_file is not None and looks_local(location):
        return load_gguf_tokenizer(Path(location).expanduser() / gguf_file, read)  # parsed once a file, then kept
    return read(location, gguf_file)


_TOKENIZERS: dict[tuple[str, str | None, int | None], PreTrainedTokenizerBase] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _modified(location: str, gguf_file: str | None) -> int | None:
    """When the local file a tokenizer is read from last changed (None: a hub id): a rewritten one is read again."""
    folder = Path(location).expanduser()
    candidates = [folder / gguf_file] if gguf_file else [folder / name for name in _FOLDER_MARKERS["tokenizer path"]]
    stamps = [path.stat().st_mtime_ns for path in candidates if path.is_file()]
    return max(stamps) if stamps else None


WHOLE_FILE_BYTES = 64 << 20
"""A model's files up to this size (configs, tokenizers) count by their bytes, larger ones (weights) by their size and
modification time, as the GGUF cache keys a file (`clozemath.model.gguf_cache`): hashing gigabytes at every start
costs more than it would catch."""


def local_files_identity(cfg: ModelConfig) -> dict[str, str]:
    """The local files a model and its tokenizer are read from, as they are now, by what they are (`model at
    <folder>`, `tokenizer at <folder>`): part of a run's inputs (`clozemath.plan.data_inputs`) and of its samples'
    cache key, so that weights or a tokenizer edited in place are never taken for those a run trained or prepared its
    samples with. A hub id, and chunks from packages (checked against their records when joined), name their files
    in the config."""
    found = {}
    for what, spec, gguf_file in (("model", cfg.path, cfg.gguf_file), ("tokenizer", cfg.tokenizer, None)):
        if spec is None:
            continue
        location, _ = _checked_location(spec, gguf_file, f"{what} path")  # a missing one: a one-line error
        if looks_local(location):
            folder = Path(location).expanduser().resolve()
            files = [folder / gguf_file] if gguf_file else [path for path in folder.iterdir() if path.is_file()]
            found[f"{what} at {folder}"] = _files_identity(sorted(files))
    return found


def _files_identity(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0".encode())
        if stat.st_size > WHOLE_FILE_BYTES:
            digest.update(str(stat.st_mtime_ns).encode())
        else:
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def weights_location(cfg: ModelConfig) -> tuple[str, str | None]:
    """The folder (or hub id) of the weights and the GGUF file in it, if any; chunks are joined into the cache."""
    if cfg.gguf_chunks is not None:
        assert cfg.gguf_file is not None, "ModelConfig guarantees a name for the joined file"
        return str(joined_gguf(cfg.gguf_chunks, cfg.gguf_file).parent), cfg.gguf_file
    return _checked_location(cfg.path, cfg.gguf_file)


_FOLDER_MARKERS = {"model path": ("config.json",), "tokenizer path": ("tokenizer.json", "tokenizer_config.json")}
"""A local folder without any of these files is not what it is meant to be (a GGUF file stands in for them)."""


def looks_local(location: str) -> bool:
    """A folder rather than a hub id (`org/name` or `name`)."""
    return Path(location).exists() or location.startswith(("/", ".", "~")) or location.count("/") > 1


def _checked_location(spec: str | None, gguf_file: str | None, what: str = "model path") -> tuple[str, str | None]:
    """Resolve `spec`; a local folder (and the GGUF file in it) must exist."""
    assert spec is not None, "ModelConfig guarantees a path or a tokenizer"
    location = resolve_location(spec)
    if looks_local(location):
        folder = Path(location).expanduser()
        if not folder.is_dir():
            raise ClozeMathError(f"{what} '{spec}': no such folder")
        if gguf_file is not None and not (folder / gguf_file).is_file():
            raise ClozeMathError(f"GGUF file '{gguf_file}' not found in {folder}")
        markers = _FOLDER_MARKERS[what]
        if gguf_file is None and not any((folder / marker).is_file() for marker in markers):
            raise ClozeMathError(f"{what} '{spec}': no {' or '.join(markers)} in {folder}")
        return str(folder), gguf_file
    return location, gguf_file


def from_pretrained(factory: Any, location: str, **kwargs: Any) -> Any:
    """`factory.from_pretrained` with a missing or unreachable model turned into a one-line error."""
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    try:
        return factory.from_pretrained(location, **kwargs)
    except (OSError, HFValidationError) as exc:
        raise ClozeMathError(f"model '{location}': cannot be loaded ({_first_line(exc)})") from None
    except _UNREADABLE_GGUF as exc:  # transformers' GGUF reader on a file that is not one, or not one it reads
        if "gguf_file" not in kwargs:
            raise
        raise ClozeMathError(
            f"GGUF file '{Path(location) / kwargs['gguf_file']}': cannot be read ({_first_line(exc)})"
        ) from None


_UNREADABLE_GGUF = (ValueError, struct.error, EOFError, IndexError, KeyError, OverflowError, MemoryError)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
