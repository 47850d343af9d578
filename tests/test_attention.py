"""PrefixLM masks on a tiny random Llama: what each position may see, padding, and sdpa / eager / flex agreement."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import LlamaConfig, LlamaForCausalLM

from clozemath.model.attention import (
    FLEX_KERNEL_OPTIONS,
    allowed_pairs,
    attention_inputs,
    block_mask,
    flex_kernel_options,
    head_dim,
    prefix_lm_mask_mod,
)

VOCAB = 97
SEQ = 10
PREFIX = 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def prefix_mask_of(prefix_len: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """True at the first `prefix_len[b]` real (non-padding) positions of row b, wherever its padding lies."""
    return attention_mask.bool() & (attention_mask.cumsum(dim=1) <= prefix_len.unsqueeze(1))


def logits(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prefix_len: torch.Tensor | None,
    impl: str = "sdpa",
) -> torch.Tensor:
    model.set_attn_implementation(impl)
    prefix_mask = None if prefix_len is None else prefix_mask_of(prefix_len, attention_mask)
    with torch.no_grad():
        out = model(input_ids, **attention_inputs(impl, attention_mask, prefix_mask, torch.float32)).logits
    model.set_attn_implementation("sdpa")
    return out


def one_row(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=generator)
    return ids, torch.ones_like(ids), torch.tensor([PREFIX])


def with_token(ids: torch.Tensor, position: int) -> torch.Tensor:
    changed = ids.clone()
    changed[0, position] = (changed[0, position] + 1) % VOCAB
    return changed


def test_prefix_position_sees_a_later_prefix_token(model: LlamaForCausalLM) -> None:
    ids, mask, prefix_len = one_row()
    later = with_token(ids, PREFIX - 1)
    before, after = logits(model, ids, mask, prefix_len), logits(model, later, mask, prefix_len)
    for position in range(PREFIX - 1):
        assert not torch.allclose(before[0, position], after[0, position], atol=ATOL), position
    causal_before, causal_after = logits(model, ids, mask, None), logits(model, later, mask, None)
    torch.testing.assert_close(causal_before[0, : PREFIX - 1], causal_after[0, : PREFIX - 1])


@pytest.mark.parametrize("changed", [PREFIX, PREFIX + 2, SEQ - 1])
def test_no_position_sees_a_later_target_token(model: LlamaForCausalLM, changed: int) -> None:
    ids, mask, prefix_len = one_row()
    before = logits(model, ids, mask, prefix_len)
    after = logits(model, with_token(ids, changed), mask, prefix_len)
    torch.testing.assert_close(before[0, :changed], after[0, :changed], rtol=0, atol=ATOL)
    assert not torch.allclose(before[0, changed], after[0, changed], atol=ATOL)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("prefixed", [True, False], ids=["prefix_lm", "causal"])
def test_padding_on_either_side_changes_nothing(model: LlamaForCausalLM, impl: str, prefixed: bool) -> None:
    ids, mask, prefix_len = one_row()
    prefix_len = prefix_len if prefixed else None
    alone = logits(model, ids, mask, prefix_len, impl)[0]
    for pad_token in (0, 55):
        pad = torch.full((1, 3), pad_token)
        left = logits(model, torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), mask], 1), prefix_len, impl)
        right = logits(model, torch.cat([ids, pad], 1), torch.cat([mask, torch.zeros_like(pad)], 1), prefix_len, impl)
        torch.testing.assert_close(left[0, 3:], alone, rtol=0, atol=ATOL)
        torch.testing.assert_close(right[0, :SEQ], alone, rtol=0, atol=ATOL)


def test_causal_is_the_models_own_causal_output(model: LlamaForCausalLM) -> None:
    ids, mask, _ = one_row()
    own = model(ids).logits.detach()
    torch.testing.assert_close(logits(model, ids, mask, None), own)
    empty_prefix = logits(model, ids, mask, torch.tensor([0]))  # the 4D mask path with nothing bidirectional
    torch.testing.assert_close(empty_prefix, own, rtol=0, atol=ATOL)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows: left padding, right padding, none; different prefix lengths."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (3, SEQ + 3), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return ids, mask, torch.tensor([4, 6, 0])


@pytest.mark.parametrize("impl", ["eager", "flex_attention"])
def test_implementations_agree_with_sdpa(model: LlamaForCausalLM, impl: str) -> None:
    ids, mask, prefix_len = padded_batch()
    reference = logits(model, ids, mask, prefix_len, "sdpa")
    other = logits(model, ids, mask, prefix_len, impl)
    real = mask.bool()
    torch.testing.assert_close(other[real], reference[real], rtol=0, atol=ATOL)


def test_block_mask_holds_the_same_pairs_as_the_dense_mask() -> None:
    _, mask, prefix_len = padded_batch()
    prefix_mask = prefix_mask_of(prefix_len, mask)
    blocks = block_mask(mask, prefix_mask)
    batch, seq = mask.shape
    b, q, kv = torch.meshgrid(torch.arange(batch), torch.arange(seq), torch.arange(seq), indexing="ij")
    from_blocks = blocks.mask_mod(b, torch.zeros_like(b), q, kv)
    assert torch.equal(from_blocks, allowed_pairs(mask, prefix_mask)[:, 0])
    assert blocks.shape == (batch, 1, seq, seq)


def packed_rows(seq: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Two packed rows of `seq` positions: documents of random lengths (a prefix of random length each), the
    first row ending in padding."""
    generator = torch.Generator().manual_seed(seed)
    documents = torch.zeros(2, seq, dtype=torch.long)
    prefix = torch.zeros(2, seq, dtype=torch.bool)
    for row, end in ((0, seq - 77), (1, seq)):
        start, number = 0, 1
        while start < end:
            length = min(int(torch.randint(20, 400, (1,), generator=generator)), end - start)
            documents[row, start:start + length] = number
            prefix[row, start:start + int(torch.randint(0, length + 1, (1,), generator=generator))] = True
            start, number = start + length, number + 1
    return documents, prefix


