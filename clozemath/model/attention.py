"""PrefixLM attention over rows that hold one or several samples (packing): bidirectional among a sample's prefix
positions, causal after, never across samples; padding never attended.

A batch is described by two [batch, seq] tensors: `attention_mask` (0 for padding; otherwise the number of the
sample, the *document*, a position belongs to: 1 everywhere in an unpacked row, 1, 2, 3, ... along a packed row)
and `prefix_mask` (True at the positions of each document's bidirectional prefix; all False gives causal
attention). A plain 0/1 padding mask is the one-document case. The rule lives in one `mask_mod` (FlexAttention's
form); the dense masks for sdpa/eager evaluate the same function.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from torch.nn.attention.flex_attention import BlockMask

AttnImplementation = Literal["sdpa", "flex_attention", "eager"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

FLEX_KERNEL_OPTIONS: dict[str, Any] = {"BLOCK_M": 64, "BLOCK_N": 64}
"""FlexAttention's forward tiles for 16-bit head dimension 64 on Hopper. torch 2.11's own choice there (128 x 128,
3 stages, 4 warps) ran our packed PrefixLM rows' forward ~28x slower: 8.98 ms against 0.32 ms for a 16,384-token row
of the Llama-3.2-1B shape on an H200 (`bench/results/train_throughput_flex_tiles_h100_h200.md`). The backward keeps
its own."""


def head_dim(config: Any) -> int:
    """A transformers config's attention head size (`head_dim` where the model sets it apart from hidden / heads)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def flex_kernel_options(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any] | None:
    """`kernel_options` for FlexAttention where torch's own tiles were measured slow (`FLEX_KERNEL_OPTIONS`); None
    elsewhere: other head dimensions and other cards keep torch's choice, not measured here (for Gemma-3's 256 torch
    picks 64 x 32 on Hopper, and 64 x 64 tiles may not fit its shared memory)."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return FLEX_KERNEL_OPTIONS if hopper and head_dim == 64 and dtype in (torch.bfloat16, torch.float16) else None


def prefix_lm_mask_mod(attention_mask: torch.Tensor, prefix_mask: torch.Tensor) -> MaskMod:
    """FlexAttention `mask_mod(batch, head, q, kv)`: may query q attend key kv.

    Only within one document; there causal, or both ways between two prefix positions. A query always sees itself,
    so that a padding query has a non-empty row (no NaN); real queries never see padding.
    """
    documents = attention_mask.long()
    prefix = prefix_mask.bool() & attention_mask.bool()

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        same_document = (documents[b, q] == documents[b, kv]) & (documents[b, kv] > 0)
        visible = (q >= kv) | (prefix[b, q] & prefix[b, kv])
        return (same_document & visible) | (q == kv)

    return mask_mod


def allowed_pairs(attention_mask: torch.Tensor, prefix_mask: torch.Tensor) -> torch.Tensor:
    """Boolean [batch, 1, q, k]: may query q attend key k."""
    batch, seq = attention_mask.shape
    device = attention_mask.device
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    positions = torch.arange(seq, device=device)
    head = torch.zeros((), dtype=torch.long, device=device)
    mask_mod = prefix_lm_mask_mod(attention_mask, prefix_mask)
    return mask_mod(b, head, positions.view(1, 1, seq, 1), positions.view(1, 1, 1, seq))


def additive_mask(attention_mask: torch.Tensor, prefix_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, 1, q, k] float mask for sdpa/eager attention: 0 where allowed, the dtype's minimum elsewhere.

    Additive, not boolean: transformers' eager attention would silently misread a boolean 4D mask.
    """
    allowed = allowed_pairs(attention_mask, prefix_mask)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


SPARSE_BLOCK = 128
"""FlexAttention's block: the tile of queries x keys that its BlockMask marks empty, partial or full (torch's default)."""

DENSE_CHUNK_ELEMENTS = 1 << 26
"""Query-key pairs evaluated at once while reading off a BlockMask (64 MiB of booleans and a few temporaries)."""


