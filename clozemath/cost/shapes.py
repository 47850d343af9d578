"""A model's shape as training builds it, on PyTorch's meta device (nothing allocated, no weights read), and the
training FLOPs of one of its tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from clozemath.config import ModelConfig
from clozemath.data.tokenize import MASK, SEP, SpecialTokens, sentinel
from clozemath.train.flops import TrainingShape, training_flops


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
    """FLOPs of one trained token (`clozemath.train.flops`' convention, the per-token form of its per-sample count):
    the output layer at `target_share` of the tokens, attention over `context` positions, the mean a token attends
    to. For scaling a throughput figure between models."""
    return training_flops(TrainingShape.of(model), tokens=1, projected=target_share, pairs=context)
