"""Training FLOPs and MFU (`clozemath.train.flops`), and the MFU a training run logs. Every expected value is worked
out by hand in the test's docstring or comments."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from clozemath.train.flops import (
    PEAK_BF16_FLOPS, TrainingShape, Work, attended_pairs, card_value, flops_per_token, mfu, sample_flops,
    target_count, training_flops,
)


def toy_llama(tied: bool) -> LlamaForCausalLM:
    """hidden 8, MLP 16, 2 heads of 4, 1 key-value head, 1 layer, 32 tokens (float32)."""
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def toy_lora(model: LlamaForCausalLM, rows: list[int] | None) -> torch.nn.Module:
    config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", trainable_token_indices=rows)
    return get_peft_model(model, config)


def test_the_weight_counts_of_a_toy_llama_with_lora() -> None:
    """Frozen: q 8x8 = 64, k 8x4 = 32, v 32, o 64, gate 8x16 = 128, up 128, down 128: 576. LoRA rank 2, r x (in +
    out): q 2 x 16 = 32, k 2 x 12 = 24, v 24, o 32, gate 2 x 24 = 48, up 48, down 48: 256. Output: 8 x 32 = 256.
    Attention width 2 heads x 4 = 8. The output matrix trains only with trainable special-token rows."""
    with_rows = TrainingShape.of(toy_lora(toy_llama(tied=True), rows=[3, 4]))
    assert with_rows == TrainingShape(frozen_weights=576, lora_weights=256, output_weights=256, output_trains=True,
                                      attention_width=8, layers=1)
    untied = TrainingShape.of(toy_lora(toy_llama(tied=False), rows=None))
    assert (untied.frozen_weights, untied.lora_weights, untied.output_trains) == (576, 256, False)
    plain = TrainingShape.of(toy_llama(tied=False))  # no LoRA at all
    assert (plain.frozen_weights, plain.lora_weights) == (576, 0)


def test_attended_pairs_causal_and_prefix_lm() -> None:
    """Causal, 5 tokens: 1 + 2 + 3 + 4 + 5 = 15. PrefixLM with a prefix of 3: the prefix positions see 3 keys each
    (9), then 4 and 5: 18. A prefix of the whole sample: every position sees all 5: 25. A prefix of 1 is causal."""
    assert attended_pairs(5) == 15
    assert attended_pairs(5, prefix_len=3) == 18
    assert attended_pairs(5, prefix_len=5) == 25
    assert attended_pairs(5, prefix_len=1) == 15


def test_the_work_of_two_samples() -> None:
    """A: 5 tokens, prefix 3, targets at positions 3 and 4 (predicted from positions 2 and 3): 2 target positions,
    15 causal pairs, 18 PrefixLM pairs. B: 3 tokens, prefix 1, targets at 1 and 2: 2, 6 and 6 (a one-token prefix is
    causal). Sums: 8 tokens, 4 targets, 21 and 24 pairs."""
    rows = [
        {"input_ids": [11, 12, 13, 14, 15], "labels": [-100, -100, -100, 14, 15], "prefix_len": 3},
        {"input_ids": [21, 22, 23], "labels": [-100, 22, 23], "prefix_len": 1},
    ]
    assert target_count(rows[0]["labels"]) == 2
    assert Work.of(rows) == Work(tokens=8, targets=4, causal_pairs=21, prefix_lm_pairs=24)


def test_training_flops_by_the_convention() -> None:
    """The toy shape, 10 tokens, the output layer at 4 positions, 30 pairs:
    (4 x 576 + 6 x 256) x 10 = 38,400; output 6 x 256 x 4 = 6,144 (4 x 256 x 4 = 4,096 when it does not train);
    attention 12 x 8 x 1 x 30 = 2,880. Total 47,424 (45,376)."""
    shape = TrainingShape(frozen_weights=576, lora_weights=256, output_weights=256, output_trains=True,
                          attention_width=8, layers=1)
    assert training_flops(shape, tokens=10, projected=4, pairs=30) == 47_424
    frozen_output = TrainingShape(576, 256, 256, False, 8, 1)
    assert training_flops(frozen_output, tokens=10, projected=4, pairs=30) == 45_376


def test_flops_per_token_counts_the_output_layer_where_the_loss_projects() -> None:
    """The two samples above (8 tokens, 4 targets, 21 causal / 24 PrefixLM pairs), the toy shape with training rows:
    at targets, PrefixLM: (3,840 x 8 + 6 x 256 x 4 + 96 x 24) / 8 = (30,720 + 6,144 + 2,304) / 8 = 4,896;
    full logits, causal: (30,720 + 6 x 256 x 8 + 96 x 21) / 8 = (30,720 + 12,288 + 2,016) / 8 = 5,628."""
    shape = TrainingShape(576, 256, 256, True, 8, 1)
    work = Work(tokens=8, targets=4, causal_pairs=21, prefix_lm_pairs=24)
    assert flops_per_token(shape, work, targets_only=True, prefix_lm=True) == 4_896
    assert flops_per_token(shape, work, targets_only=False, prefix_lm=False) == 5_628
    # MFU: 50,000 tokens/s x 4,896 FLOPs over a 979.2 MFLOP/s peak is a quarter
    assert mfu(50_000, 4_896, 979.2e6) == pytest.approx(0.25)


def test_the_flops_of_one_sample_in_our_loop() -> None:
    """Sample A above (5 tokens, prefix 3, 2 targets), the toy shape with training rows; our loss projects at the
    targets only: (4 x 576 + 6 x 256) x 5 = 19,200, output 6 x 256 x 2 = 3,072; attention 96 x 18 PrefixLM pairs =
    1,728 (total 24,000), or 96 x 15 causal = 1,440 (23,712)."""
    shape = TrainingShape(576, 256, 256, True, 8, 1)
    row = {"input_ids": [11, 12, 13, 14, 15], "labels": [-100, -100, -100, 14, 15], "prefix_len": 3}
    assert sample_flops(shape, row, prefix_lm=True) == 24_000
    assert sample_flops(shape, row, prefix_lm=False) == 23_712


def test_the_cards_by_name() -> None:
    assert card_value(PEAK_BF16_FLOPS, "NVIDIA H100 80GB HBM3") == 989e12
    assert card_value(PEAK_BF16_FLOPS, "NVIDIA H200") == 989e12
    assert card_value(PEAK_BF16_FLOPS, "NVIDIA GeForce RTX 4090") is None
