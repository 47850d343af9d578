"""The benchmarks' physical-limit arithmetic (`bench/limits.py`): training FLOPs for MFU, decoding bytes for the share
of the memory bandwidth. Every expected value is worked out by hand in the test's docstring or comments."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from bench.limits import (
    MEMORY_BANDWIDTH, PEAK_BF16_FLOPS, TrainingShape, Work, attended_pairs, card_value, decode_traffic,
    decode_weight_bytes, flops_per_token, kv_bytes_per_position, mfu, target_count, training_flops,
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


def test_the_cards_by_name() -> None:
    assert card_value(MEMORY_BANDWIDTH, "NVIDIA H100 80GB HBM3") == 3.35e12
    assert card_value(MEMORY_BANDWIDTH, "NVIDIA H200") == 4.8e12
    assert card_value(MEMORY_BANDWIDTH, "NVIDIA H100 PCIe") is None  # 2 TB/s, not the SXM card's 3.35
    assert card_value(PEAK_BF16_FLOPS, "NVIDIA H100 80GB HBM3") == 989e12


def test_a_decoding_step_reads_every_weight_once_but_the_gathered_embedding() -> None:
    """The toy Llama in float32: embedding 32 x 8 = 256, the layer's 576 weights and its two norms (16), the final
    norm (8), the output layer 256 weights. Tied: the one 256-row matrix is read as the output layer: 256 + 576 + 16 +
    8 = 856 weights. Untied: the embedding's rows are gathered, the output matrix read: 576 + 16 + 8 + 256 = 856.
    4 bytes each: 3,424."""
    assert decode_weight_bytes(toy_llama(tied=True)) == 3_424
    assert decode_weight_bytes(toy_llama(tied=False)) == 3_424
    # keys and values of 1 layer, 1 head of 4, float32: 2 x 1 x 1 x 4 x 4 = 32 bytes a position
    assert kv_bytes_per_position(layers=1, kv_heads=1, head_dim=4, dtype_bytes=4) == 32


def test_decode_traffic_by_hand() -> None:
    """One batch: row 1, a 3-token prompt and 4 generated tokens (the first from the prompt pass): 3 steps reading
    4, 5 and 6 cached positions (15); row 2, a 5-token prompt and 2 tokens: 1 step reading 6. The batch steps 3 times.
    A second batch whose only row generated 1 token takes no step. Weights 100 bytes, 10 bytes a position:
    3 x 100 + 21 x 10 = 510 bytes, 170 a step; 4 row-steps over 3 steps: 4/3 live rows at a mean context of 21/4;
    over 0.5 s against 2,040 bytes/s: half the bandwidth."""
    traffic = decode_traffic([[(3, 4), (5, 2)], [(7, 1)]], weight_bytes=100, kv_bytes_per_position=10)
    assert (traffic.steps, traffic.row_steps, traffic.kv_positions) == (3, 4, 21)
    assert traffic.total_bytes == 510
    assert traffic.bytes_per_step == 170
    assert traffic.mean_live_rows == pytest.approx(4 / 3)
    assert traffic.mean_context == pytest.approx(21 / 4)
    assert traffic.bandwidth_share(seconds=0.5, bandwidth=2_040) == pytest.approx(0.5)
