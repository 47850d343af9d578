"""Batched greedy decoding, beam search and CoT-decoding over the KV cache.

Prompts are decoded longest first. A batch of them (left-padded) is encoded in one forward pass, causally or, for
PrefixLM-trained models, with bidirectional attention over the whole prompt; that pass fills the KV cache, and
generation continues causally over it, one token per row per step. A row ends at an end-of-sequence token, at a stop
string, or after `max_new_tokens`.

CoT-decoding (Wang & Zhou 2024) branches on the top-k first tokens, continues every branch greedily in the same batch
(each branch's row starting from its prompt's cache), scores each branch by the mean margin p(top-1) - p(top-2) over
its answer tokens, and picks the answer with the largest summed score. Answer tokens are the tokens whose characters
overlap the answer's character span in the text, the offsets coming from decoding token by token.

Two engines step the rows. The eager one (CPU, and ZeRO-3 during training) grows transformers' DynamicCache and drops
finished rows; a batch ends when its last row does. The static one (CUDA) keeps a preallocated cache of
`prompt + max_new_tokens` positions a row, each row's prompt at its first slots, and replays the per-token step (its
attention grouped by key-value head, the greedy choice and the margins included) as one CUDA graph; the host reads
the new tokens only every `_GPU_SYNC_EVERY` steps (end-of-sequence, stop strings and the margins are checked then).
Greedy and CoT rows batch continuously: when a prompt's rows have all ended, the next waiting prompt's pass is moved
into them, so that the step keeps one shape for the whole run and its rows work for live prompts; ended rows ride
along only until that look. Beam search keeps its batches (a batch ends when its last item does) and its bookkeeping
on the GPU.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tokenizers.decoders import DecodeStream
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, Cache, PreTrainedTokenizerBase
from transformers.cache_utils import StaticLayer

from clozemath.errors import ClozeMathError
from clozemath.model.attention import additive_mask, head_dim
from clozemath.model import memory

Scheme = Literal["greedy", "beam", "cot"]
PromptAttention = Literal["causal", "bidirectional"]
Engine = Literal["auto", "eager", "static", "graphs"]
FinishReason = Literal["eos", "stop", "length"]
AnswerSpan = Callable[[str], "tuple[int, int] | None"]

_COMPACT_SHARE = 0.25
"""Eager engine, greedy rows: drop finished rows once they are this share of the batch (a copy of the cache, against
wasted work)."""
_NEG = -1.0e9
"""Beam search: the score that takes a beam out of the running (transformers' constant, for identical tie-breaks)."""
_BIDIRECTIONAL_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the additive 4D PrefixLM mask."""
_GPU_SYNC_EVERY = 16
"""Static engine: steps between the host's looks at the new tokens (each look waits for the GPU; refills happen
there)."""
_CACHE_ALIGN = 16
"""Static cache positions are a multiple of this (aligned rows for the attention's matmuls)."""
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Not cuDNN's attention: it builds a plan for every new shape, and decoding makes one each step (the keys grow, rows
leave the batch). On an H200 that made a first pass over GSM8K 3.5x slower, transformers' `generate` included."""


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
class _Stops:
    eos_ids: frozenset[int]
    strings: tuple[str, ...]
    max_new_tokens: int
    vocab: int
    """Ids the tokenizer has; the model's rows past them only align its matrices (`load.VOCAB_MULTIPLE`)."""


def _without_padding(scores: torch.Tensor, stops: _Stops) -> torch.Tensor:
    """`scores` with the ids past the tokenizer's vocabulary ruled out (in place), where transformers' generate rules
    them out too (`generation_config.suppress_tokens`): after beam search's log-softmax, before a greedy choice."""
    if scores.shape[-1] > stops.vocab:
        scores[..., stops.vocab :] = -math.inf
    return scores


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string in `text` begins."""
    found = [i for stop in stops if (i := text.find(stop)) >= 0]
    return min(found, default=None)


class _TextStream:
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
                found = _first_stop(window, self._stops)
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
class _Row:
    """A greedy (or CoT branch) row as it grows.

    Only a stop string needs the text while the row grows: without stop strings the text is decoded once the row has
    ended (the same text: the stream sees the same tokens), which keeps the host's look at the new tokens short.
    """

    stream: _TextStream
    margins: list[float] | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def extend(self, token_ids: Sequence[int], margins: Sequence[float] | None, stops: _Stops) -> None:
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


class _KVBatch:
    """Rows decoding over one KV cache: the cache, the padding mask and each row's next position."""

    drops_rows = True
    """`take` may drop rows (finished ones)."""
    sync_every = 1
    """Steps between the host's looks at the new tokens."""

    def __init__(self, model: Any, cache: Any, attention_mask: torch.Tensor, positions: torch.Tensor):
        self.model = model
        self.cache = cache
        self.attention_mask = attention_mask
        self.positions = positions

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; the next-token logits [rows, vocab]. Each token attends all of its row's past."""
        ones = self.attention_mask.new_ones((tokens.shape[0], 1))
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.positions = self.positions + 1
        return out.logits[:, -1]

    def take(self, index: torch.Tensor) -> None:
        """Keep these rows, in this order (drops finished rows, reorders beams)."""
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.positions = self.positions[index]

    def repeat(self, times: int) -> None:
        """Each row `times` times, copies adjacent."""
        self.cache.batch_repeat_interleave(times)
        self.attention_mask = self.attention_mask.repeat_interleave(times, dim=0)
        self.positions = self.positions.repeat_interleave(times, dim=0)


