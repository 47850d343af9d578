"""The static engine (CUDA): rows decoding over a preallocated cache, their per-token step (FlexAttention over each
row's live blocks of the cache, the greedy choice and the margins included) replayed as CUDA graphs ("graphs") or run
eagerly, the same kernels ("static"). A row holds `prompt + max_new_tokens` positions, its prompt at its first slots
(`StaticBatch`: greedy rows, CoT branches); or a prompt's rows share one copy of its keys and values, each row with an
area of its own for its generated tokens (`SharedPromptBatch`: beams, whose reordering then moves no cache).

The host reads the new tokens only every `_GPU_SYNC_EVERY` steps (end-of-sequence, stop strings and the margins are
checked then); rows freed by ended prompts take waiting prompts' passes (`place`: the refilling that
`clozemath.eval.decoding.rows` runs), so that the step keeps one shape for the whole run. With graphs, those steps are
one graph launch: the host launches once per look.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, Cache
from transformers.cache_utils import StaticLayer

from clozemath.eval.decoding.eager import KVBatch
from clozemath.eval.decoding.tokens import greedy_choice, top2_margin

_GPU_SYNC_EVERY = 16
"""Steps between the host's looks at the new tokens (each look waits for the GPU; refills happen
there)."""
_KV_BLOCK = 128
"""Cache positions a block of FlexAttention's block mask holds (its default): a step reads a row's blocks up to the
one its position is in."""
_RECOMPILES = 64
"""Shapes (rows, slots, heads) the compiled attention may take in one process (Dynamo's default limit, 8, would let
later ones fall back to FlexAttention's unfused eager code: a grid's evaluation decodes many sets, decodings and batch
sizes)."""


def whole_blocks(positions: int) -> int:
    """`positions` rounded up to whole blocks of `_KV_BLOCK`."""
    return -(-positions // _KV_BLOCK) * _KV_BLOCK


def slots_for(width: int, max_new_tokens: int) -> int:
    """Static cache positions a row of `StaticBatch` takes for prompts of up to `width` tokens."""
    return whole_blocks(width + max_new_tokens)


def cache_slots(width: int, max_new_tokens: int, copies: int, shared: bool) -> int:
    """Static cache positions a prompt of up to `width` tokens takes with its `copies` rows: each row its prompt and
    generation (`StaticBatch`); `shared`, the prompt once and an area of `max_new_tokens` a row, each in whole blocks
    (`SharedPromptBatch`)."""
    if not shared:
        return copies * slots_for(width, max_new_tokens)
    return whole_blocks(width) + copies * whole_blocks(max_new_tokens)


def sliding_window(model: Any) -> int | None:
    """The window of a model with sliding-window layers (Gemma 3), None for one without. The static engine gives every
    layer every slot it has written: right only while a row's prompt and generation fit the window."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return getattr(config, "sliding_window", None)


@cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled (its fused kernels; for one query a row, its split-KV decoding kernel), one
    specialization per shape: the decoding kernel needs the rows and heads static."""
    return torch.compile(flex_attention, dynamic=False)


def _flex_decode_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: BlockMask, scaling: float, **_: Any,
) -> tuple[torch.Tensor, None]:
    """One query a row over the live blocks of its static cache (`attention_mask`: the batch's block mask); the cache
    has an entry a row, or one for each prompt's `copies` adjacent rows (`SharedPromptBatch`).

    The queries of a cache entry's rows, each query head among those that share a key-value head, are that head's
    queries (a query length of copies x the group's size), so that FlexAttention's decoding kernel reads each key and
    value once for all of them, whatever their number (its own grouped-query path takes groups of a power of two only).
    """
    rows, heads, _, dim = query.shape
    entries, kv_heads = key.shape[0], key.shape[1]
    copies, group = rows // entries, heads // kv_heads
    grouped = query.reshape(entries, copies, kv_heads, group, dim).transpose(1, 2).reshape(entries, kv_heads, -1, dim)
    if query.is_cuda:
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILES):
            out = _compiled_flex()(grouped, key, value, block_mask=attention_mask, scale=scaling)
    else:  # the CPU runs the tests: FlexAttention's reference code, the same function of the same mask
        out = flex_attention(grouped, key, value, block_mask=attention_mask, scale=scaling)
    out = out.view(entries, kv_heads, copies, group, dim).transpose(1, 2)
    return out.reshape(rows, 1, heads, dim), None


_DECODE_ATTENTION = "clozemath_flex_decode"
AttentionInterface.register(_DECODE_ATTENTION, _flex_decode_attention)


def live_block_mask(positions: torch.Tensor, group: int, slots: int) -> tuple[BlockMask, torch.Tensor]:
    """The block mask of rows whose slot `positions[row]` is the last they attend (their prompt at slots 0.., each
    generated token after it): key slot <= position, for each of a row's `group` queries. Also its tensor of live
    blocks a row, which the step updates in place from the positions (`update_live_blocks`)."""
    rows, blocks = positions.shape[0], slots // _KV_BLOCK
    live_blocks = torch.ones((rows, 1, 1), dtype=torch.int32, device=positions.device)
    order = torch.arange(blocks, dtype=torch.int32, device=positions.device).expand(rows, 1, 1, blocks).contiguous()

    def attended(row: torch.Tensor, head: torch.Tensor, query: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return slot <= positions[row]

    mask = BlockMask.from_kv_blocks(live_blocks, order, BLOCK_SIZE=_KV_BLOCK, mask_mod=attended,
                                    seq_lengths=(group, slots))
    return mask, live_blocks


def update_live_blocks(live_blocks: torch.Tensor, positions: torch.Tensor) -> None:
    """Each row's blocks up to the one its position is in."""
    live_blocks.copy_(torch.div(positions, _KV_BLOCK, rounding_mode="floor").view(live_blocks.shape) + 1)


def shared_block_mask(
    lengths: torch.Tensor, lineage: torch.Tensor, copies: int, group: int, prompt_slots: int, slots: int
) -> tuple[BlockMask, torch.Tensor, torch.Tensor]:
    """The block mask of `SharedPromptBatch`'s cache entries: an entry's query q is row `entry * copies + q // group`'s,
    and attends its prompt's slots below `lengths[row]` and the generated slots (from `prompt_slots` on) that
    `lineage[row]` marks. Also its tensors of live blocks an entry and of each entry's order of blocks, which the batch
    updates in place (`SharedPromptBatch._block_order`, `_before_step`)."""
    entries, blocks = lengths.shape[0] // copies, slots // _KV_BLOCK
    live_blocks = torch.ones((entries, 1, 1), dtype=torch.int32, device=lengths.device)
    order = torch.arange(blocks, dtype=torch.int32, device=lengths.device).expand(entries, 1, 1, blocks).contiguous()

    def attended(entry: torch.Tensor, head: torch.Tensor, query: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        row = entry * copies + query // group
        generated = slot - prompt_slots
        return (slot < lengths[row]) | ((generated >= 0) & lineage[row, generated.clamp(min=0)])

    mask = BlockMask.from_kv_blocks(live_blocks, order, BLOCK_SIZE=_KV_BLOCK, mask_mod=attended,
                                    seq_lengths=(copies * group, slots))
    return mask, live_blocks, order


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


class _SharedSlotLayer(StaticLayer):
    """A static cache layer of one entry a prompt (`SharedPromptBatch`): each row writes its step's key and value at
    its own slot (`slot[row]`) of its prompt's entry (`entry[row]`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, entry: torch.Tensor, slot: torch.Tensor):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True
        heads = torch.arange(keys.shape[1], device=keys.device)
        self._index = (entry[:, None], heads[None, :], slot[:, None])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.keys.index_put_(self._index, key_states[:, :, 0])
        self.values.index_put_(self._index, value_states[:, :, 0])
        return self.keys, self.values


def _on_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints as a device tensor, copied without waiting for the device's queue (pinned, non-blocking)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class StaticBatch:
    """Rows decoding over a preallocated cache of `slots` positions a row, in place and in fixed shapes, so that the
    step can be replayed as a CUDA graph (`graphs=True`; else it runs eagerly, the same kernels).

    A row holds its prompt at slots 0..len-1 and its generated tokens after. The step's inputs live in fixed tensors:
    each row's token and its position (the slot the step writes); a row attends its slots up to its position (its
    prompt's, then each one as the step writes it; a former occupant's beyond are never read), through a block mask
    whose live blocks follow the positions (`live_block_mask`). `place` fills rows from a prompt pass, at the start or
    into rows freed later; a row that has ended rides along until then (its position stops at the last slot). Greedy
    and CoT rows choose their next token within the step (`advance`: with graphs, `sync_every` steps are one graph)
    and keep every step's tokens and margins on the device until the host `read`s them; beam search takes the step's
    logits (`step`) and reorders its rows (`SharedPromptBatch.take`: its layout's).
    """

    drops_rows = False

    def __init__(self, model: Any, rows: int, slots: int, like: Any, graphs: bool, vocab: int, margins: bool):
        """`like`: a prompt pass's cache, for each layer's heads, head size and dtype. `slots`: a multiple of
        `_KV_BLOCK` (`slots_for`)."""
        device = like.layers[0].keys.device
        self.model, self.slots, self.sync_every, self._vocab = model, slots, _GPU_SYNC_EVERY, vocab
        self._graphs = graphs
        self._positions = torch.zeros(rows, dtype=torch.long, device=device)
        """Each row's position: the one its next token is fed at."""
        self._build(rows, like)
        self._tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self._history = torch.zeros((rows, self.sync_every + 1), dtype=torch.long, device=device)
        """Column 0: the first token of rows placed since the host's last look; column j: step j's tokens."""
        self._margin_history = torch.zeros((rows, self.sync_every + 1), device=device) if margins else None
        self._column = torch.ones(1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: Callable[..., torch.Tensor] | None = None
        """The function the graph replays: unbound, so that the batch holds no reference to itself (a cycle would
        keep its cache and the graph's memory pool until Python's cycle collector runs, past the next batch's
        allocation)."""
        self._output: torch.Tensor | None = None

    def place(
        self, rows: Sequence[int], prefill: KVBatch, sources: Sequence[int], lengths: Sequence[int],
        tokens: torch.Tensor | None = None, margins: torch.Tensor | None = None,
    ) -> None:
        """Rows `rows` take the prompts of rows `sources` of a prompt pass (left-padded; `lengths`: their tokens): its
        keys and values moved to slots 0..len-1, the next position; for greedy and CoT rows their first token (and
        margin)."""
        device = self._tokens.device
        index, source_index, length = (_on_device(values, device) for values in (rows, sources, lengths))
        self._place_prompts(rows, index, prefill, source_index, length, lengths)
        self._positions.index_copy_(0, index, length)
        if tokens is not None:
            self._tokens.index_copy_(0, index, tokens)
            self._history[:, 0].index_copy_(0, index, tokens)
        if margins is not None and self._margin_history is not None:
            self._margin_history[:, 0].index_copy_(0, index, margins)

    def _build(self, rows: int, like: Any) -> None:
        """The cache (a row's prompt at slots 0..len-1, its generated tokens after) and its block mask."""
        self.cache = Cache(layers=[
            _SlotLayer(
                layer.keys.new_zeros((rows, layer.keys.shape[1], self.slots, layer.keys.shape[3])),
                layer.values.new_zeros((rows, layer.values.shape[1], self.slots, layer.values.shape[3])),
                self._positions,
            )
            for layer in like.layers
        ])  # zeros, not empty: a live block's unwritten slot adds 0 x value, and 0 x NaN would poison the row
        self._mask, self._live_blocks = live_block_mask(self._positions, _query_group(self.model), self.slots)

    def _place_prompts(
        self, rows: Sequence[int], index: torch.Tensor, prefill: KVBatch, source_index: torch.Tensor,
        length: torch.Tensor, lengths: Sequence[int],
    ) -> None:
        """The prompt pass's keys and values of rows `source_index` to slots 0..len-1 of rows `index` (`length`, and
        on the host `lengths`: their tokens)."""
        _move_prompts(prefill, source_index, length, self.cache, index)

    def _before_step(self) -> None:
        """Inside the step, before the model: the block mask follows the positions."""
        update_live_blocks(self._live_blocks, self._positions)

    def _after_step(self) -> None:
        """Inside the step, after the model: every row's next position."""
        self._positions.add_(1).clamp_(max=self.slots - 1)  # only an ended row gets there: live ones stop 1 before

    def _forward(self) -> torch.Tensor:
        """One step: every row feeds its token at its position (and slot); the next-token logits [rows, vocab]."""
        self._before_step()
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
        self._after_step()
        return out.logits[:, -1]

    def _choose(self) -> torch.Tensor:
        """One step, then each row's greedy choice (and margin) as its next token, kept in the history's next column."""
        logits = self._forward()
        if self._margin_history is not None:
            self._margin_history.index_copy_(1, self._column, top2_margin(logits)[:, None])
        self._tokens.copy_(greedy_choice(logits, self._vocab))
        self._history.index_copy_(1, self._column, self._tokens[:, None])
        self._column.add_(1)
        return logits

    def _replayed(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()`; with graphs, captured at its first call (run eagerly on a side stream first, as capture needs) and
        replayed after: its output is then valid until the next step."""
        if not self._graphs:
            return run()
        if self._graph is not None:
            assert self._captured is _function(run) and self._output is not None
            self._graph.replay()
            return self._output
        stream = _capture_stream(self._tokens.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            output = run()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph, self._captured = torch.cuda.CUDAGraph(), _function(run)
        with torch.cuda.graph(self._graph, stream=stream):
            self._output = run()
        return output

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; the next-token logits [rows, vocab] (with graphs: valid until the next step)."""
        self._tokens.copy_(tokens)
        return self._replayed(self._forward)

    def advance(self, steps: int) -> None:
        """`steps` (at most `sync_every`) greedy steps, their tokens and margins kept on the device, each a replay of
        the step's graph. (A look's steps captured as one graph measured slower on an H200: 74.9 against 80.4
        problems/s at 64 rows, 184.6 against 240.1 at 512; bench/results/decode_flex_h200_2026-12-02/chunk_ab/.)"""
        self._column.fill_(1)
        for _ in range(steps):
            self._replayed(self._choose)

    def read(self, steps: int) -> tuple[list[list[int]], list[list[float]] | None]:
        """For each row: its first token (if placed since the last look), then the tokens of the last `steps` steps;
        the same for the margins."""
        tokens = self._history[:, : steps + 1].tolist()
        margins = self._margin_history[:, : steps + 1].tolist() if self._margin_history is not None else None
        return tokens, margins


class SharedPromptBatch(StaticBatch):
    """A prompt's `copies` rows (beams; adjacent) over one entry of the cache: the prompt's keys and values once, at
    slots 0..len-1 of an area of `prompt_slots`, then an area of `new_slots` a row, the key and value of the token a
    row feeds at its j-th step at slot j of its area. A row attends its prompt and the generated slots its lineage
    marks (the tokens of the beams it descends from), so that beam search's reordering (`take`) moves a bit a slot,
    not the cache. The queries of an entry's rows are one query group over its keys: a step reads the prompt's keys
    and values once for all of its rows, as `place` writes them once.
    """

    def __init__(
        self, model: Any, rows: int, copies: int, prompt_slots: int, new_slots: int, like: Any, graphs: bool,
        vocab: int, margins: bool,
    ):
        """`prompt_slots`, `new_slots`: whole blocks of `_KV_BLOCK` (`whole_blocks`)."""
        self.copies, self.prompt_slots, self.new_slots = copies, prompt_slots, new_slots
        super().__init__(model, rows, prompt_slots + copies * new_slots, like, graphs, vocab, margins)

    def _build(self, rows: int, like: Any) -> None:
        device, copies = self._positions.device, self.copies
        row_index = torch.arange(rows, device=device)
        self._lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self._area = self.prompt_slots + row_index % copies * self.new_slots
        """A row's area: its first slot."""
        self._slot = torch.zeros(rows, dtype=torch.long, device=device)
        """The slot a row writes at this step."""
        self._lineage = torch.zeros((rows, copies * self.new_slots), dtype=torch.bool, device=device)
        """The generated slots (from `prompt_slots` on) a row attends."""
        self._prompt_blocks = torch.ones(rows // copies, dtype=torch.int32, device=device)
        self.cache = Cache(layers=[
            _SharedSlotLayer(
                layer.keys.new_zeros((rows // copies, layer.keys.shape[1], self.slots, layer.keys.shape[3])),
                layer.values.new_zeros((rows // copies, layer.values.shape[1], self.slots, layer.values.shape[3])),
                row_index // copies, self._slot,
            )
            for layer in like.layers
        ])
        self._mask, self._live_blocks, self._order = shared_block_mask(
            self._lengths, self._lineage, copies, _query_group(self.model), self.prompt_slots, self.slots
        )

    def _place_prompts(
        self, rows: Sequence[int], index: torch.Tensor, prefill: KVBatch, source_index: torch.Tensor,
        length: torch.Tensor, lengths: Sequence[int],
    ) -> None:
        """Whole entries only: `rows` are `copies` adjacent rows a prompt, its first at a multiple of `copies`."""
        copies, device = self.copies, index.device
        firsts = list(rows[::copies])
        if list(rows) != [first + copy for first in firsts for copy in range(copies)] or any(
            first % copies for first in firsts
        ):
            raise ValueError(f"SharedPromptBatch.place: rows {list(rows)} are not whole entries of {copies} rows")
        entries = _on_device([first // copies for first in firsts], device)
        _move_prompts(prefill, source_index[::copies], length[::copies], self.cache, entries)
        self._lengths.index_copy_(0, index, length)
        self._lineage.index_fill_(0, index, False)
        prompt_blocks = [whole_blocks(n) // _KV_BLOCK for n in lengths[::copies]]
        self._prompt_blocks.index_copy_(0, entries, _on_device(prompt_blocks, device).to(torch.int32))
        orders = [self._block_order(blocks) for blocks in prompt_blocks]
        self._order[:, 0, 0].index_copy_(0, entries, _on_device(orders, device).to(torch.int32))

    def _block_order(self, prompt_blocks: int) -> list[int]:
        """An entry's blocks, those a step may read first: its prompt's `prompt_blocks`, then the generated ones,
        block by block across its rows' areas (at any step the live ones come first), then the prompt area's rest."""
        first, area = self.prompt_slots // _KV_BLOCK, self.new_slots // _KV_BLOCK
        generated = [first + copy * area + block for block in range(area) for copy in range(self.copies)]
        return [*range(prompt_blocks), *generated, *range(prompt_blocks, first)]

    def _before_step(self) -> None:
        made = self._positions - self._lengths  # tokens a row has fed before this one: its slot within its area
        self._slot.copy_(self._area + made)
        self._lineage.scatter_(1, (self._slot - self.prompt_slots)[:, None], True)
        made_blocks = torch.div(made.view(-1, self.copies)[:, 0], _KV_BLOCK, rounding_mode="floor") + 1
        self._live_blocks.copy_((self._prompt_blocks + self.copies * made_blocks).view(self._live_blocks.shape))

    def _after_step(self) -> None:
        # only an ended row gets to its area's last slot: live ones stop 1 before
        self._positions.copy_(torch.minimum(self._positions + 1, self._lengths + (self.new_slots - 1)))

    def take(self, index: torch.Tensor) -> None:
        """Reorder rows within their prompt's entry (beams): each takes the lineage of the row it continues."""
        self._lineage.copy_(self._lineage.index_select(0, index))


def _move_prompts(
    prefill: KVBatch, source_index: torch.Tensor, length: torch.Tensor, cache: Cache, index: torch.Tensor
) -> None:
    """The keys and values of prompt pass rows `source_index` (left-padded, `length` tokens) to slots 0..len-1 of
    cache entries `index`."""
    width = prefill.attention_mask.shape[1]
    offsets = torch.arange(width, device=index.device)
    moved = (width - length[:, None] + offsets).clamp_(max=width - 1)  # slot t <- position width - len + t
    for source, target in zip(prefill.cache.layers, cache.layers):
        for states, into in ((source.keys, target.keys), (source.values, target.values)):
            picked = states.index_select(0, source_index)
            picked = picked.gather(2, moved[:, None, :, None].expand(-1, picked.shape[1], -1, picked.shape[3]))
            into[:, :, :width].index_copy_(0, index, picked)


def _query_group(model: Any) -> int:
    """Query heads a key-value head serves."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    return heads // (getattr(config, "num_key_value_heads", None) or heads)


@cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every capture on `device` runs on. PyTorch keeps a cuBLAS workspace for each stream a matmul
    has run on (32 MiB on Hopper) for the life of the process: a new stream per batch held one more each time (up to
    its pool of 32 streams a device), which the 2026-11-27 lease measured as 256 MiB after 8 beam batches."""
    return torch.cuda.Stream(device)


def _function(run: Callable[[], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A bound method's function (the same object at every step; the bound method is new at each access)."""
    return getattr(run, "__func__", run)


def static_batch(
    model: Any, rows: int, copies: int, shared: bool, width: int, max_new_tokens: int, like: Any, graphs: bool,
    vocab: int, margins: bool,
) -> StaticBatch:
    """The static batch of `rows` rows, `copies` a prompt (adjacent), for prompts of up to `width` tokens: a cache
    entry a row, or (`shared`) one a prompt (the arguments of `StaticBatch`)."""
    if not shared:
        return StaticBatch(model, rows, slots_for(width, max_new_tokens), like, graphs, vocab, margins)
    return SharedPromptBatch(
        model, rows, copies, whole_blocks(width), whole_blocks(max_new_tokens), like, graphs, vocab, margins
    )
