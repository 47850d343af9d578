"""On a GPU: FlexAttention with our kernel options (`FLEX_KERNEL_OPTIONS`, the forward's tiles) gives sdpa's result
on packed PrefixLM rows, forward and backward, at the head dimension (64) the options were measured for (in float32,
for a tight tolerance; training passes them in 16-bit on Hopper)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from clozemath.model.attention import FLEX_KERNEL_OPTIONS, attention_inputs, head_dim

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ = 512


def packed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three documents of uneven lengths (each a prefix, then its target) and padding, on the GPU."""
    documents = torch.tensor([1] * 150 + [2] * 210 + [3] * 100 + [0] * (SEQ - 460))
    prefix = torch.tensor([True] * 90 + [False] * 60 + [True] * 140 + [False] * 70 + [True] * 30 + [False] * (SEQ - 390))
    ids = torch.randint(0, 97, (1, SEQ), generator=torch.Generator().manual_seed(0))
    return ids.cuda(), documents[None].cuda(), prefix[None].cuda()


def test_flex_attention_with_our_kernel_options_matches_sdpa() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    assert head_dim(config) == 64
    model = LlamaForCausalLM(config).cuda()
    ids, documents, prefix = packed_row()
    real = documents[0] > 0
    results = {}
    for impl in ("sdpa", "flex_attention"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        inputs = attention_inputs(impl, documents, prefix, torch.float32, FLEX_KERNEL_OPTIONS)
        assert ("kernel_options" in inputs) == (impl == "flex_attention")
        logits = model(ids, **inputs).logits[0, real]
        logits.square().mean().backward()
        results[impl] = logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    (logits, grad), (flex_logits, flex_grad) = results["sdpa"], results["flex_attention"]
    assert torch.allclose(flex_logits, logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(flex_grad, grad, atol=1e-5, rtol=1e-3)