@pytest.mark.parametrize(("seq", "chunk_elements"), [(1000, 1 << 26), (1000, 1), (768, 2 * 768 * 256)])
def test_block_mask_marks_the_blocks_that_torchs_own_builder_marks(seq: int, chunk_elements: int) -> None:
    """Empty, partial and full blocks as torch's `create_block_mask` (eager) reads them off the same rule, for rows
    that end inside a block or on its edge, however many query blocks are read at once."""
    documents, prefix = packed_rows(seq)
    ours = block_mask(documents, prefix, chunk_elements=chunk_elements)
    torchs = create_block_mask(prefix_lm_mask_mod(documents, prefix), 2, None, seq, seq, device="cpu")
    assert ours.kv_num_blocks.sum() > 0 and ours.full_kv_num_blocks.sum() > 0
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(torchs, name)), name
    assert torch.equal(ours.to_dense(), torchs.to_dense())
    assert ours.seq_lengths == (seq, seq)


@pytest.mark.parametrize(
    ("capability", "dim", "dtype", "tiles"),
    [((9, 0), 64, torch.bfloat16, True), ((9, 0), 64, torch.float16, True), ((9, 0), 128, torch.bfloat16, False),
     ((9, 0), 256, torch.bfloat16, False), ((9, 0), 64, torch.float32, False), ((8, 0), 64, torch.bfloat16, False),
     ((10, 0), 64, torch.bfloat16, False)],
)
def test_our_flex_tiles_go_only_where_torchs_were_measured_slow(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], dim: int, dtype: torch.dtype, tiles: bool
) -> None:
    """16-bit head dimension 64 on Hopper; elsewhere torch's own tiles."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    expected = FLEX_KERNEL_OPTIONS if tiles else None
    assert flex_kernel_options(dim, dtype, torch.device("cuda")) == expected
    assert flex_kernel_options(dim, dtype, torch.device("cpu")) is None


def test_head_dim_is_the_models_own_when_it_sets_one(model: LlamaForCausalLM) -> None:
    assert head_dim(model.config) == 32 // 4
    assert head_dim(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)) == 32
