"""One `decode` call as a decoding sees it (`Job`: the prompts, what ends a row, the settings, the counters, where it
is), and what a decoding is (`Decoding`: what the registry, `clozemath.eval.decoding.registry`, holds by name)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from clozemath.eval.decoding.eager import KVBatch, prefill
from clozemath.eval.decoding.settings import DecodeSettings
from clozemath.eval.decoding.static import StaticBatch, static_batch
from clozemath.eval.decoding.tokens import Generation, Stops

RunEngine = Literal["eager", "static", "graphs"]
"""An engine a batch runs on (`settings.Engine` less "auto", which `decode` resolves)."""
Emit = Callable[[int, Generation], None]
"""Takes a prompt's generation (by the prompt's index) once it is done."""


@dataclass(frozen=True)
class DecodeProgress:
    """Where a batch's decoding is at one of the host's looks at its tokens: what shows that a batch whose prompts
    all run to `max_new_tokens` (minutes on a CPU) is alive before any of them is done."""

    running: int
    """Prompts of the batch still decoding."""
    tokens: int
    """Tokens the furthest of them has made (its first included): it ends by `max_new_tokens`."""
    max_new_tokens: int


OnProgress = Callable[[DecodeProgress], None]
"""Takes a `DecodeProgress` at each look of the host (every step of the eager engine, every `sync_every` of the static
ones): it reads what the host holds anyway, never the device."""


@dataclass
class DecodeStats:
    """What the static and graph engines' greedy and CoT decoding did (`decode(stats=...)` adds to it): how much of
    the batch's work went to live rows, and how often freed rows took a waiting prompt."""

    steps: int = 0
    """Decoding steps (each runs every row of the batch)."""
    row_steps: int = 0
    """Rows run over all steps: the generated tokens over this is the share of work that live rows got."""
    refills: int = 0
    """Prompts that took the rows of a prompt that had ended."""


@dataclass(frozen=True)
class Job:
    """The prompts of one `decode` call and what decoding them reads."""

    model: Any
    tokenizer: PreTrainedTokenizerBase
    prompts: list[list[int]]
    """Token ids, in the caller's order."""
    pad_id: int
    stops: Stops
    settings: DecodeSettings
    stats: DecodeStats
    copies: int
    """Rows a prompt takes (`Decoding.copies`)."""
    shared: bool
    """A prompt's rows share one cache entry on the static engines (`Decoding.shares_prompt`)."""
    width: int
    """The longest prompt's tokens: every static batch of the call sizes its cache for it, so that the compiled
    attention and the graphs keep one shape."""
    on_progress: OnProgress | None = None

    def looked(self, running: int, tokens: int) -> None:
        """At a look of the host: `running` prompts still decoding, the furthest `tokens` in (to `on_progress`)."""
        if self.on_progress is not None and running:
            self.on_progress(DecodeProgress(running, tokens, self.stops.max_new_tokens))

    @property
    def backend(self) -> Any:
        """The fast tokenizer's backend, which decodes rows token by token."""
        return self.tokenizer.backend_tokenizer

    def prefill(self, indices: Sequence[int]) -> tuple[KVBatch, torch.Tensor]:
        """The prompt pass of prompts `indices` (left-padded) and the first generated token's logits [prompts, vocab]."""
        return prefill(self.model, [self.prompts[i] for i in indices], self.pad_id, self.settings.prompt_attention)

    def batch(self, indices: Sequence[int], engine: RunEngine) -> tuple[KVBatch | StaticBatch, torch.Tensor]:
        """Prompts `indices` passed and ready to step on `engine`, each `copies` times, copies adjacent; the prompts'
        first logits [prompts, vocab]."""
        passed, logits = self.prefill(indices)
        if engine == "eager":
            if self.copies > 1:
                passed.repeat(self.copies)
            return passed, logits
        batch = self.static_batch(len(indices), passed, graphs=engine == "graphs", margins=False)
        sources = [prompt for prompt in range(len(indices)) for _ in range(self.copies)]
        batch.place(range(len(sources)), passed, sources, [len(self.prompts[indices[p]]) for p in sources])
        return batch, logits

    def static_batch(self, prompts: int, like: KVBatch, graphs: bool, margins: bool) -> StaticBatch:
        """A static batch for `prompts` prompts' rows (`copies` each), its cache shaped after prompt pass `like`'s."""
        return static_batch(
            self.model, prompts * self.copies, self.copies, self.shared, self.width, self.stops.max_new_tokens,
            like.cache, graphs, self.stops.vocab, margins,
        )


def batches(indices: Sequence[int], size: int) -> Iterator[list[int]]:
    """`indices` cut into batches of `size`, in order."""
    for start in range(0, len(indices), size):
        yield list(indices[start : start + size])


class Decoding:
    """A decoding scheme: how many rows a prompt takes and how a run of prompts is decoded on an engine.

    Adding one is a module with a subclass and one line in the registry's `DECODINGS` (or a `register` call). Greedy
    and CoT-decoding build on `rows.RowDecoding` (rows that continue greedily, refilled on the static engines); beam
    search on `Job.batch` (batches kept whole).
    """

    shares_prompt = False
    """On the static engines, a prompt's rows share one copy of its keys and values (`static.SharedPromptBatch`):
    right for rows that reorder (beams: a reorder then moves a bit a generated slot, not the cache; 2.05x beam-5 on
    the 1B shape, one H200, 2026-12-02), not for rows that never do (CoT's branches: each branch's queries would
    compute over every branch's area; 0.68x there)."""

    def check(self, settings: DecodeSettings) -> None:
        """Refuse settings this decoding cannot run with (a ClozeMathError), before any work."""

    def copies(self, settings: DecodeSettings, vocab: int) -> int:
        """Rows one prompt takes (batch sizing counts them); `vocab`: the tokenizer's ids."""
        return 1

    def decode(self, job: Job, indices: list[int], size: int, engine: RunEngine, emit: Emit) -> None:
        """Decode prompts `indices` (longest first), `size` prompts a batch, each generation to `emit` once done.

        An out-of-memory error may end it: `decode` halves an automatic size and goes on with the prompts not yet
        emitted.
        """
        raise NotImplementedError
