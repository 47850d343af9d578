"""Batch sizing: how many prompts a decoding batch takes (`batch_size="auto"`: as many as the device's free memory
holds), and the order batches are cut from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from clozemath.eval.decoding.static import cache_slots
from clozemath.model import memory
from clozemath.model.attention import head_dim


@dataclass(frozen=True)
class ModelShape:
    """What decoding memory depends on."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim(config), hidden=config.hidden_size,
            intermediate=config.intermediate_size, vocab=config.vocab_size, dtype_bytes=model.dtype.itemsize,
        )


AUTO_MAX_ROWS = 1024
"""`batch_size="auto"` fills memory up to this many rows (prompts x beams or branches): beyond, ended rows that ride
along in the static engine (a beam batch's done items; the run's last rows once no prompt waits) cost more than a
bigger batch saves (set before greedy and CoT rows were refilled)."""
AUTO_MEMORY_SHARE = 0.8
"""Of the free device memory, what `batch_size="auto"` plans to use (the rest: the allocator's fragmentation, the
graphs' own pools)."""
CPU_BATCH_SIZE = 16
"""`batch_size="auto"` off CUDA: at most this many prompts a batch ..."""
CPU_BATCH_POSITIONS = 2048
"""... and at most this many positions (rows x (the widest prompt + max_new_tokens)). No prompt of a batch ends before
its prompt pass, which takes a CPU seconds a thousand tokens: the CPU quickstart's 5-shot prompts (~1,000 tokens) go
one a batch, the first ending within seconds, not minutes, and no slower (their prompt pass is most of the work, and
a lone prompt pads none); its short fine-tuned prompts at 256 new tokens go 5 a batch."""


def bytes_per_prompt(shape: ModelShape, width: int, max_new_tokens: int, copies: int, shared: bool = False) -> int:
    """Device memory one prompt of `width` tokens needs while decoding `copies` rows (beams, branches), their cache
    `shared` or not (`Decoding.shares_prompt`).

    Per prompt: its static cache (`static.cache_slots`), the prompt pass's cache it is copied from, the prompt pass's
    activations (hidden states, the MLP's two intermediate projections) and its [width, width] 4D mask. Per row: four
    vocabulary-sized float32 rows (logits, softmax or log-softmax, beam scores).
    """
    per_position = 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes
    cache = per_position * (cache_slots(width, max_new_tokens, copies, shared) + width)
    prompt_pass = width * (4 * shape.hidden + 2 * shape.intermediate) * shape.dtype_bytes
    mask = width * width * shape.dtype_bytes
    return cache + prompt_pass + mask + copies * 4 * shape.vocab * 4


def auto_batch_size(
    shape: ModelShape, free_bytes: int, width: int, max_new_tokens: int, copies: int, prompts: int,
    shared: bool = False,
) -> int:
    """The most prompts per batch whose decoding fits `AUTO_MEMORY_SHARE` of `free_bytes` (at least 1, at most
    `prompts` and `AUTO_MAX_ROWS // copies`)."""
    fits = int(AUTO_MEMORY_SHARE * free_bytes) // bytes_per_prompt(shape, width, max_new_tokens, copies, shared)
    return max(1, min(fits, prompts, AUTO_MAX_ROWS // copies))


def batch_size(
    chosen: int | Literal["auto"], model: Any, prompts: list[list[int]], max_new_tokens: int, copies: int,
    shared: bool,
) -> int:
    """Prompts a batch: the size `chosen`; for "auto", `auto_batch_size` on CUDA, `cpu_batch_size` elsewhere."""
    if chosen != "auto":
        return chosen
    width = max(map(len, prompts))
    if model.device.type != "cuda":
        return cpu_batch_size(width, max_new_tokens, copies)
    free = memory.free_bytes(model.device)
    return auto_batch_size(ModelShape.of(model), free, width, max_new_tokens, copies, len(prompts), shared)


def cpu_batch_size(width: int, max_new_tokens: int, copies: int) -> int:
    """Prompts a batch off CUDA: `CPU_BATCH_POSITIONS` over a prompt's rows' positions (at least 1, at most
    `CPU_BATCH_SIZE`)."""
    return max(1, min(CPU_BATCH_SIZE, CPU_BATCH_POSITIONS // (copies * (width + max_new_tokens))))


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Prompt indices, longest first: batches cut from this order pad little."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])
