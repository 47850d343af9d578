"""DeepSpeed's ZeRO for LoRA: which stage a run takes (`train.zero_stage: auto`) and the engine's ZeRO settings.

LoRA trains a few million parameters beside a frozen model of billions. ZeRO-2 keeps the whole frozen model on every
card and partitions only the (small) gradients and optimizer states; ZeRO-3 also partitions the frozen weights, so
that a model too large for one card trains at all, but then every decoder layer's weights are gathered from all the
cards before the layer runs, forward and backward, in every micro-step. Where the frozen model and a packed row fit
one card, that gathering buys nothing: `auto` takes ZeRO-2 there and ZeRO-3 only beyond.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from clozemath.config import ExperimentConfig, TrainConfig
from clozemath.train.packing import MIN_PACK_TOKENS, activation_bytes_per_token

OPTIMIZER_BYTES_PER_TRAINED = 16
"""A trained parameter's bytes on the card under mixed precision: its bf16 weight and gradient, and AdamW's fp32
master copy, first and second moments (DeepSpeed's bf16 optimizer)."""
FIT_SHARE = 0.9
"""The share of a card's memory a plan may fill: the rest is CUDA's context, the allocator's fragmentation, the
collectives' buffers."""


@dataclass(frozen=True)
class TrainingMemory:
    """What one worker holds under ZeRO-2 (the worst case: nothing partitioned but the optimizer)."""

    frozen_bytes: int
    """The frozen model's weights."""
    trained_params: int
    """LoRA and the trainable special-token rows."""
    row_bytes: int
    """The activations one micro-batch keeps for the backward pass."""

    @property
    def total(self) -> int:
        return self.frozen_bytes + self.trained_params * OPTIMIZER_BYTES_PER_TRAINED + self.row_bytes

    @property
    def loaded_bytes(self) -> int:
        """What the loaded model holds before the engine starts: the frozen weights and the trained ones in fp32."""
        return self.frozen_bytes + 4 * self.trained_params


def planned_row_tokens(train: TrainConfig, max_length: int) -> int:
    """The tokens of the smallest micro-batch the run may take: `pack_tokens`, or for `auto` the smallest row it
    sizes (it shrinks a row to what the card holds, down to `MIN_PACK_TOKENS`); unpacked, `micro_batch_size` rows
    of `data.max_length`."""
    if train.pack_tokens is None:
        return train.micro_batch_size * max_length
    if train.pack_tokens == "auto":
        return max(MIN_PACK_TOKENS, max_length)
    return train.pack_tokens


def auto_zero_stage(memory: TrainingMemory, card_bytes: int | None, workers: int) -> int:
    """ZeRO-2 where the frozen model, the optimizer's state and a row fit `FIT_SHARE` of one card (or the card is
    unknown: a CPU run); ZeRO-3 beyond, when there are several workers to partition the weights across (one alone
    has nothing to gain)."""
    if card_bytes is None or workers < 2:
        return 2
    return 2 if memory.total <= FIT_SHARE * card_bytes else 3


def model_memory(model: torch.nn.Module, row_tokens: int) -> TrainingMemory:
    """`TrainingMemory` of a loaded model (peft-wrapped: its trainable parameters chosen), with rows of
    `row_tokens` tokens."""
    unique = {id(p): p for p in model.parameters()}.values()  # a tied matrix once
    frozen = sum(p.numel() * p.element_size() for p in unique if not p.requires_grad)
    trained = sum(p.numel() for p in unique if p.requires_grad)
    return TrainingMemory(frozen, trained, int(row_tokens * activation_bytes_per_token(model.config)))


def with_zero_stage(config: ExperimentConfig, stage: int, device: torch.device) -> ExperimentConfig:
    """The config with ZeRO `stage`, this rank's choice (`clozemath.train.layout.resolved_zero_stage`): under
    `train.zero_stage: auto` every rank takes the highest any rank chose, so that all run one stage."""
    if config.train.zero_stage == "auto" and dist.is_initialized() and dist.get_world_size() > 1:
        chosen = torch.tensor([stage], device=device)
        dist.all_reduce(chosen, op=dist.ReduceOp.MAX)
        stage = int(chosen.item())
    return config.model_copy(update={"train": config.train.model_copy(update={"zero_stage": stage})})


def card_bytes(device: torch.device, share: float) -> int | None:
    """This process's share of its card's memory; None on the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory * share)


def deepspeed_config(train: TrainConfig, bf16: bool, layer: torch.nn.Module | None = None,
                     vocabulary: int = 0) -> dict[str, Any]:
    """The engine's config. `layer`: one decoder layer, `vocabulary`: `vocabulary_elements` of the model (ZeRO-3's
    settings are sized to them).

    `check_grad_overflow` off: bf16 needs no loss scaling, and the check costs two reductions (and kernel launches)
    per LoRA tensor every step; a non-finite gradient still shows in the logged loss.

    No `contiguous_gradients`: its gradient hook would copy each of LoRA's hundreds of small gradients into a bucket
    as it comes (a copy, a kernel launch and Python per tensor); left apart, the bucket is flattened once when it is
    reduced. That buffer exists to keep a large model's gradients from fragmenting memory, and LoRA's are a few MB."""
    if train.zero_stage == "auto":
        raise ValueError("train.zero_stage 'auto' must be resolved first (layout.resolved_zero_stage)")
    zero: dict[str, Any] = {"stage": train.zero_stage, "contiguous_gradients": False}
    if train.zero_stage == 3:
        if layer is None:
            raise ValueError("ZeRO-3's settings need a decoder layer")
        zero |= zero3_settings(layer, vocabulary)
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16, "check_grad_overflow": False},
        "steps_per_print": 1 << 30,
    }


def vocabulary_elements(model: torch.nn.Module) -> int:
    """Elements of the embedding and the output layer (a tied matrix once, with peft's trainable token rows): what the
    fused loss holds gathered through a whole forward under ZeRO-3 (`zero3_settings`)."""
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    return sum({id(p): p.numel() for module in modules for p in module.parameters()}.values())


def zero3_settings(layer: torch.nn.Module, vocabulary: int) -> dict[str, Any]:
    """ZeRO-3 (DeepSpeed 0.19's `zero_optimization` keys) gathering a whole decoder layer at a time, and the next
    while this one computes.

    - The decoder layer is a *leaf module*: DeepSpeed installs its gather and release hooks on the layer alone, not on
      each of the ~30 modules LoRA puts inside it (the base projection, `lora_A`, `lora_B`, dropout, for each of 7
      projections), and fetches the layer's weights in one bucketed all-gather instead of one per projection. Those
      per-module hooks (Python, forward and backward, every micro-step) and tiny all-gathers are what made ZeRO-3
      host-bound on a small model.
    - A prefetch bucket of two layers' weights (the default, 5e7 elements, is less than one layer of an 8B model:
      218M), to fetch the next layer while this one computes. Prefetching needs room among the live parameters: the
      fused loss reads the output matrix outside its module, so DeepSpeed holds it (and the embedding) for the whole
      forward; `stage3_max_live_parameters` counts `vocabulary` on top of three layers (at least DeepSpeed's 1e9).
    - Nothing persistent (`stage3_param_persistence_threshold` 0): DeepSpeed releases persistent tensors after each
      optimizer step and gathers them again one collective a tensor (`stage3.py` `_post_step`), LoRA's matrices, the
      norms and the token rows: 576 all-gathers a step on the 8B shape. Partitioned, they travel inside their
      layer's one gather: 62 a step.
    - `memory_efficient_linear` off: DeepSpeed's default replaces `torch.nn.functional.linear` with a wrapper whose
      backward looks up each weight's `ds_id`; a compiled layer guards on those ids and compiled again for every
      layer, up to Dynamo's limit (8 of 32 layers compiled).

    Measured on the 8B shape, compiled, 2 x H200, one process a GPU (`bench/zero3_profile.py`,
    bench/results/zero3_trl_h200_2026-11-28): 12,546 tokens/s a GPU against ZeRO-2's 16,393 (77%); with
    the trained tensors persistent and no room to prefetch, 10,646 (65%).
    """
    layer_params = sum(p.numel() for p in layer.parameters())
    kind = type(layer)
    return {
        "leaf_module": {"classes": [f"{kind.__module__}.{kind.__qualname__}"]},
        "stage3_prefetch_bucket_size": 2 * layer_params,
        "stage3_max_live_parameters": max(10**9, 3 * layer_params) + vocabulary,
        "stage3_param_persistence_threshold": 0,
        "memory_efficient_linear": False,
    }
