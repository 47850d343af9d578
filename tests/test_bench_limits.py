"""The decoding benchmark's physical limit (`bench/limits.py`): the bytes a decoding step must read, for the share of
the memory bandwidth. Every expected value is worked out by hand in the test's docstring or comments."""

from __future__ import annotations

import pytest

from bench.limits import MEMORY_BANDWIDTH, decode_traffic, decode_weight_bytes, kv_bytes_per_position
from clozemath.train.flops import card_value
from test_flops import toy_llama


def test_the_cards_by_name() -> None:
    assert card_value(MEMORY_BANDWIDTH, "NVIDIA H100 80GB HBM3") == 3.35e12
    assert card_value(MEMORY_BANDWIDTH, "NVIDIA H200") == 4.8e12
    assert card_value(MEMORY_BANDWIDTH, "NVIDIA H100 PCIe") is None  # 2 TB/s, not the SXM card's 3.35


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
    traffic = decode_traffic([[(3, [4]), (5, [2])], [(7, [1])]], weight_bytes=100, kv_bytes_per_position=10)
    assert (traffic.steps, traffic.row_steps, traffic.kv_positions) == (3, 4, 21)
    assert traffic.total_bytes == 510
    assert traffic.bytes_per_step == 170
    assert traffic.mean_live_rows == pytest.approx(4 / 3)
    assert traffic.mean_context == pytest.approx(21 / 4)
    assert traffic.bandwidth_share(seconds=0.5, bandwidth=2_040) == pytest.approx(0.5)


def test_rows_of_one_prompt_read_its_cache_once_a_step() -> None:
    """A 3-token prompt's two rows (beams, branches) generate 4 and 2 tokens: live 3 and 1 steps. The prompt's 3
    positions are read at each of the 3 steps its rows step (9), each row its own tokens: 1 + 2 + 3 and 1 (7)."""
    traffic = decode_traffic([[(3, [4, 2])]], weight_bytes=100, kv_bytes_per_position=10)
    assert (traffic.steps, traffic.row_steps, traffic.kv_positions) == (3, 4, 16)
