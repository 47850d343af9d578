"""A model's shape as training builds it, on PyTorch's meta device (nothing allocated, no weights read), and the
training FLOPs of one of its tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from clozemath.config import ModelConfig
from clozemath.data.tokenize import MASK, SEP, SpecialTokens, sentinel


@dataclass(frozen=True)
class Shape:
    """A model's shape as training builds it (LoRA, special-token rows), with nothing allocated."""

    model: torch.nn.Module
    """peft-wrapped, on the meta device."""
    params: int
    tokenizer_note: str

    @property
    def config(self) -> Any:
        return self.model.config


def special_tokens_for(vocab: int, sentinels: int) -> SpecialTokens:
    """Stand-in special tokens in the last rows of a vocabulary (only their count matters for a shape)."""
    names = [SEP, MASK, *(sentinel(k) for k in range(sentinels))]
    ids = {name: vocab - len(names) + k for k, name in enumerate(names)}
    return SpecialTokens(tokens={name: name for name in names}, ids=ids, added=True, ordinary_ids=())


def meta_shape(model: ModelConfig, vocab: int, sentinels: int = 16) -> torch.nn.Module:
    """The LoRA model a worker trains, with `model.random_init`'s shape and `vocab` rows, on the meta device. A model
    whose weights are read (no `random_init`) takes its shape from `configs/throughput.yaml` first
    (`Throughput.shape_of`): built from nothing it would be transformers' default Llama, a 7B."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from clozemath.model.load import aligned_vocabulary, apply_lora

    if model.random_init is None:
        raise ValueError(f"model '{model.name}' has no random_init: take its shape from Throughput.shape_of first")
    settings = {key: value for key, value in model.random_init.items() if key not in ("seed", "vocab_size")}
    config = LlamaConfig(vocab_size=aligned_vocabulary(vocab), **settings)
    with torch.device("meta"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
        return apply_lora(base, model.lora, special_tokens_for(vocab, sentinels))


def training_flops_per_token(model: torch.nn.Module, target_share: float, context: float) -> float:
    """FLOPs of one trained token, the convention of issue 24: every frozen matrix product 4x its weights (forward and
    the input's gradient), LoRA's own 6x (its weights' gradients too), the output layer at the target positions only
    (`target_share` of the tokens; 6x, or 4x when no token row trains and it needs no weight gradient), and attention
    12 x layers x (heads x head dim) x `context`, the mean number of positions a token attends to.

    The per-token form of `bench/limits.py`'s count (the benchmarks' MFU, exact per sample), for scaling a figure
    between models; `bench/` is no package of the library, so the two live apart: change them together."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    frozen = sum(p.numel() for name, p in base.named_parameters()
                 if ".layers." in name and p.dim() == 2 and not p.requires_grad)
    lora = sum(p.numel() for name, p in base.named_parameters() if "lora_" in name)
    rows_train = any("trainable_tokens" in name for name, _ in base.named_parameters())
    output = (6 if rows_train else 4) * config.vocab_size * config.hidden_size * target_share
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * context
    return 4 * frozen + 6 * lora + output + attention