def _slots(width: int, max_new_tokens: int) -> int:
    """Static cache positions for prompts of up to `width` tokens."""
    return -(-(width + max_new_tokens) // _CACHE_ALIGN) * _CACHE_ALIGN


def _sliding_window(model: Any) -> int | None:
    """The window of a model with sliding-window layers (Gemma 3), None for one without. The static engine gives every
    layer every slot under one mask: right only while a row's prompt and generation fit the window."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return getattr(config, "sliding_window", None)


def _grouped_decode_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor, scaling: float, **_: Any,
) -> tuple[torch.Tensor, None]:
    """One query a row over the whole static cache, the query heads grouped on their key-value head.

    sdpa has no grouped-query kernel that takes a mask: transformers repeats the keys and values for every query head
    (a copy of the cache per layer and step, which dominated the step) and sdpa falls back to its math kernel.
    """
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling + attention_mask  # [rows, kv_heads, group, slots]
    out = torch.matmul(scores.float().softmax(dim=-1).to(value.dtype), value)
    return out.view(rows, 1, heads, dim), None


_DECODE_ATTENTION = "clozemath_grouped_decode"
AttentionInterface.register(_DECODE_ATTENTION, _grouped_decode_attention)


class _SlotLayer(StaticLayer):
    """A static cache layer whose rows each write at their own position: a row's prompt sits at slots 0..len-1, so the
    position a step feeds is also the slot it writes (transformers' StaticLayer writes every row at one shared slot)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True
        rows = keys.shape[0]
        self._key_slots = positions.view(rows, 1, 1, 1).expand(rows, keys.shape[1], 1, keys.shape[3])
        self._value_slots = positions.view(rows, 1, 1, 1).expand(rows, values.shape[1], 1, values.shape[3])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.keys.scatter_(2, self._key_slots, key_states)
        self.values.scatter_(2, self._value_slots, value_states)
        return self.keys, self.values


def _on_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints as a device tensor, copied without waiting for the device's queue (pinned, non-blocking)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _greedy_choice(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The argmax over the tokenizer's ids (as `_without_padding` then argmax picks, without writing the logits:
    argmax returns the first of equal maxima either way)."""
    return logits[:, :vocab].argmax(dim=-1)


class _StaticBatch:
    """Rows decoding over a preallocated cache of `slots` positions a row, in place and in fixed shapes, so that the
    step can be replayed as a CUDA graph (`graphs=True`; else it runs eagerly, the same kernels).

    A row holds its prompt at slots 0..len-1 and its generated tokens after. The step's inputs live in fixed tensors:
    each row's token, its position (the slot the step writes) and its additive attention mask over every slot (its
    prompt's slots open, each further slot opening as the step writes it; everything else, a former occupant's
    included, masked). `place` fills rows from a prompt pass, at the start or into rows freed later; a row that has
    ended rides along until then (its position stops at the last slot). Greedy and CoT rows choose their next token
    within the step (`advance`) and keep every step's tokens and margins on the device until the host `read`s them;
    beam search takes the step's logits (`step`) and reorders its rows (`take`).
    """

    drops_rows = False

    def __init__(self, model: Any, rows: int, slots: int, like: Any, graphs: bool, vocab: int, margins: bool):
        """`like`: a prompt pass's cache, for each layer's heads, head size and dtype."""
        device = like.layers[0].keys.device
        self.model, self.slots, self.sync_every, self._vocab, self._graphs = model, slots, _GPU_SYNC_EVERY, vocab, graphs
        self._positions = torch.zeros(rows, dtype=torch.long, device=device)
        self._slot_index = self._positions.view(rows, 1, 1, 1)
        self.cache = Cache(layers=[
            _SlotLayer(
                layer.keys.new_zeros((rows, layer.keys.shape[1], slots, layer.keys.shape[3])),
                layer.values.new_zeros((rows, layer.values.shape[1], slots, layer.values.shape[3])),
                self._positions,
            )
            for layer in like.layers
        ])  # zeros, not empty: a masked slot adds 0 x value, and 0 x NaN would poison the row
        self._closed = torch.finfo(model.dtype).min
        self._mask = torch.full((rows, 1, 1, slots), self._closed, dtype=model.dtype, device=device)
        self._tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self._history = torch.zeros((rows, self.sync_every + 1), dtype=torch.long, device=device)
        """Column 0: the first token of rows placed since the host's last look; column j: step j's tokens."""
        self._margin_history = torch.zeros((rows, self.sync_every + 1), device=device) if margins else None
        self._column = torch.ones(1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: Callable[[], torch.Tensor] | None = None
        self._output: torch.Tensor | None = None
        self._generated = (slots, 0)
        """Beam search: the slots that generated tokens may occupy, [first, end)."""

    def place(
        self, rows: Sequence[int], prefill: _KVBatch, sources: Sequence[int], lengths: Sequence[int],
        tokens: torch.Tensor | None = None, margins: torch.Tensor | None = None,
    ) -> None:
        """Rows `rows` take the prompts of rows `sources` of a prompt pass (left-padded; `lengths`: their tokens): its
        keys and values moved to slots 0..len-1, a mask that opens those only, the next position; for greedy and CoT
        rows their first token (and margin)."""
        device = self._tokens.device
        index, source_index, length = (_on_device(values, device) for values in (rows, sources, lengths))
        width = prefill.attention_mask.shape[1]
        offsets = torch.arange(width, device=device)
        moved = (width - length[:, None] + offsets).clamp_(max=width - 1)  # slot t <- position width - len + t
        for source, target in zip(prefill.cache.layers, self.cache.layers):
            for states, into in ((source.keys, target.keys), (source.values, target.values)):
                picked = states.index_select(0, source_index)
                picked = picked.gather(2, moved[:, None, :, None].expand(-1, picked.shape[1], -1, picked.shape[3]))
                into[:, :, :width].index_copy_(0, index, picked)
        opened = torch.arange(self.slots, device=device) < length[:, None]
        mask = torch.full(opened.shape, self._closed, dtype=self._mask.dtype, device=device).masked_fill_(opened, 0.0)
        self._mask.index_copy_(0, index, mask[:, None, None, :])
        self._positions.index_copy_(0, index, length)
        if tokens is not None:
            self._tokens.index_copy_(0, index, tokens)
            self._history[:, 0].index_copy_(0, index, tokens)
        if margins is not None and self._margin_history is not None:
            self._margin_history[:, 0].index_copy_(0, index, margins)
        self._generated = (min(self._generated[0], *lengths), max(self._generated[1], *lengths))

    def _forward(self) -> torch.Tensor:
        """One step: every row feeds its token at its position (and slot); the next-token logits [rows, vocab]."""
        self._mask.scatter_(3, self._slot_index, 0.0)
        config = self.model.config
        implementation = config._attn_implementation
        config._attn_implementation = _DECODE_ATTENTION
        try:
            out = self.model(
                input_ids=self._tokens[:, None], attention_mask=self._mask, position_ids=self._positions[:, None],
                past_key_values=self.cache, use_cache=True,
            )
        finally:
            config._attn_implementation = implementation
        self._positions.add_(1).clamp_(max=self.slots - 1)  # only an ended row gets there: live ones stop 1 before
        return out.logits[:, -1]

    def _choose(self) -> torch.Tensor:
        """One step, then each row's greedy choice (and margin) as its next token, kept in the history's next column."""
        logits = self._forward()
        if self._margin_history is not None:
            self._margin_history.index_copy_(1, self._column, _top2_margin(logits)[:, None])
        self._tokens.copy_(_greedy_choice(logits, self._vocab))
        self._history.index_copy_(1, self._column, self._tokens[:, None])
        self._column.add_(1)
        return logits

    def _replayed(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()`; with graphs, captured at its first call (run eagerly on a side stream first, as capture needs) and
        replayed after: its output is then valid until the next step."""
        self._generated = (self._generated[0], min(self._generated[1] + 1, self.slots))
        if not self._graphs:
            return run()
        if self._graph is not None:
            assert self._captured == run and self._output is not None
            self._graph.replay()
            return self._output
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            output = run()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph, self._captured = torch.cuda.CUDAGraph(), run
        with torch.cuda.graph(self._graph, stream=stream):
            self._output = run()
        return output

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; the next-token logits [rows, vocab] (with graphs: valid until the next step)."""
        self._tokens.copy_(tokens)
        return self._replayed(self._forward)

    def advance(self, steps: int) -> None:
        """`steps` (at most `sync_every`) greedy steps, their tokens and margins kept on the device."""
        self._column.fill_(1)
        for _ in range(steps):
            self._replayed(self._choose)

    def read(self, steps: int) -> tuple[list[list[int]], list[list[float]] | None]:
        """For each row: its first token (if placed since the last look), then the tokens of the last `steps` steps;
        the same for the margins."""
        tokens = self._history[:, : steps + 1].tolist()
        margins = self._margin_history[:, : steps + 1].tolist() if self._margin_history is not None else None
        return tokens, margins

    def take(self, index: torch.Tensor) -> None:
        """Reorder rows within their prompt's group (beams): only the generated slots differ between them."""
        first, end = self._generated
        for layer in self.cache.layers:
            for states in (layer.keys, layer.values):
                generated = states[:, :, first:end]
                generated.copy_(generated.index_select(0, index))


_Batch = _KVBatch | _StaticBatch


def _prefill(
    model: Any, prompts: list[list[int]], pad_id: int, attention: PromptAttention
) -> tuple[_KVBatch, torch.Tensor]:
    """Encode left-padded prompts in one pass; the cache and the first generated token's logits [rows, vocab]."""
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    positions = (attention_mask.cumsum(dim=1) - 1).clamp_(min=0)
    if attention == "bidirectional":
        mask = additive_mask(attention_mask, attention_mask.bool(), model.dtype)
    else:
        mask = attention_mask
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    return _KVBatch(model, out.past_key_values, attention_mask, positions[:, -1] + 1), out.logits[:, -1]


def _top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.float().softmax(dim=-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def _answer_confidence(row: _Row, span: tuple[int, int]) -> float | None:
    """Mean margin over the tokens whose characters overlap `span`."""
    start, end = span
    assert row.margins is not None
    margins = [
        margin
        for margin, token_start, token_end in zip(row.margins, [0, *row.stream.ends], row.stream.ends)
        if token_start < end and token_end > start
    ]
    return sum(margins) / len(margins) if margins else None


def _branch(row: _Row, answer_span: AnswerSpan) -> Generation:
    branch = row.generation()
    span = answer_span(branch.text)
    if span is not None:
        branch.answer = branch.text[span[0] : span[1]]
        branch.confidence = _answer_confidence(row, span)
    return branch


def _aggregate(branches: list[Generation], normalize: Callable[[str], str]) -> Generation:
    """The answer with the largest summed confidence; its most confident branch. Ties: the earlier branch."""
    totals: dict[str, float] = {}
    for branch in branches:
        if branch.answer is not None and branch.confidence is not None:
            key = normalize(branch.answer)
            totals[key] = totals.get(key, 0.0) + branch.confidence
    if not totals:
        greedy = branches[0]
        return Generation(greedy.text, greedy.token_ids, greedy.finish_reason, branches=branches)
    winner = max(totals, key=totals.__getitem__)
    chosen = max(
        (b for b in branches if b.answer is not None and b.confidence is not None and normalize(b.answer) == winner),
        key=lambda b: b.confidence,
    )
    return Generation(
        chosen.text, chosen.token_ids, chosen.finish_reason, answer=chosen.answer, confidence=totals[winner],
        branches=branches,
    )


@dataclass(frozen=True)
class _Branching:
    """How a prompt's rows begin (from its prompt pass's logits) and what they make: one greedy row, or CoT-decoding's
    `copies` branches, adjacent, in the order of their first token's probability (the first is greedy)."""

    copies: int = 1
    answer_span: AnswerSpan | None = None
    """CoT-decoding's; None: greedy."""
    normalize: Callable[[str], str] = str.strip

    def first(self, logits: torch.Tensor, stops: _Stops) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's first token, prompt-major [prompts * copies], and for CoT its margin."""
        if self.answer_span is None:
            return _greedy_choice(logits, stops.vocab), None
        margins = _top2_margin(logits).repeat_interleave(self.copies)
        return _without_padding(logits, stops).topk(self.copies, dim=-1).indices.flatten(), margins

    def rows(self, prompts: int, backend: Any, stops: _Stops) -> list[_Row]:
        margins = self.answer_span is not None
        return [_Row(_TextStream(backend, stops.strings), [] if margins else None) for _ in range(prompts * self.copies)]

    def generation(self, rows: Sequence[_Row]) -> Generation:
        """A prompt's generation from its rows."""
        if self.answer_span is None:
            return rows[0].generation()
        return _aggregate([_branch(row, self.answer_span) for row in rows], self.normalize)


def _decode_eagerly(
    batch: _KVBatch, logits: torch.Tensor, branching: _Branching, backend: Any, stops: _Stops
) -> list[Generation]:
    """The eager engine: `batch` holds each prompt's rows `branching.copies` times, copies adjacent; `logits` are the
    prompts' [prompts, vocab]. The host reads each step's tokens; finished rows leave the batch once they are
    `_COMPACT_SHARE` of it."""
    prompts = logits.shape[0]
    tokens, margins = branching.first(logits, stops)
    rows = branching.rows(prompts, backend, stops)
    slots = list(range(len(rows)))  # batch row -> row
    while True:
        token_list = tokens.tolist()
        margin_list = margins.tolist() if margins is not None else None
        for slot, row_index in enumerate(slots):
            rows[row_index].extend(token_list[slot : slot + 1], margin_list and margin_list[slot : slot + 1], stops)
        live = [slot for slot, row_index in enumerate(slots) if rows[row_index].finish_reason is None]
        if not live:
            break
        if len(slots) - len(live) >= _COMPACT_SHARE * len(slots):
            index = torch.tensor(live, device=tokens.device)
            batch.take(index)
            tokens = tokens[index]
            slots = [slots[slot] for slot in live]
        logits = batch.step(tokens)
        margins = _top2_margin(logits) if margins is not None else None
        tokens = _greedy_choice(logits, stops.vocab)
    copies = branching.copies
    return [branching.generation(rows[p * copies : (p + 1) * copies]) for p in range(prompts)]


def _decode_continuously(
    model: Any, prompts: list[list[int]], order: Sequence[int], size: int, pad_id: int,
    attention: PromptAttention, stops: _Stops, backend: Any, branching: _Branching, graphs: bool,
    emit: Callable[[int, Generation], None], stats: DecodeStats,
) -> None:
    """The static engine's greedy and CoT decoding, with continuous batching: the prompts `order` (longest first)
    through one `_StaticBatch` of `size` prompts' rows (`branching.copies` a prompt), its step one shape for the whole
    run (one CUDA graph).

    Every `sync_every` steps (fewer where every prompt's rows reach `max_new_tokens` sooner) the host reads the new
    tokens: each prompt whose rows have all ended goes to `emit`, and the next waiting prompts take its rows, their
    prompt pass batched and moved into those rows (`_StaticBatch.place`). A prompt's rows compute what they would in
    any other batch: rows never see each other, and a refilled row's mask hides its former occupant (only the
    rounding may differ, as between any two batch shapes). The text of ended prompts is decoded while the device runs
    the next steps.
    """
    copies = branching.copies
    units = min(size, len(order))  # a unit: one prompt's rows
    waiting = deque(order)
    slots = _slots(max(len(prompts[i]) for i in order), stops.max_new_tokens)
    batch: _StaticBatch | None = None
    occupant: list[int | None] = [None] * units
    rows = branching.rows(units, backend, stops)  # placeholders until placed
    produced = [0] * units  # tokens the device has made for a unit's prompt (its first included)
    fresh: set[int] = set()  # units placed since the host's last look: the history's column 0 is theirs

    def fill(free: list[int]) -> None:
        nonlocal batch
        taken = [waiting.popleft() for _ in free[: len(waiting)]]
        if not taken:
            return
        targets = [unit * copies + copy for unit in free[: len(taken)] for copy in range(copies)]
        sources = [prompt for prompt in range(len(taken)) for _ in range(copies)]
        lengths = [len(prompts[taken[prompt]]) for prompt in sources]
        prefill, logits = _prefill(model, [prompts[i] for i in taken], pad_id, attention)
        tokens, margins = branching.first(logits, stops)
        if batch is None:
            batch = _StaticBatch(model, units * copies, slots, prefill.cache, graphs, stops.vocab, margins is not None)
        else:
            stats.refills += len(taken)
        batch.place(targets, prefill, sources, lengths, tokens, margins)
        for target, row in zip(targets, branching.rows(len(taken), backend, stops)):
            rows[target] = row
        for unit, prompt in zip(free, taken):
            occupant[unit], produced[unit] = prompt, 1
            fresh.add(unit)

    fill(list(range(units)))
    assert batch is not None
    ended: list[tuple[int, list[_Row]]] = []
    try:
        while live := [unit for unit in range(units) if occupant[unit] is not None]:
            steps = min(batch.sync_every, max(stops.max_new_tokens - produced[unit] for unit in live))
            assert steps or fresh, "a row that made max_new_tokens has ended"
            batch.advance(steps)
            stats.steps += steps
            stats.row_steps += steps * units * copies
            for prompt, unit_rows in ended:  # the host's text work while the device runs the steps
                emit(prompt, branching.generation(unit_rows))
            ended = []
            tokens, margins = batch.read(steps)
            free = []
            for unit in live:
                first = 0 if unit in fresh else 1
                unit_rows = rows[unit * copies : (unit + 1) * copies]
                for row_index, row in enumerate(unit_rows, start=unit * copies):
                    row.extend(tokens[row_index][first:], margins and margins[row_index][first:], stops)
                produced[unit] += steps
                if all(row.finish_reason is not None for row in unit_rows):
                    prompt = occupant[unit]
                    assert prompt is not None
                    ended.append((prompt, unit_rows))
                    occupant[unit] = None
                    free.append(unit)
            fresh.clear()
            fill(free)
    finally:  # out of memory at a refill: the prompts that have ended are done
        for prompt, unit_rows in ended:
            emit(prompt, branching.generation(unit_rows))


def _stop_hits(tokenizer: PreTrainedTokenizerBase, tails: torch.Tensor, stops: tuple[str, ...]) -> torch.Tensor:
    """[items, candidates]: does the decoded tail [items, candidates, window] hold a stop string."""
    items, candidates, window = tails.shape
    texts = tokenizer.batch_decode(tails.reshape(-1, window).tolist(), skip_special_tokens=True)
    hits = [_first_stop(text, stops) is not None for text in texts]
    return torch.tensor(hits, device=tails.device).view(items, candidates)


def _beam_generation(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], score: float, stops: _Stops
) -> Generation:
    if token_ids and token_ids[-1] in stops.eos_ids:
        kept = token_ids[:-1]
        return Generation(tokenizer.decode(kept, skip_special_tokens=True), kept, "eos", score=score)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cut = _first_stop(text, stops.strings)
    return Generation(text[:cut], token_ids, "length" if cut is None else "stop", score=score)


def _beam(
    batch: _Batch, logits: torch.Tensor, tokenizer: PreTrainedTokenizerBase, stops: _Stops, num_beams: int,
    length_penalty: float, early_stopping: bool | Literal["never"],
) -> list[Generation]:
    """Beam search as transformers' `generate(num_beams=...)` does it; `batch` holds each item's rows `num_beams`
    times, copies adjacent; `logits` are the items' [items, vocab].

    Per step, the best `2 * num_beams` continuations of all beams: those ending (EOS, a stop string, the length
    limit) among the first `num_beams` become finished hypotheses, scored sum log p / length ** length_penalty; the
    best `num_beams` of the others run on. An item is done when `num_beams` hypotheses are finished and, unless
    `early_stopping` is True, its best running beam can no longer beat the worst of them. A done item's hypotheses
    stay as they are; the host looks for done items every `batch.sync_every` steps (every step with stop strings,
    which it checks on the decoded text) and an eager batch drops them.
    """
    items, device, beams, max_new = logits.shape[0], logits.device, num_beams, stops.max_new_tokens
    eos = torch.tensor(sorted(stops.eos_ids), device=device)
    kept = max(2, 1 + len(stops.eos_ids)) * beams
    in_top = torch.arange(kept, device=device) < beams
    window = max(map(len, stops.strings), default=0) + 2  # tokens: each spells at least one character
    sync_every = 1 if stops.strings else batch.sync_every
    log_probs = _without_padding(logits.float().log_softmax(dim=-1), stops).repeat_interleave(beams, dim=0)
    running = torch.zeros((items, beams, max_new), dtype=torch.long, device=device)
    running_scores = torch.full((items, beams), _NEG, device=device)
    running_scores[:, 0] = 0.0
    finished = torch.zeros_like(running)
    finished_scores = torch.full((items, beams), -math.inf, device=device)
    finished_lengths = torch.zeros((items, beams), dtype=torch.long, device=device)
    done = torch.zeros(items, dtype=torch.bool, device=device)
    live_items = list(range(items))  # batch item -> prompt
    results: list[Generation | None] = [None] * items
    for t in range(max_new):
        if t > 0:
            log_probs = batch.step(running[:, :, t - 1].flatten()).float().log_softmax(dim=-1)
            log_probs = _without_padding(log_probs, stops)
        vocab = log_probs.shape[-1]
        scores = (log_probs.view(len(live_items), beams, vocab) + running_scores[:, :, None]).flatten(1)
        candidate_scores, flat = scores.topk(kept, dim=1)
        origins, new_tokens = flat // vocab, flat % vocab
        candidates = running.gather(1, origins[:, :, None].expand(-1, -1, max_new))
        candidates[:, :, t] = new_tokens
        hits = torch.isin(new_tokens, eos)
        if stops.strings:
            hits |= _stop_hits(tokenizer, candidates[:, :, max(0, t + 1 - window) : t + 1], stops.strings)
        if t + 1 == max_new:
            hits[:] = True

        ending = hits & in_top
        ending_scores = torch.where(ending, candidate_scores / (t + 1) ** length_penalty, -math.inf)
        merged_scores, best = torch.cat([finished_scores, ending_scores], dim=1).topk(beams, dim=1)
        merged = torch.cat([finished, candidates], dim=1).gather(1, best[:, :, None].expand(-1, -1, max_new))
        lengths = torch.cat([finished_lengths, torch.full_like(ending_scores, t + 1, dtype=torch.long)], 1)
        finished = torch.where(done[:, None, None], finished, merged)
        finished_lengths = torch.where(done[:, None], finished_lengths, lengths.gather(1, best))
        finished_scores = torch.where(done[:, None], finished_scores, merged_scores)

        running_scores, chosen = (candidate_scores + hits * _NEG).topk(beams, dim=1)
        running = candidates.gather(1, chosen[:, :, None].expand(-1, -1, max_new))
        parents = origins.gather(1, chosen)

        full = torch.isfinite(finished_scores).all(dim=1)
        if early_stopping is True:
            now_done = full
        else:
            best_length = max_new if early_stopping == "never" and length_penalty > 0 else t + 1
            best_possible = running_scores[:, 0] / best_length**length_penalty
            now_done = full & (best_possible <= finished_scores.min(dim=1).values)
        done = done | now_done
        if t + 1 == max_new:
            done[:] = True
        rows = (torch.arange(len(live_items), device=device)[:, None] * beams + parents).flatten()
        if (t + 1) % sync_every and t + 1 < max_new:
            batch.take(rows)
            continue
        done_list = done.tolist()
        for position in (position for position, is_done in enumerate(done_list) if is_done):
            if results[live_items[position]] is None:
                length = int(finished_lengths[position, 0])
                token_ids = finished[position, 0, :length].tolist()
                results[live_items[position]] = _beam_generation(
                    tokenizer, token_ids, float(finished_scores[position, 0]), stops
                )
        if all(done_list):
            break
        if not batch.drops_rows:
            batch.take(rows)
            continue
        keep = [position for position, is_done in enumerate(done_list) if not is_done]
        keep_index = torch.tensor(keep, device=device)
        batch.take(rows.view(-1, beams)[keep_index].flatten())  # reorders the beams and drops done items in one copy
        live_items = [live_items[position] for position in keep]
        running, running_scores, done = running[keep_index], running_scores[keep_index], done[keep_index]
        finished, finished_scores, finished_lengths = (
            finished[keep_index], finished_scores[keep_index], finished_lengths[keep_index]
        )
    return [result for result in results if result is not None]


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
"""`batch_size="auto"` off CUDA."""


def bytes_per_prompt(shape: ModelShape, width: int, max_new_tokens: int, copies: int) -> int:
    """Device memory one prompt of `width` tokens needs while decoding `copies` rows (beams, branches).

    Per row: the static cache (`width + max_new_tokens` positions, rounded up), the prompt pass's cache it is copied
    from, and four vocabulary-sized float32 rows (logits, softmax or log-softmax, beam scores). Per prompt: the prompt
    pass's activations (hidden states, the MLP's two intermediate projections) and its [width, width] 4D mask.
    """
    slots = _slots(width, max_new_tokens)
    per_position = 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes
    row = per_position * (slots + width) + 4 * shape.vocab * 4
    prompt_pass = width * (4 * shape.hidden + 2 * shape.intermediate) * shape.dtype_bytes
    mask = width * width * shape.dtype_bytes
    return copies * row + prompt_pass + mask


def auto_batch_size(
    shape: ModelShape, free_bytes: int, width: int, max_new_tokens: int, copies: int, prompts: int
) -> int:
    """The most prompts per batch whose decoding fits `AUTO_MEMORY_SHARE` of `free_bytes` (at least 1, at most
    `prompts` and `AUTO_MAX_ROWS // copies`)."""
    fits = int(AUTO_MEMORY_SHARE * free_bytes) // bytes_per_prompt(shape, width, max_new_tokens, copies)
    return max(1, min(fits, prompts, AUTO_MAX_ROWS // copies))


def _batch_size(
    batch_size: int | Literal["auto"], model: Any, encoded: list[list[int]], max_new_tokens: int, copies: int
) -> int:
    if batch_size != "auto":
        return batch_size
    if model.device.type != "cuda":
        return CPU_BATCH_SIZE
    width = max(map(len, encoded))
    return auto_batch_size(ModelShape.of(model), memory.free_bytes(model.device), width, max_new_tokens, copies, len(encoded))


def _longest_first(lengths: Sequence[int]) -> list[int]:
    """Prompt indices, longest first: batches cut from this order pad little."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


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
    model: Any, encoded: list[list[int]], max_new_tokens: int, engine: Engine
) -> list[tuple[Engine, list[int]]]:
    """The prompts' indices, longest first, with the engine each decodes with: the static engines fall back to the
    eager one for prompts whose static cache would outgrow a sliding window (`_sliding_window`)."""
    order = _longest_first([len(ids) for ids in encoded])
    window = _sliding_window(model)
    if engine == "eager" or window is None:
        return [(engine, order)]
    too_long = [index for index in order if _slots(len(encoded[index]), max_new_tokens) > window]
    if not too_long:
        return [(engine, order)]
    warnings.warn(f"decode: the static cache of the model's sliding-window layers holds {window} tokens; "
                  "prompts longer than that with max_new_tokens decode with the eager engine")
    return [("eager", too_long), (engine, order[len(too_long) :])]


@torch.inference_mode()
def decode(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    scheme: Scheme = "greedy",
    *,
    max_new_tokens: int = 512,
    stop: Sequence[str] = (),
    eos_token_ids: int | Sequence[int] | None = None,
    prompt_attention: PromptAttention = "causal",
    batch_size: int | Literal["auto"] = "auto",
    num_beams: int = 5,
    length_penalty: float = 1.0,
    early_stopping: bool | Literal["never"] = False,
    cot_k: int = 9,
    answer_span: AnswerSpan | None = None,
    normalize_answer: Callable[[str], str] = str.strip,
    add_special_tokens: bool = True,
    engine: Engine = "auto",
    stats: DecodeStats | None = None,
) -> list[Generation]:
    """Decode every prompt (text, or token ids as they are) with `scheme`; one `Generation` per prompt, in order.

    `model` is a causal LM (transformers or peft, in eval mode); `batch_size` counts prompts (a batch holds
    `batch_size * num_beams` rows for beam search, `batch_size * cot_k` for CoT-decoding); "auto": as many as fit
    the GPU's free memory (`auto_batch_size`), `CPU_BATCH_SIZE` elsewhere; with the static engines, greedy and CoT
    batches refill a prompt's rows once they have all ended (continuous batching: the tokens are the same). `engine`
    "auto": CUDA graphs over a static cache on CUDA, the eager DynamicCache loop elsewhere; "static": the graph
    engine's steps run eagerly (its kernels without the graphs, for comparisons). `stats`, if given, counts the
    static engines' greedy and CoT steps and refills (`DecodeStats`). End-of-sequence ids default to the tokenizer's
    and the model's generation config's. `prompt_attention="bidirectional"` encodes each
    whole prompt with bidirectional attention (PrefixLM). Beam search follows `model.generate(num_beams=...,
    length_penalty=..., early_stopping=...)`. CoT-decoding needs `answer_span(text) -> (start, end) | None`; answers
    are compared after `normalize_answer`.
    """
    if scheme not in ("greedy", "beam", "cot"):
        raise ClozeMathError(f"decode: unknown scheme '{scheme}' (greedy, beam or cot)")
    if engine not in ("auto", "eager", "static", "graphs"):
        raise ClozeMathError(f"decode: unknown engine '{engine}' (auto, eager, static or graphs)")
    if max_new_tokens < 1 or (batch_size != "auto" and batch_size < 1) or num_beams < 1 or cot_k < 1:
        raise ClozeMathError("decode: max_new_tokens, batch_size, num_beams and cot_k must be at least 1")
    if scheme == "cot" and answer_span is None:
        raise ClozeMathError("decode: CoT-decoding needs answer_span")
    if prompt_attention == "bidirectional":
        implementation = model.config._attn_implementation
        if implementation not in _BIDIRECTIONAL_ATTENTION:
            raise ClozeMathError(
                f"decode: bidirectional prompts need attn_implementation sdpa or eager, not '{implementation}'"
            )
    elif prompt_attention != "causal":
        raise ClozeMathError(f"decode: unknown prompt_attention '{prompt_attention}' (causal or bidirectional)")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ClozeMathError(f"decode: {type(tokenizer).__name__} is not a fast (tokenizers) tokenizer")
    stops = _Stops(_eos_ids(model, tokenizer, eos_token_ids), tuple(stop), max_new_tokens, vocab=len(tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops.eos_ids)

    if not prompts:
        return []
    encoded = _encode(tokenizer, prompts, add_special_tokens)
    if engine == "auto":
        engine = "graphs" if model.device.type == "cuda" else "eager"
    cot_k = min(cot_k, len(tokenizer))
    copies = {"greedy": 1, "beam": num_beams, "cot": cot_k}[scheme]
    size = _batch_size(batch_size, model, encoded, max_new_tokens, copies)
    branching = {"greedy": _Branching(), "beam": None, "cot": _Branching(cot_k, answer_span, normalize_answer)}[scheme]
    stats = stats if stats is not None else DecodeStats()
    results: list[Generation | None] = [None] * len(encoded)

    def emit(index: int, generation: Generation) -> None:
        results[index] = generation

    def decode_batch(indices: list[int], batch_engine: Engine) -> list[Generation]:
        prefill, logits = _prefill(model, [encoded[i] for i in indices], pad_id, prompt_attention)
        if batch_engine == "eager":
            if copies > 1:
                prefill.repeat(copies)
            if branching is not None:
                return _decode_eagerly(prefill, logits, branching, backend, stops)
            batch: _Batch = prefill
        else:
            width = prefill.attention_mask.shape[1]
            batch = _StaticBatch(
                model, len(indices) * copies, _slots(width, max_new_tokens), prefill.cache,
                graphs=batch_engine == "graphs", vocab=stops.vocab, margins=False,
            )
            sources = [prompt for prompt in range(len(indices)) for _ in range(copies)]
            batch.place(range(len(sources)), prefill, sources, [len(encoded[indices[p]]) for p in sources])
        del prefill
        return _beam(batch, logits, tokenizer, stops, num_beams, length_penalty, early_stopping)

    def run(indices: list[int], size: int, part_engine: Engine) -> None:
        """Decode `indices` (longest first), `size` prompts a batch, each generation to `emit` when it is done."""
        if part_engine != "eager" and branching is not None:
            _decode_continuously(
                model, encoded, indices, size, pad_id, prompt_attention, stops, backend, branching,
                part_engine == "graphs", emit, stats,
            )
            return
        for start in range(0, len(indices), size):
            batch_indices = indices[start : start + size]
            for index, generation in zip(batch_indices, decode_batch(batch_indices, part_engine)):
                emit(index, generation)

    with sdpa_kernel(SDPA_BACKENDS):
        for part_engine, part in _engine_parts(model, encoded, max_new_tokens, engine):
            while pending := [index for index in part if results[index] is None]:
                in_batch = min(size, len(pending))
                try:
                    run(pending, size, part_engine)
                    continue
                except torch.OutOfMemoryError:
                    # The auto size is an estimate, and a share of a GPU (`train.gpu_share`) leaves it little slack.
                    if batch_size != "auto" or in_batch == 1:
                        raise
                # out of the except block: its traceback no longer holds the batch's tensors
                size = max(1, in_batch // 2)
                torch.cuda.empty_cache()
                warnings.warn(f"decode: out of memory with {in_batch} prompts a batch; going on with {size}")
    return [generation for generation in results if generation is not None]
