"""The eager engine: rows decoding over transformers' DynamicCache, which grows a position each step and can drop
rows (finished ones) or reorder them (beams); and the prompt pass every engine starts from.

It serves the CPU, and a model in training under ZeRO-3 (`clozemath.eval.during_training`).
"""

from __future__ import annotations

from typing import Any

import torch

from clozemath.eval.decoding.settings import PromptAttention
from clozemath.model.attention import additive_mask


class KVBatch:
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


def prefill(
    model: Any, prompts: list[list[int]], pad_id: int, attention: PromptAttention
) -> tuple[KVBatch, torch.Tensor]:
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
    return KVBatch(model, out.past_key_values, attention_mask, positions[:, -1] + 1), out.logits[:, -1]