def block_mask(
    attention_mask: torch.Tensor, prefix_mask: torch.Tensor, chunk_elements: int = DENSE_CHUNK_ELEMENTS
) -> BlockMask:
    """The same rule as a FlexAttention BlockMask (one per batch row, shared by all heads).

    Built eagerly, a chunk of query blocks at a time, so the dense [seq, seq] mask never exists whole (a packed row of
    16k tokens would need 256M booleans). Not `create_block_mask(_compile=True)`: on torch 2.11 its compiled argsort
    lowers to a Triton sort whose cold compile took ~230 s for 16,384-token rows on an H200, almost all of a training
    run's first step (pytorch/pytorch#182060). Eagerly the map costs a few elementwise passes over the pairs."""
    batch, seq = attention_mask.shape
    device = attention_mask.device
    blocks = -(-seq // SPARSE_BLOCK)
    padded = blocks * SPARSE_BLOCK
    pad = (0, padded - seq)
    rule = prefix_lm_mask_mod(torch.nn.functional.pad(attention_mask, pad), torch.nn.functional.pad(prefix_mask, pad))
    positions = torch.arange(padded, device=device)
    in_row = positions < seq
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    head = torch.zeros((), dtype=torch.long, device=device)
    query_rows = max(1, chunk_elements // (batch * padded * SPARSE_BLOCK)) * SPARSE_BLOCK
    partial, full = [], []
    for start in range(0, padded, query_rows):
        q = positions[start:start + query_rows].view(1, -1, 1)
        allowed = rule(b, head, q, positions.view(1, 1, -1)) & in_row[q] & in_row.view(1, 1, -1)
        tiles = allowed.view(batch, -1, SPARSE_BLOCK, blocks, SPARSE_BLOCK)
        every = tiles.all(dim=4).all(dim=2)
        partial.append(tiles.any(dim=4).any(dim=2) & ~every)
        full.append(every)
    partial_num, partial_indices = ordered_blocks(torch.cat(partial, dim=1))
    full_num, full_indices = ordered_blocks(torch.cat(full, dim=1))
    return BlockMask.from_kv_blocks(
        partial_num, partial_indices, full_num, full_indices, BLOCK_SIZE=SPARSE_BLOCK,
        mask_mod=prefix_lm_mask_mod(attention_mask, prefix_mask), seq_lengths=(seq, seq),
    )


def ordered_blocks(marked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, q blocks, kv blocks] booleans -> FlexAttention's (count, indices) per query block, one head: the
    marked key blocks' indices first, in order."""
    counts = marked.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(marked.to(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.unsqueeze(1), indices.unsqueeze(1)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that restart at every document (a packed row's samples each start at 0); padding on the left of a
    row does not shift its positions."""
    documents = attention_mask.long()
    positions = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
    return positions - first


def attention_inputs(
    attn_implementation: AttnImplementation,
    attention_mask: torch.Tensor,
    prefix_mask: torch.Tensor | None,
    dtype: torch.dtype,
    kernel_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments (`attention_mask`, `position_ids`; FlexAttention's `kernel_options` when given) for a
    transformers causal LM over whole sequences.

    `prefix_mask=None` means causal attention over one-document rows: the 2D padding mask is passed and the model
    builds its own (fastest) causal mask. Otherwise (PrefixLM, or a packed row, whose causal mask is all-False
    `prefix_mask`) a 4D mask: additive float for sdpa/eager (`dtype` = the model's compute dtype), a BlockMask for
    flex_attention. transformers passes a 4D mask or a BlockMask through untouched.
    """
    inputs: dict[str, Any] = {"position_ids": position_ids_for(attention_mask)}
    if prefix_mask is None:
        inputs["attention_mask"] = attention_mask
    elif attn_implementation == "flex_attention":
        inputs["attention_mask"] = block_mask(attention_mask, prefix_mask)
        if kernel_options is not None:
            inputs["kernel_options"] = kernel_options
    else:
        inputs["attention_mask"] = additive_mask(attention_mask, prefix_mask, dtype)
    return inputs
