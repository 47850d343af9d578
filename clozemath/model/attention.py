"""PrefixLM attention: bidirectional among the prefix positions, causal after; padding never attended.

A sequence is described by two [batch, seq] tensors: `attention_mask` (1 for real tokens, 0 for padding, on either
side) and `prefix_mask` (True at the positions of the bidirectional prefix; all False gives a causal mask).
"""

from __future__ import annotations

import torch


def prefix_mask_from_lengths(prefix_len: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """True at the first `prefix_len[b]` real (non-padding) positions of each row, wherever its padding lies."""
    real_rank = attention_mask.long().cumsum(dim=1) - 1  # index of each real token among the row's real tokens
    return attention_mask.bool() & (real_rank < prefix_len.to(real_rank.device).unsqueeze(1))


def allowed_pairs(attention_mask: torch.Tensor, prefix_mask: torch.Tensor) -> torch.Tensor:
    """Boolean [batch, 1, q, k]: may query q attend key k."""
    seq = attention_mask.shape[1]
    positions = torch.arange(seq, device=attention_mask.device)
    causal = positions.view(1, seq, 1) >= positions.view(1, 1, seq)
    bidirectional = prefix_mask.unsqueeze(2) & prefix_mask.unsqueeze(1)
    allowed = (causal | bidirectional) & attention_mask.bool().unsqueeze(1)
    allowed |= torch.eye(seq, dtype=torch.bool, device=attention_mask.device)  # no empty row for a padding query
    return allowed.unsqueeze(1)


def additive_mask(attention_mask: torch.Tensor, prefix_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, 1, q, k] float mask for sdpa/eager attention: 0 where allowed, the dtype's minimum elsewhere.

    Additive, not boolean: transformers' eager attention would silently misread a boolean 4D mask.
    """
    allowed = allowed_pairs(attention_mask, prefix_mask)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
