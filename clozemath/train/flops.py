"""Training FLOPs and model FLOPs utilisation (MFU): what a training step does against what the card can do. The
training loop logs each step's MFU (`train/mfu`), the benchmarks (`bench/`) report their runs' and their baselines'
by the same count, and `clozemath.cost` scales throughput between models with it.

The convention (`MFU_CONVENTION`, stated wherever a figure is shown): model FLOPs of the real (non-padding) tokens,
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

The arithmetic is in small pure functions over counts (tested by hand on toy shapes in tests/test_flops.py);
`TrainingShape.of` reads those counts off a loaded model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak by card (vendors' datasheets, SXM)."""
MFU_CONVENTION = (
    "MFU: model FLOPs of real tokens only (no padding, no recomputation) against the card's dense bf16 peak; frozen "
    "weights 4 FLOPs/token, LoRA A+B 6; the output layer 4 FLOPs/weight (6 when its special-token rows train) at the "
    "positions where the mode's loss projects onto the vocabulary (targets: ours, TRL's fused head on GPU; every real "
    "position: full logits); attention 12 x heads x head_dim x layers per attended pair of the real context (causal, "
    "or PrefixLM's bidirectional prefix)"
)


def card_value(table: dict[str, float], device_name: str) -> float | None:
    """The first entry of `table` whose key the device's name contains."""
    return next((value for card, value in table.items() if card in device_name), None)


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


def training_flops(shape: TrainingShape, tokens: float, projected: float, pairs: float) -> float:
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


def sample_flops(shape: TrainingShape, row: Mapping[str, Any], prefix_lm: bool, ignore_index: int = -100) -> float:
    """Training FLOPs of one tokenized sample (`input_ids`, `labels`, `prefix_len`) in our loop: the output layer at
    its target positions only, attention causal or PrefixLM."""
    tokens = len(row["input_ids"])
    pairs = attended_pairs(tokens, row.get("prefix_len", 0) if prefix_lm else 0)
    return training_flops(shape, tokens, target_count(row["labels"], ignore_index), pairs)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device`'s card (`PEAK_BF16_FLOPS`); None on a CPU or a card not listed."""
    if device.type != "cuda":
        return None
    return card_value(PEAK_BF16_FLOPS, torch.cuda.get_device_name(device))
