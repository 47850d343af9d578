"""The physical limit the decoding benchmark measures against: the bytes a decoding step must read, for the share of
the card's memory bandwidth (`decode_traffic`, `BANDWIDTH_CONVENTION`). Training FLOPs and MFU live in
`clozemath.train.flops` (the training loop logs them too).

The arithmetic is in small pure functions over counts (tested by hand on toy shapes in tests/test_bench_limits.py);
`decode_weight_bytes` reads its count off a loaded model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

MEMORY_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H200": 4.8e12}
"""HBM bandwidth in bytes/s by card name (NVIDIA's datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s); other cards
(H100 PCIe or NVL among them) are not listed and get no fraction."""

BANDWIDTH_CONVENTION = (
    "bytes/step: what one decoding step must read at least, every weight of a matrix product once (the input "
    "embedding's rows are gathered, not read whole) plus the live rows' key-value cache at their mean live context, "
    "a prompt's cache once for all of its rows (beams, CoT branches); "
    "bandwidth: those bytes over all steps / the pass's wall time (prefill included) / the card's datasheet bandwidth"
)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decoding step reads: every parameter once (a tied matrix once), less an untied input
    embedding (a step gathers its rows; a tied one is read whole as the output layer)."""
    parameters = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in parameters.values())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    return total if tied else total - embedding.numel() * embedding.element_size()


def kv_bytes_per_position(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """One position's keys and values over all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class Traffic:
    """The bytes a decoding pass must read."""

    steps: int
    """Decoding steps (a batch's first token comes from its prompt pass; then one step per token of its longest row)."""
    row_steps: int
    """Rows times the steps each was live for."""
    kv_positions: int
    """Cached positions read, summed over live rows and steps."""
    weight_bytes: int
    kv_bytes_per_position: int

    @property
    def total_bytes(self) -> int:
        return self.steps * self.weight_bytes + self.kv_positions * self.kv_bytes_per_position

    @property
    def bytes_per_step(self) -> float:
        return self.total_bytes / self.steps if self.steps else 0.0

    @property
    def mean_live_rows(self) -> float:
        return self.row_steps / self.steps if self.steps else 0.0

    @property
    def mean_context(self) -> float:
        return self.kv_positions / self.row_steps if self.row_steps else 0.0

    def bandwidth_share(self, seconds: float, bandwidth: float) -> float:
        return self.total_bytes / seconds / bandwidth


def decode_traffic(
    batches: Iterable[Sequence[tuple[int, Sequence[int]]]], weight_bytes: int, kv_bytes_per_position: int
) -> Traffic:
    """`batches`: for each batch, each prompt's tokens and the tokens each of its rows generated. A row with g
    generated tokens is live for g - 1 steps (its first token comes from the prompt pass); at its step j (1..g-1) it
    reads its tokens 1..j; the prompt's p cached positions are read once a step while any of its rows is live (its rows
    share them); a batch steps until its longest row ends and reads the weights each step."""
    steps = row_steps = kv_positions = 0
    for prompts in batches:
        live = [(p, [g - 1 for g in rows if g > 1]) for p, rows in prompts]
        longest = max((max(ns) for _, ns in live if ns), default=0)
        if not longest:
            continue
        steps += longest
        row_steps += sum(sum(ns) for _, ns in live)
        kv_positions += sum(p * max(ns, default=0) + sum(n * (n + 1) // 2 for n in ns) for p, ns in live)
    return Traffic(steps, row_steps, kv_positions, weight_bytes, kv_bytes_per_position)
