"""Packing: an epoch's samples laid into rows of a fixed width (`train.pack_tokens`).

Every micro-batch is then one row of the same shape, almost all of it real tokens, so a GPU step does full-size
work whatever the samples' lengths, and a compiled model never meets a new shape. The samples of a row never see
each other (`clozemath.model.attention`'s documents) and their positions restart at 0, so a packed row trains
exactly what the same samples would train one per row.

Which samples share a row is a pure function of (seed, epoch, the lengths): the epoch's seeded permutation breaks
the ties of a best-fit-decreasing packing, and the rows are then shuffled. The number of rows an epoch needs does
not depend on the permutation (equal lengths are interchangeable), so it is known before training and is the same
in every epoch; every rank makes as many (`spread_packs`), so that collectives stay in step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from clozemath.errors import ClozeMathError

Pack = list[int]
"""Row indices of the samples that share one packed row."""

BLOCK = 128
"""FlexAttention's block size: a packed row is a whole number of blocks."""
MIN_PACK_TOKENS, MAX_PACK_TOKENS = 1024, 16_384
"""`auto` stays within these: below, a GPU step is launch-bound again; above, returns are small and the block mask
and the fp32 logits of the target tokens grow."""
MEMORY_SHARE = 0.5
"""Share of the GPU's memory left beside the loaded model that `auto` plans to fill with activations."""


def best_fit_decreasing(lengths: Sequence[int], order: Sequence[int], row_tokens: int) -> list[Pack]:
    """Longest sample first (ties in `order`'s order), each into the fullest row that still has room for it."""
    longest = max((lengths[i] for i in order), default=0)
    if longest > row_tokens:
        raise ClozeMathError(
            f"train.pack_tokens={row_tokens} is shorter than the longest training sample ({longest} tokens): "
            "raise it, or lower data.max_length"
        )
    packs: list[Pack] = []
    free: list[tuple[int, int]] = []  # (free tokens, pack number), sorted
    for i in sorted(order, key=lambda i: -lengths[i]):
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            packs.append([i])
            bisect.insort(free, (row_tokens - lengths[i], len(packs) - 1))
        else:
            room, pack = free.pop(slot)
            packs[pack].append(i)
            if room > lengths[i]:
                bisect.insort(free, (room - lengths[i], pack))
    return packs


def packs_needed(lengths: Sequence[int], row_tokens: int) -> int:
    """Rows an epoch of these samples fills (the same for any permutation)."""
    return len(best_fit_decreasing(lengths, range(len(lengths)), row_tokens))


def spread_packs(packs: list[Pack], count: int) -> list[Pack]:
    """Exactly `count` rows: the rows holding the most samples are halved until there are enough."""
    packs = [list(pack) for pack in packs]
    while len(packs) < count:
        fullest = max(range(len(packs)), key=lambda k: len(packs[k]))
        pack = packs[fullest]
        if len(pack) < 2:
            raise ClozeMathError(f"{sum(map(len, packs))} training samples cannot fill {count} packed rows")
        packs[fullest], half = pack[: len(pack) // 2], pack[len(pack) // 2 :]
        packs.append(half)
    return packs


def epoch_packs(lengths: Sequence[int], row_tokens: int, count: int, seed: int, epoch: int) -> list[Pack]:
    """One epoch's `count` packed rows (every sample in exactly one), in a seeded random order."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    packs = spread_packs(best_fit_decreasing(lengths, order, row_tokens), count)
    return [packs[k] for k in torch.randperm(len(packs), generator=generator).tolist()]


def activation_bytes_per_token(config: object, target_share: float = 0.5) -> float:
    """What one token of a packed row keeps for the backward pass in bf16 LoRA training (an estimate).

    34 x hidden bytes per layer for a transformer layer without recomputation (Korthikanti et al. 2022, without the
    s^2 attention term, which FlexAttention does not store), half as much again for LoRA's adapter inputs and dropout,
    and the fp32 logits (with their gradient) of the target tokens over the vocabulary."""
    layers = config.num_hidden_layers  # type: ignore[attr-defined]
    hidden = config.hidden_size  # type: ignore[attr-defined]
    vocab = config.vocab_size  # type: ignore[attr-defined]
    return 1.5 * 34 * hidden * layers + target_share * 10 * vocab


def auto_pack_tokens(config: object, free_bytes: int, longest: int) -> int:
    """Tokens of a packed row: what `MEMORY_SHARE` of the GPU memory beside the model holds, in [`MIN_PACK_TOKENS`,
    `MAX_PACK_TOKENS`], at least the longest sample, a whole number of FlexAttention blocks."""
    fits = int(MEMORY_SHARE * free_bytes / activation_bytes_per_token(config))
    tokens = min(max(fits, MIN_PACK_TOKENS), MAX_PACK_TOKENS)
    return max(tokens // BLOCK * BLOCK, whole_blocks(longest))


def whole_blocks(tokens: int) -> int:
    """The fewest tokens in whole FlexAttention blocks that hold `tokens`."""
    return -(-tokens // BLOCK) * BLOCK
