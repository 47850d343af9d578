"""The physical limits the benchmarks measure against: the FLOPs a training step does (for MFU) and the bytes a
decoding step must read (for the share of the card's memory bandwidth).

The arithmetic is in small pure functions over counts (tested by hand on toy shapes in tests/test_bench_limits.py);
`TrainingShape.of` and `decode_weight_bytes` read those counts off a loaded model.

Training FLOPs, the convention every table states (`MFU_CONVENTION`): model FLOPs of the real (non-padding) tokens,
as in PaLM's MFU (recomputation, e.g. a chunked loss that recomputes its logits in the backward pass, is not counted):

- every frozen weight of a matrix product: 4 FLOPs a token (2 forward, 2 for the input's gradient; no weight
  gradient);
- every LoRA weight (A and B): 6 FLOPs a token (forward, input gradient, weight gradient);
- the output layer (hidden x vocabulary weights): 4 FLOPs a weight at every position it projects, 6 when the output
  matrix itself gets a gradient (the trainable special-token rows of a tied or untied output layer); it projects at
  target positions only in a loss that gathers them first (ours; TRL's fused LM head on a Triton device), at every
  real position where the model makes full logits (the plain loop);
- attention: 12 FLOPs x (heads x head_dim) x layers per attended (query, key) pair (QK^T and AV: 4 forward, 8
  backward), pairs counted within each sample's real context: causal, a position sees itself and every earlier
  position (n(n+1)/2 pairs); PrefixLM, a prefix position also sees the whole prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak by card (vendors' datasheets, SXM)."""
MEMORY_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H200": 4.8e12}
"""HBM bandwidth in bytes/s by card name (NVIDIA's datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s); other cards
(H100 PCIe or NVL among them) are not listed and get no fraction."""

MFU_CONVENTION = (
    "MFU: model FLOPs of real tokens only (no padding, no recomputation) against the card's dense bf16 peak; frozen "
    "weights 4 FLOPs/token, LoRA A+B 6; the output layer 4 FLOPs/weight (6 when its special-token rows train) at the "
    "positions where the mode's loss projects onto the vocabulary (targets: ours, TRL's fused head on GPU; every real "
    "position: full logits); attention 12 x heads x head_dim x layers per attended pair of the real context (causal, "
    "or PrefixLM's bidirectional prefix)"
)
BANDWIDTH_CONVENTION = (
    "bytes/step: what one decoding step must read at least, every weight of a matrix product once (the input "
    "embedding's rows are gathered, not read whole) plus the live rows' key-value cache at their mean live context; "
    "bandwidth: those bytes over all steps / the pass's wall time (prefill included) / the card's datasheet bandwidth"
)


def card_value(table: dict[str, float], device_name: str) -> float | None:
    """The first entry of `table` whose key the device's name contains."""
    return next((value for card, value in table.items() if card in device_name), None)


# --------------------------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class TrainingShape:
    """The weight counts a training step's FLOPs depend on."""

    frozen_weights: int
    """Weights of the decoder's matrix products (attention projections, MLP), frozen under LoRA."""
    lora_weights: int
    """LoRA's A and B matrices, all adapted layers."""
    output_weights: int
    """hidden x vocabulary: the output layer's matrix product."""
    output_trains: bool
    """The output matrix gets a gradient (trainable special-token rows)."""
    attention_width: int
    """heads x head_dim (the width of Q, K and V in the attention products)."""
    layers: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> TrainingShape:
        """Counted off a (peft) causal LM: the matrix-product weights of its decoder, its LoRA matrices, its output
        layer; `output_trains` when a parameter of the output layer requires a gradient."""
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = causal_lm.get_decoder()
        frozen = lora = 0
        for name, module in decoder.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or not isinstance(weight, torch.nn.Parameter):
                continue
            if "lora_" in name:
                lora += weight.numel()
            else:
                frozen += weight.numel()
        output = causal_lm.get_output_embeddings()
        config = causal_lm.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            frozen_weights=frozen,
            lora_weights=lora,
            output_weights=config.hidden_size * output.weight.shape[0],
            output_trains=any(p.requires_grad for p in output.parameters()),
            attention_width=config.num_attention_heads * head_dim,
            layers=config.num_hidden_layers,
        )


