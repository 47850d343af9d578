"""Decoding: batched greedy decoding, beam search and CoT-decoding over the KV cache, each a decoding by name.

Prompts are decoded longest first. A batch of them (left-padded) is encoded in one forward pass, causally or, for
PrefixLM-trained models, with bidirectional attention over the whole prompt; that pass fills the KV cache, and
generation continues causally over it, one token per row per step. A row ends at an end-of-sequence token, at a stop
string, or after `max_new_tokens`.

- `run.decode`: the entry point; `settings.DecodeSettings`: how (one object, built from an `EvalConfig` by
  `DecodeSettings.of`); `job.DecodeProgress`: where a batch is, at the host's looks (`decode(on_progress=...)`).
- the decodings (`registry`: name -> `job.Decoding`): `rows` (greedy; rows that continue greedily), `cot`
  (CoT-decoding), `beam` (beam search). Adding one: a module and a line in `registry.DECODINGS`.
- the engines that step the rows: `eager` (transformers' DynamicCache: CPU, and ZeRO-3 during training) and `static`
  (CUDA: a preallocated cache, its step replayed as a CUDA graph; greedy and CoT rows refilled as prompts end).
- `batching`: how many prompts a batch holds (`batch_size="auto"`: the device's free memory).
- `tokens`: a row's tokens, text, stop strings and the `Generation` a prompt gets.

The registry and the settings import no torch: configs check their names and build settings without the engines,
which load (seconds) at the first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from clozemath.eval.decoding.registry import decoding_names, get_decoding, register
from clozemath.eval.decoding.settings import AnswerSpan, DecodeSettings, Engine, PromptAttention

if TYPE_CHECKING:
    from clozemath.eval.decoding.batching import (
        AUTO_MAX_ROWS, CPU_BATCH_SIZE, ModelShape, auto_batch_size, bytes_per_prompt,
    )
    from clozemath.eval.decoding.job import DecodeProgress, DecodeStats, Decoding, Job, OnProgress
    from clozemath.eval.decoding.run import SDPA_BACKENDS, decode
    from clozemath.eval.decoding.tokens import FinishReason, Generation

_HEAVY = {
    "decode": "run", "SDPA_BACKENDS": "run", "DecodeProgress": "job", "DecodeStats": "job", "Decoding": "job",
    "Job": "job", "OnProgress": "job", "Generation": "tokens", "FinishReason": "tokens", "ModelShape": "batching",
    "auto_batch_size": "batching", "bytes_per_prompt": "batching", "AUTO_MAX_ROWS": "batching",
    "CPU_BATCH_SIZE": "batching",
}
"""The names that need torch and transformers -> their module, imported at first use."""

__all__ = [
    "AUTO_MAX_ROWS", "CPU_BATCH_SIZE", "SDPA_BACKENDS", "AnswerSpan", "DecodeProgress", "DecodeSettings", "DecodeStats",
    "Decoding", "Engine", "FinishReason", "Generation", "Job", "ModelShape", "OnProgress", "PromptAttention",
    "auto_batch_size", "bytes_per_prompt", "decode", "decoding_names", "get_decoding", "register",
]


def __getattr__(name: str) -> Any:
    if name not in _HEAVY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HEAVY[name]}"), name)
