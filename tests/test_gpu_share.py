"""On a GPU: `train.gpu_share` caps a process's memory, and the memory-sized plans (packed rows, decoding batches)
size to the share rather than to the whole card."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from clozemath.model.memory import free_bytes, share_gpu, usable_bytes
from clozemath.train.packing import auto_pack_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def quarter() -> Iterator[torch.device]:
    device = torch.device("cuda")
    share_gpu(0.25)
    yield device
    torch.cuda.set_per_process_memory_fraction(1.0)  # the other GPU tests of this process get the whole card


def test_a_quarter_share_caps_the_allocator_and_the_plans(quarter: torch.device) -> None:
    total = torch.cuda.get_device_properties(quarter).total_memory
    assert usable_bytes(quarter) <= total // 4
    assert 0 < free_bytes(quarter) <= usable_bytes(quarter)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(total // 3, dtype=torch.uint8, device=quarter)
    eight_b = type("Shape", (), {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256})()
    # An 8B shape's activations (~7 MB a token) fill a quarter of an 80 GB card in ~1,400 tokens, the whole card in
    # ~5,500: the row shrinks with the share.
    assert auto_pack_tokens(eight_b, usable_bytes(quarter), 1) < auto_pack_tokens(eight_b, total, 1)
