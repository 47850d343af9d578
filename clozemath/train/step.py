"""One optimizer step: the forward (the loss on target positions only), the backward and the optimizer, on a
DeepSpeed engine built here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from clozemath.config import TrainConfig
from clozemath.data.tokenize import IGNORE_INDEX
from clozemath.errors import ClozeMathError
from clozemath.train.compilation import decoder_layers
from clozemath.train.zero import deepspeed_config, vocabulary_elements

LIGER_CHUNK_MEM = 64
"""liger-kernel's `chunk_mem_const`: its chunks of target tokens may hold this many times their hidden states in
logits. At its default (1) a chunk of the 1B shape is ~64 tokens, so the output matrix's gradient (the whole
vocabulary: the trainable special-token rows make it need one) is read and written once per 64 tokens. At 64 the loss
and its backward, and the step, are much faster for a little more peak memory
(`bench/results/train_throughput_loss_chunks_h200.md`)."""


class TargetLoss(torch.nn.Module):
    """The causal-LM loss with the output layer applied to target positions only.

    A causal LM's forward projects every position onto the vocabulary and the loss then ignores the prefix's.
    PrefixLM samples are mostly prefix (ClozeMath's GSM8K samples: 66% of their tokens), and with a 128k vocabulary
    that projection, its float32 upcast and its backward are a large share of a step's work and memory. Here the
    decoder's hidden states are gathered at the positions whose next token is a target first. The loss is the same
    mean cross-entropy over target tokens that `model(..., labels=...)` returns.
    """

    def __init__(self, model: torch.nn.Module, fused: bool = False):
        super().__init__()
        self.model = model
        self.fused = fused
        """liger-kernel's fused linear + cross-entropy (Triton, GPU only): the logits are made and dropped chunk by
        chunk, never all at once in float32."""

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None, **masks: Any
    ) -> torch.Tensor:
        """`positions`: `target_positions(labels)`, computed by the caller on the host (else here, on the device,
        where finding them waits for the GPU to finish the forward)."""
        causal_lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = causal_lm.get_decoder()(input_ids=input_ids, use_cache=False, **masks).last_hidden_state
        positions = target_positions(labels) if positions is None else positions
        predicted = hidden.flatten(0, 1).index_select(0, positions)
        wanted = labels.flatten().index_select(0, positions + 1)
        output = causal_lm.get_output_embeddings()
        if self.fused:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            return liger_fused_linear_cross_entropy(predicted, output_matrix(output), wanted,
                                                    bias=getattr(output, "bias", None),
                                                    chunk_mem_const=LIGER_CHUNK_MEM)
        return torch.nn.functional.cross_entropy(output(predicted).float(), wanted)


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices (into [batch * seq]) of the positions whose next token is a target, in row order."""
    predicts = torch.zeros_like(labels, dtype=torch.bool)
    predicts[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return predicts.flatten().nonzero().squeeze(1)


def output_matrix(output: torch.nn.Module) -> torch.Tensor:
    """The output layer's matrix as the layer applies it: peft's trainable special-token rows (an output layer tied to
    the embedding) written over the frozen ones."""
    tokens = getattr(output, "token_adapter", None)
    if tokens is None or tokens.merged or tokens.disable_adapters or not tokens.active_adapters:
        return output.weight
    return tokens.get_merged_weights(tokens.active_adapters)


def use_fused_loss(train: TrainConfig, device: torch.device) -> bool:
    """`train.fused_loss`; auto: on a GPU when liger-kernel is installed."""
    if train.fused_loss is False:
        return False
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        if train.fused_loss is True:
            raise ClozeMathError("train.fused_loss=true needs liger-kernel: pip install 'clozemath[gpu]'") from None
        return False
    if train.fused_loss is True and device.type != "cuda":
        raise ClozeMathError("train.fused_loss=true needs a GPU (liger-kernel's kernels are Triton's)")
    return device.type == "cuda"


def build_engine(model: torch.nn.Module, train: TrainConfig, total_steps: int, warmup_steps: int) -> Any:
    """AdamW (only the trainable parameters) and a cosine schedule with linear warmup, on a DeepSpeed engine whose
    module is the model's `TargetLoss` (so `engine.module.model` is the model)."""
    import deepspeed
    from transformers import get_cosine_schedule_with_warmup

    trainable = [p for p in model.parameters() if p.requires_grad]
    device = trainable[0].device
    # fused AdamW: one kernel for the whole update instead of one per tensor
    optimizer = torch.optim.AdamW(
        trainable, lr=train.lr, weight_decay=train.weight_decay, fused=device.type == "cuda"
    )
    engine, _, _, _ = deepspeed.initialize(
        model=TargetLoss(model, fused=use_fused_loss(train, device)),
        optimizer=optimizer,
        lr_scheduler=lambda opt: get_cosine_schedule_with_warmup(opt, warmup_steps, total_steps),
        config=deepspeed_config(train, bf16=next(model.parameters()).dtype == torch.bfloat16,
                                layer=decoder_layers(model)[0], vocabulary=vocabulary_elements(model)),
    )
    _leave_tied_frozen_weights_out(engine)
    if train.zero_stage == 3:
        _register_weights_read_outside_their_modules(engine)
    return engine


def _register_weights_read_outside_their_modules(engine: Any) -> None:
    """ZeRO-3 gathers a module's parameters as its forward starts. peft's trainable-token layers read their base
    layer's weight and their own token rows without calling the modules that hold them; inside the engine's forward
    DeepSpeed finds such reads itself, outside it (decoding during training) it does not, and the layer would read an
    empty shard. Registered as the layer's external parameters, they are gathered with it wherever it runs."""
    import deepspeed
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    for module in engine.module.modules():
        if isinstance(module, TrainableTokensLayer):
            for parameter in (module.base_layer.weight, *module.trainable_tokens_delta.parameters()):
                deepspeed.zero.register_external_parameter(module, parameter)


def _leave_tied_frozen_weights_out(engine: Any) -> None:
    """Make `exclude_frozen_parameters` leave out every frozen weight.

    DeepSpeed finds the frozen weights through `named_parameters()`, which names a tied weight once: the output
    matrix tied to the embedding (SmolLM2, Llama 3.2 1B/3B) stays in every checkpoint, a whole vocabulary's worth.
    """
    frozen = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    module_state_dict = engine.module_state_dict

    def state_dict(*args: Any, exclude_frozen_parameters: bool = False, **kwargs: Any) -> dict[str, Any]:
        state = module_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name in frozen & state.keys():
                del state[name]
        return state

    engine.module_state_dict = state_dict


@dataclass
class StepTally:
    """One step's sums; the loss stays on the device (reading it would wait for the GPU every micro-batch)."""

    loss: torch.Tensor | float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    positions: int = 0

    def add(self, loss: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.loss = self.loss + loss.detach().float()
        self.micro_batches += 1
        self.tokens += int((attention_mask > 0).sum())
        self.positions += attention_mask.numel()


def accumulate(
    engine: Any,
    micro_batches: Iterable[Mapping[str, torch.Tensor]],
    device: torch.device,
    forward_inputs: Callable[[Mapping[str, torch.Tensor]], dict[str, Any]],
) -> StepTally:
    """One optimizer step: forward, loss and backward for each micro-batch (host tensors, moved to `device`), the
    optimizer stepping at the accumulation boundary (DeepSpeed's `train.grad_accum`). `forward_inputs`: the model's
    arguments from a micro-batch on the device (`clozemath.train.batches.model_inputs`)."""
    tally = StepTally()
    for batch in micro_batches:
        inputs = forward_inputs({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        targets_at = target_positions(batch["labels"]).to(device, non_blocking=True)
        loss = engine(**inputs, positions=targets_at)
        engine.backward(loss)
        engine.step()
        tally.add(loss, batch["attention_mask"])
    return tally
