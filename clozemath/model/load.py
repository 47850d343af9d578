"""Base model and tokenizer: from a hub id, a local folder, a folder inside an installed package, or a GGUF file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clozemath.config import ModelConfig
from clozemath.errors import ClozeMathError

_PACKAGE = "package:"


def resolve_location(spec: str) -> str:
    """`package:<module>[/sub/dir]` -> that folder inside the installed package; anything else unchanged."""
    if not spec.startswith(_PACKAGE):
        return spec
    module, _, sub = spec[len(_PACKAGE) :].partition("/")
    found = importlib.util.find_spec(module) if module else None
    if found is None or not found.submodule_search_locations:
        raise ClozeMathError(f"'{spec}': no installed package '{module}'")
    folder = Path(next(iter(found.submodule_search_locations))) / sub
    if not folder.exists():
        raise ClozeMathError(f"'{spec}': package '{module}' has no '{sub}'")
    return str(folder)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer: `tokenizer` when given, else the one beside the weights (read from the GGUF file)."""
    if cfg.tokenizer is not None:
        location, gguf_file = resolve_location(cfg.tokenizer), None
    else:
        assert cfg.path is not None  # ModelConfig requires a tokenizer or a path
        location, gguf_file = resolve_location(cfg.path), cfg.gguf_file
    try:
        return AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
    except (OSError, ValueError) as exc:
        raise ClozeMathError(f"model '{cfg.name}': cannot load a tokenizer from '{location}' ({exc})") from None
