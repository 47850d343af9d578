"""MFT (Masked Thought): token noise on the target, drawn afresh at every training step (a method's `mft`
settings, applied by the training loop to the token ids; no sample of its own)."""

from __future__ import annotations

from typing import Literal

import torch

from clozemath.data.tokenize import IGNORE_INDEX


def mft_rate(step: int, total_steps: int, r_max: float) -> float:
    """Masked Thought's schedule: a linear warm-up to r_max over the first ~66% of training."""
    return min(r_max, r_max * step / (0.66 * total_steps + 1))


def apply_mft_noise(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    rate: float,
    noise: Literal["mask", "random"],
    mask_id: int,
    noise_ids: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """New input ids: each target token (labels != -100) replaced with probability `rate` by `<mask>` or a token
    drawn uniformly from `noise_ids` (the tokenizer's ordinary tokens, as Masked Thought draws them: never a
    special, reserved or padding row). The prefix, the padding and the labels are left as they are.

    `generator` and `noise_ids` must live on `input_ids`' device.
    """
    hit = (labels != IGNORE_INDEX) & (
        torch.rand(input_ids.shape, generator=generator, device=input_ids.device) < rate
    )
    if noise == "mask":
        replacement = torch.full_like(input_ids, mask_id)
    else:
        drawn = torch.randint(0, len(noise_ids), input_ids.shape, generator=generator, device=input_ids.device)
        replacement = noise_ids[drawn].to(input_ids.dtype)
    return torch.where(hit, replacement, input_ids)
