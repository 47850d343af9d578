"""What a decoding makes of a row's tokens: the token choices, the text (stop strings, character offsets), when a
row ends, and the `Generation` a prompt gets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tokenizers.decoders import DecodeStream

FinishReason = Literal["eos", "stop", "length"]


@dataclass
class Generation:
    """One decoded continuation of a prompt."""

    text: str
    """Special tokens skipped; cut before the first stop string."""
    token_ids: list[int]
    """The generated ids, end-of-sequence excluded; includes the tokens that spelt a stop string."""
    finish_reason: FinishReason
    score: float | None = None
    """Beam search: the hypothesis' summed log-probability / length ** length_penalty."""
    answer: str | None = None
    """CoT-decoding: the answer's text (the `answer_span` of `text`)."""
    confidence: float | None = None
    """CoT-decoding: a branch's mean answer-token margin; the chosen generation's: its answer's sum over branches."""
    branches: list[Generation] | None = None
    """CoT-decoding: every branch, in the order of their first token's probability (the first is greedy)."""


@dataclass(frozen=True)
class Stops:
    """What ends a row, and the ids it may choose from."""

    eos_ids: frozenset[int]
    strings: tuple[str, ...]
    max_new_tokens: int
    vocab: int
    """Ids the tokenizer has; the model's rows past them only align its matrices (`load.VOCAB_MULTIPLE`)."""


def without_padding(scores: torch.Tensor, stops: Stops) -> torch.Tensor:
    """`scores` with the ids past the tokenizer's vocabulary ruled out (in place), where transformers' generate rules
    them out too (`generation_config.suppress_tokens`): after beam search's log-softmax, before a greedy choice."""
    if scores.shape[-1] > stops.vocab:
        scores[..., stops.vocab :] = -math.inf
    return scores


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string in `text` begins."""
    found = [i for stop in stops if (i := text.find(stop)) >= 0]
    return min(found, default=None)


class TextStream:
    """A row's generated text, decoded token by token: the character offset after each token, the first stop string.

    Only the tail that could hold a new stop string is searched at each token.
    """

    def __init__(self, backend: Any, stops: tuple[str, ...]):
        self._backend = backend
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stops = stops
        self._keep = max(map(len, stops), default=1) - 1
        self._chunks: list[str] = []
        self._tail = ""
        self.length = 0
        self.ends: list[int] = []
        """Characters of text after each token (a token that only completes a character later adds none)."""
        self.cut: int | None = None
        """Where the first stop string begins."""

    def push(self, token_id: int) -> bool:
        """Add one token; True when the text now holds a stop string."""
        chunk = self._decoder.step(self._backend, token_id)
        if chunk:
            if self._stops:
                window = self._tail + chunk
                found = first_stop(window, self._stops)
                if found is not None:
                    self.cut = self.length - len(self._tail) + found
                self._tail = window[len(window) - self._keep :] if self._keep else ""
            self._chunks.append(chunk)
            self.length += len(chunk)
        self.ends.append(self.length)
        return self.cut is not None

    @property
    def text(self) -> str:
        return "".join(self._chunks)[: self.cut]


@dataclass
class Row:
    """A greedy (or CoT branch) row as it grows.

    Only a stop string needs the text while the row grows: without stop strings the text is decoded once the row has
    ended (the same text: the stream sees the same tokens), which keeps the host's look at the new tokens short.
    """

    stream: TextStream
    margins: list[float] | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def extend(self, token_ids: Sequence[int], margins: Sequence[float] | None, stops: Stops) -> None:
        """Add the row's next tokens (and their margins) until it ends: before an end-of-sequence id, after the token
        that completes a stop string or the `max_new_tokens`-th; the tokens after its end are ignored."""
        if self.finish_reason is not None:
            return
        kept = token_ids[: stops.max_new_tokens - len(self.token_ids)]
        if not stops.eos_ids.isdisjoint(kept):
            kept = kept[: next(j for j, token_id in enumerate(kept) if token_id in stops.eos_ids)]
            self.finish_reason = "eos"
        if stops.strings:
            for j, token_id in enumerate(kept):
                if self.stream.push(token_id):
                    kept, self.finish_reason = kept[: j + 1], "stop"
                    break
        self.token_ids.extend(kept)
        if self.margins is not None:
            assert margins is not None
            self.margins.extend(margins[: len(kept)])
        if self.finish_reason is None and len(self.token_ids) >= stops.max_new_tokens:
            self.finish_reason = "length"

    def generation(self) -> Generation:
        assert self.finish_reason is not None
        for token_id in self.token_ids[len(self.stream.ends) :]:
            self.stream.push(token_id)
        return Generation(self.stream.text, self.token_ids, self.finish_reason)


def greedy_choice(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The argmax over the tokenizer's ids (as `without_padding` then argmax picks, without writing the logits:
    argmax returns the first of equal maxima either way)."""
    return logits[:, :vocab].argmax(dim=-1)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Each row's p(top-1) - p(top-2): CoT-decoding's confidence in a token. The softmax reads the logits as they are
    and works in float32 (the same values as on a float32 copy, without writing one: a vocabulary-sized pass a row
    less at every step)."""
    top2 = logits.softmax(dim=-1, dtype=torch.float32).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]