def attended_pairs(length: int, prefix_len: int = 0) -> int:
    """(query, key) pairs one sample of `length` real tokens attends: causal after its first `prefix_len` tokens, and
    those see each other both ways (PrefixLM; 0: causal)."""
    causal = length * (length + 1) // 2
    prefix = min(prefix_len, length)
    # a prefix position q sees all `prefix` prefix keys instead of the q + 1 up to itself
    return causal + prefix * prefix - prefix * (prefix + 1) // 2


def target_count(labels: Sequence[int], ignore_index: int = -100) -> int:
    """Positions whose next token is a target: where a loss that gathers targets projects onto the vocabulary."""
    return sum(1 for label in labels[1:] if label != ignore_index)


@dataclass(frozen=True)
class Work:
    """What a set of samples asks of a training step, summed over the samples."""

    tokens: int
    """Real tokens."""
    targets: int
    """Positions whose next token is a target."""
    causal_pairs: int
    prefix_lm_pairs: int

    @classmethod
    def of(cls, rows: Iterable[dict[str, Any]], ignore_index: int = -100) -> Work:
        """Of tokenized samples (`input_ids`, `labels`, `prefix_len`)."""
        tokens = targets = causal = prefix_lm = 0
        for row in rows:
            n = len(row["input_ids"])
            tokens += n
            targets += target_count(row["labels"], ignore_index)
            causal += attended_pairs(n)
            prefix_lm += attended_pairs(n, row.get("prefix_len", 0))
        return cls(tokens, targets, causal, prefix_lm)


def training_flops(shape: TrainingShape, tokens: int, projected: int, pairs: int) -> float:
    """FLOPs of a forward and backward pass over `tokens` real tokens whose output layer projects at `projected`
    positions and whose attention spans `pairs` (query, key) pairs (the module docstring's convention)."""
    per_output_weight = 6 if shape.output_trains else 4
    return (
        (4 * shape.frozen_weights + 6 * shape.lora_weights) * tokens
        + per_output_weight * shape.output_weights * projected
        + 12 * shape.attention_width * shape.layers * pairs
    )


def flops_per_token(shape: TrainingShape, work: Work, targets_only: bool, prefix_lm: bool) -> float:
    """Mean training FLOPs per real token of these samples: the output layer at target positions (`targets_only`) or
    at every real position, attention causal or PrefixLM."""
    projected = work.targets if targets_only else work.tokens
    pairs = work.prefix_lm_pairs if prefix_lm else work.causal_pairs
    return training_flops(shape, work.tokens, projected, pairs) / work.tokens


def mfu(tokens_per_s: float, flops_per_real_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_real_token / peak_flops


# --------------------------------------------------------------------------------------------------------------
# Decoding


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
    batches: Iterable[Sequence[tuple[int, int]]], weight_bytes: int, kv_bytes_per_position: int
) -> Traffic:
    """`batches`: for each batch, (prompt tokens, generated tokens) of every row. A row with prompt p and g generated
    tokens is live for g - 1 steps (its first token comes from the prompt pass); step j (1..g-1) reads p + j cached
    positions (the prompt and tokens 1..j); a batch steps until its longest row ends and reads the weights each step."""
    steps = row_steps = kv_positions = 0
    for rows in batches:
        live = [(p, g - 1) for p, g in rows if g > 1]
        if not live:
            continue
        steps += max(n for _, n in live)
        row_steps += sum(n for _, n in live)
        kv_positions += sum(n * p + n * (n + 1) // 2 for p, n in live)
    return Traffic(steps, row_steps, kv_positions, weight_bytes, kv_bytes_per_position)
