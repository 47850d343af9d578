"""What transformers reads from a GGUF file (the dequantized model, the tokenizer), kept on disk so that only the
first load of a file parses it.

transformers reads a GGUF checkpoint by parsing the file (twice for a model: its config, then its tensors) and
dequantizing every tensor, at every load. For SmolLM2-135M-Instruct on 2 cores (transformers 5.24) the model took
22 s and the tokenizer 5.5 s, where the same model from safetensors takes 0.2 s and the tokenizer from its folder
0.3 s. A run loads them several times (the base model's evaluation, the training workers, the evaluation actors) and
a grid once a trial. So the first read of a file saves what it made (`save_pretrained`) into
`<cache>/from_gguf/<key>/`, and later reads load that folder.

The key holds the GGUF file's resolved path, size and modification time, what was read (the tokenizer, or the model
in one dtype) and the transformers version (whose reader made it). A folder is built beside its place and renamed
into it whole, under a file lock: a node's trial processes that load together wait for one writer.
`CLOZEMATH_GGUF_CACHE=off` parses the GGUF file every time; a cache that cannot be written (a full disk, a read-only
home) only costs the speed-up.

A model read from a GGUF file loses transformers' GGUF quantizer marker, cached or not: its weights are plain
tensors, yet `Trainer` refuses a model that carries it (TRL refused SmolLM2 so on an H100, 2026-11-27), and a folder
saved with it would be read back as a GGUF model.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from filelock import FileLock
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from clozemath.files import staging_folder, user_cache_root

SWITCH_ENV_VAR = "CLOZEMATH_GGUF_CACHE"
FOLDER = "from_gguf"

logger = logging.getLogger(__name__)

Read = TypeVar("Read", PreTrainedModel, PreTrainedTokenizerBase)
Reader = Callable[[str, "str | None"], Any]
"""Reads from a folder, or from the GGUF file of that name in it: the caller's `from_pretrained` with its settings
(for a model: dtype, attention)."""


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV_VAR, "on").strip().lower() not in {"off", "0", "false", "no"}


def cache_key(gguf: Path, part: str) -> str:
    """The folder name of `part` ("tokenizer", "model-bfloat16") read from the file `gguf` as it is now."""
    resolved = gguf.resolve()
    stat = resolved.stat()
    identity = f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}:{part}:transformers=={transformers.__version__}"
    return f"{gguf.stem}-{part}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def load_gguf_model(gguf: Path, dtype: torch.dtype, read: Reader) -> PreTrainedModel:
    """The model of the local GGUF file `gguf` in `dtype`, without the GGUF marker."""
    model = _read_through(gguf, f"model-{str(dtype).removeprefix('torch.')}", read, _without_gguf_marker)
    # a cached model answers to the GGUF file's folder, as the one read from the file does (peft writes that name
    # into an adapter's config as its base model)
    model.config._name_or_path = str(gguf.parent)
    return model


def load_gguf_tokenizer(gguf: Path, read: Reader) -> PreTrainedTokenizerBase:
    """The tokenizer of the local GGUF file `gguf`."""
    return _read_through(gguf, "tokenizer", read, lambda tokenizer: tokenizer)


def _read_through(gguf: Path, part: str, read: Reader, ready: Callable[[Read], Read]) -> Read:
    """`part` from the cache when it holds it, else from the GGUF file (made `ready`, then kept in the cache)."""
    if not enabled():
        return ready(read(str(gguf.parent), gguf.name))
    root = user_cache_root() / FOLDER
    folder = root / cache_key(gguf, part)
    if folder.is_dir():  # renamed into place whole: there is all of it
        return read(str(folder), None)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f".{folder.name}.lock"))
        lock.acquire()
    except OSError as exc:
        logger.warning("GGUF cache %s cannot be written (%s): reading %s", root, exc.strerror or exc, gguf)
        return ready(read(str(gguf.parent), gguf.name))
    try:
        if folder.is_dir():  # another process wrote it while this one waited
            return read(str(folder), None)
        made = ready(read(str(gguf.parent), gguf.name))
        _keep(made, folder)
        return made
    finally:
        lock.release()


def _keep(made: PreTrainedModel | PreTrainedTokenizerBase, folder: Path) -> None:
    try:
        with staging_folder(folder) as staging:
            made.save_pretrained(staging)
            os.rename(staging, folder)
    except OSError as exc:
        logger.warning("GGUF cache: cannot write %s (%s); the next load reads the GGUF file again",
                       folder, exc.strerror or exc)


def _without_gguf_marker(model: PreTrainedModel) -> PreTrainedModel:
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model
