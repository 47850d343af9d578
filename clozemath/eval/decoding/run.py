"""`decode`: every prompt through a decoding (`registry`), in batches cut longest first, on an engine, an automatic
batch halved when the device runs out of memory."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedTokenizerBase

from clozemath.errors import ClozeMathError
from clozemath.eval.decoding.batching import batch_size, longest_first
from clozemath.eval.decoding.job import DecodeStats, Decoding, Emit, Job, OnProgress, RunEngine
from clozemath.eval.decoding.registry import get_decoding
from clozemath.eval.decoding.settings import ENGINES, DecodeSettings
from clozemath.eval.decoding.static import sliding_window
from clozemath.eval.decoding.tokens import Generation, Stops

_BIDIRECTIONAL_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the additive 4D PrefixLM mask."""
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Not cuDNN's attention: it builds a plan for every new shape, and decoding makes one each step (the keys grow, rows
leave the batch): a first pass over a set pays for a plan a step, transformers' `generate` included
(`bench/eval_throughput.py --reference-cudnn` measures it)."""
_DEFAULT_SETTINGS = DecodeSettings()


@torch.inference_mode()
def decode(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    decoding: str = "greedy",
    settings: DecodeSettings = _DEFAULT_SETTINGS,
    *,
    stats: DecodeStats | None = None,
    on_done: Emit | None = None,
    on_progress: OnProgress | None = None,
) -> list[Generation]:
    """Decode every prompt (text, or token ids as they are) with the decoding of that name (`registry`); one
    `Generation` per prompt, in order.

    `model` is a causal LM (transformers or peft, in eval mode); `settings` says how (`DecodeSettings`). `stats`, if
    given, counts the static engines' greedy and CoT steps and refills (`DecodeStats`). `on_done`, if given, takes
    each prompt's generation (by its index) as soon as the engine hands it over, once per prompt, in the order they
    end: at the host's looks the engine makes anyway (no extra device sync). `on_progress`, if given, takes where the
    batch is (`DecodeProgress`: prompts still decoding, the furthest one's tokens) at each of those looks.
    """
    scheme = get_decoding(decoding)
    _check(model, tokenizer, scheme, settings)
    eos_ids = _eos_ids(model, tokenizer, settings.eos_token_ids)
    stops = Stops(eos_ids, tuple(settings.stop), settings.max_new_tokens, vocab=len(tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops.eos_ids)
    if not prompts:
        return []
    encoded = _encode(tokenizer, prompts, settings.add_special_tokens)
    engine = settings.engine
    if engine == "auto":
        engine = "graphs" if model.device.type == "cuda" else "eager"
    job = Job(
        model, tokenizer, encoded, pad_id, stops, settings, stats if stats is not None else DecodeStats(),
        copies=scheme.copies(settings, len(tokenizer)), shared=scheme.shares_prompt, width=max(map(len, encoded)),
        on_progress=on_progress,
    )
    size = batch_size(settings.batch_size, model, encoded, settings.max_new_tokens, job.copies, job.shared)
    results: list[Generation | None] = [None] * len(encoded)
    with sdpa_kernel(SDPA_BACKENDS):
        for part_engine, part in _engine_parts(model, encoded, settings.max_new_tokens, engine):
            size = _decode_part(scheme, job, part, size, part_engine, results, on_done)
    return [generation for generation in results if generation is not None]


def _decode_part(
    scheme: Decoding, job: Job, part: list[int], size: int, engine: RunEngine, results: list[Generation | None],
    on_done: Emit | None = None,
) -> int:
    """Decode the prompts `part` (longest first) into `results` (each also to `on_done`); the batch size it ended
    with. An automatic size that runs out of memory is halved (the auto size is an estimate, and a share of a GPU,
    `train.gpu_share`, leaves it little slack) and the prompts not yet done go on; a size the user chose is theirs:
    the error stands."""
    def emit(index: int, generation: Generation) -> None:
        results[index] = generation
        if on_done is not None:
            on_done(index, generation)

    while pending := [index for index in part if results[index] is None]:
        in_batch = min(size, len(pending))
        try:
            scheme.decode(job, pending, size, engine, emit)
            continue
        except torch.OutOfMemoryError:
            if job.settings.batch_size != "auto" or in_batch == 1:
                raise
        # out of the except block: its traceback no longer holds the batch's tensors
        size = max(1, in_batch // 2)
        gc.collect()  # whatever the failed batch left in reference cycles, before the allocator lets memory go
        torch.cuda.empty_cache()
        warnings.warn(f"decode: out of memory with {in_batch} prompts a batch; going on with {size}")
    return size


def _check(model: Any, tokenizer: PreTrainedTokenizerBase, scheme: Decoding, settings: DecodeSettings) -> None:
    """Settings, model and tokenizer `decode` cannot work with: a one-line error before any work."""
    if settings.engine not in ENGINES:
        raise ClozeMathError(f"decode: unknown engine '{settings.engine}' (auto, eager, static or graphs)")
    batch = settings.batch_size
    if min(settings.max_new_tokens, settings.num_beams, settings.cot_k) < 1 or (batch != "auto" and batch < 1):
        raise ClozeMathError("decode: max_new_tokens, batch_size, num_beams and cot_k must be at least 1")
    scheme.check(settings)
    if settings.prompt_attention == "bidirectional":
        implementation = model.config._attn_implementation
        if implementation not in _BIDIRECTIONAL_ATTENTION:
            raise ClozeMathError(
                f"decode: bidirectional prompts need attn_implementation sdpa or eager, not '{implementation}'"
            )
    elif settings.prompt_attention != "causal":
        raise ClozeMathError(
            f"decode: unknown prompt_attention '{settings.prompt_attention}' (causal or bidirectional)"
        )
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ClozeMathError(f"decode: {type(tokenizer).__name__} is not a fast (tokenizers) tokenizer")


def _eos_ids(
    model: Any, tokenizer: PreTrainedTokenizerBase, eos_token_ids: int | Sequence[int] | None
) -> frozenset[int]:
    if eos_token_ids is not None:
        return frozenset([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else configured or [])
    ids.discard(None)
    if not ids:
        raise ClozeMathError("decode: neither the tokenizer nor the model names an end-of-sequence token")
    return frozenset(ids)


def _encode(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str] | Sequence[Sequence[int]], add_special_tokens: bool
) -> list[list[int]]:
    if all(isinstance(prompt, str) for prompt in prompts):
        encoded = tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]
    else:
        encoded = [list(prompt) for prompt in prompts]
    if any(not ids for ids in encoded):
        raise ClozeMathError(f"decode: prompt {next(i for i, ids in enumerate(encoded) if not ids)} is empty")
    return encoded


def _engine_parts(
    model: Any, encoded: list[list[int]], max_new_tokens: int, engine: RunEngine
) -> list[tuple[RunEngine, list[int]]]:
    """The prompts' indices, longest first, with the engine each decodes with: the static engines fall back to the
    eager one for prompts that would outgrow a sliding window with their generation (`static.sliding_window`)."""
    order = longest_first([len(ids) for ids in encoded])
    window = sliding_window(model)
    if engine == "eager" or window is None:
        return [(engine, order)]
    too_long = [index for index in order if len(encoded[index]) + max_new_tokens > window]
    if not too_long:
        return [(engine, order)]
    warnings.warn(f"decode: the static cache of the model's sliding-window layers holds {window} tokens; "
                  "prompts longer than that with max_new_tokens decode with the eager engine")
    return [("eager", too_long), (engine, order[len(too_long) :])]
