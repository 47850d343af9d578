"""The training baseline a researcher would pick instead of ours: TRL's `SFTTrainer` (trl 1.16.0), set up for speed
as TRL's documentation advises, on our samples, our model and our LoRA.

- **Padding-free packing**: `packing=True` with the `bfd` strategy (best-fit decreasing; TRL then collates
  padding-free: a step's packed sequences are flattened into one row with `position_ids` that restart at each sample
  and no attention mask), `max_length` tokens a packed sequence (TRL's default, 1,024), `per_device_train_batch_size`
  sequences a step (by default as many as make our packed step's real tokens).
- **Attention that keeps the samples apart in that row** without the flash-attn package (not installed on the GPU
  machine): transformers 5.x finds the samples' bounds in `position_ids` when no attention mask is given
  (`masking_utils.find_packed_sequence_indices`) and builds a block-diagonal causal mask for sdpa (dense, every
  pair of the row computed) or a BlockMask for flex_attention (block-sparse); both are correct (a CPU test checks
  sdpa's against the samples one by one). FlexAttention gets the tiles ours gets on the same card
  (`clozemath.model.attention.flex_kernel_options`): torch's own were measured ~28x slower there.
- **Kernels**: `use_liger_kernel=True` (liger's RMSNorm, SwiGLU and RoPE kernels; TRL 1.16 keeps its own fused LM
  head, which projects only the positions with a target label on a Triton device), `bf16=True`, no gradient
  checkpointing (memory for speed, as ours), fused AdamW (the Trainer's default), `torch_compile=True` as a mode of
  its own.
- **Completion-only loss on our targets**: the samples go in tokenized, with our `labels` (-100 outside the
  targets), which TRL keeps as they are.
- **The same LoRA**: the peft model our loader builds (rank, alpha, all linear layers, the trainable special-token
  rows) is handed to the trainer as it is. TRL's fused head reads the output layer's `weight` and `bias`; peft's
  wrapper of an output layer with trainable rows answers `weight` with the merged matrix (so the rows train through
  the output layer as in ours) but has no `bias`, which is given to it here (the wrapped layer's, None for Llama).

TRL has no PrefixLM attention: it is the baseline of ours in both attentions (PrefixLM ClozeMath and causal IT).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

TRL_VERSION = "1.16.0"
DEFAULT_MAX_LENGTH = 1024
"""TRL's own default `SFTConfig.max_length`: the tokens of a packed sequence."""


@dataclass(frozen=True)
class TrlSettings:
    attention: str
    """`flex_attention` or `sdpa` (the model's `attn_implementation`)."""
    compile: bool
    batch: int
    """`per_device_train_batch_size`: packed sequences a step."""
    max_length: int = DEFAULT_MAX_LENGTH
    on_gpu: bool = True
    """bf16, and TRL's fused LM head projects the target positions only (a Triton device); on CPU float32 and every
    position."""
    liger: bool = True
    gradient_checkpointing: bool = False
    flex_tiles: dict[str, Any] | None = None
    """FlexAttention `kernel_options` passed to every forward (None: torch's choice)."""

    def describe(self) -> str:
        parts = [
            f"TRL {TRL_VERSION} SFTTrainer", (f"packing bfd + padding_free, {self.batch} x {self.max_length}-token "
            "sequences a step"), self.attention + (" (our tiles)" if self.flex_tiles else ""),
            "liger" if self.liger else "no liger", "bf16" if self.on_gpu else "float32",
            "fused LM head at targets" if self.on_gpu else "fused LM head at every position (no Triton)",
        ]
        if self.compile:
            parts.append("torch_compile")
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing")
        return ", ".join(parts)


def sft_arguments(settings: TrlSettings, steps: int, output_dir: str) -> dict[str, Any]:
    """`SFTConfig`'s arguments (a GPU's cannot be built into one on a machine without a GPU)."""
    return {
        "output_dir": output_dir,
        "max_steps": steps,
        "per_device_train_batch_size": settings.batch,
        "gradient_accumulation_steps": 1,
        "packing": True,
        "packing_strategy": "bfd",
        "padding_free": True,
        "max_length": settings.max_length,
        "use_liger_kernel": settings.liger,
        "bf16": settings.on_gpu,
        "torch_compile": settings.compile,
        "gradient_checkpointing": settings.gradient_checkpointing,
        "learning_rate": 5e-5,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 1,
        "logging_steps": 10,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        "use_cpu": not settings.on_gpu,
    }


def sft_dataset(rows: Sequence[dict[str, Any]]) -> Any:
    """Our tokenized samples: `input_ids` and `labels` (-100 outside the targets: completion-only loss)."""
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in rows])


class CountingCollator:
    """The trainer's collator, noting each batch's real tokens (its packed sequences hold no padding) in the order the
    batches are made: the step timer takes them in the same order (a data loader may collate one batch ahead)."""

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, Any]]):
        self.collate = collate
        self.real_tokens: deque[int] = deque()

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        self.real_tokens.append(sum(len(example["input_ids"]) for example in examples))
        return self.collate(examples)


def step_timer(start: Callable[[], None], tick: Callable[[int], None], counter: CountingCollator) -> Any:
    """A `TrainerCallback`: the clock starts with training, and every optimizer step ends with the GPU synchronized
    and its real tokens reported."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            tick(counter.real_tokens.popleft())

    return StepTimer()


def _give_output_layer_a_bias(model: torch.nn.Module) -> None:
    """peft's `TrainableTokensWrapper` has no `bias`; TRL's fused LM head reads one (see the module docstring)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = causal_lm.get_output_embeddings()
    if not hasattr(output, "bias"):
        output.bias = getattr(output.original_module, "bias", None)


def _pass_flex_tiles(model: torch.nn.Module, tiles: dict[str, Any]) -> None:
    """Every forward gets `kernel_options=tiles` (transformers hands it down to `flex_attention_forward`)."""

    def with_tiles(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**kwargs, "kernel_options": tiles}

    model.register_forward_pre_hook(with_tiles, with_kwargs=True)


def build_trainer(
    model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], settings: TrlSettings, steps: int,
    output_dir: str, start: Callable[[], None], tick: Callable[[int], None],
) -> Any:
    """An `SFTTrainer` over `rows` for `steps` optimizer steps, timed through `start` and `tick`."""
    from trl import SFTConfig, SFTTrainer

    _give_output_layer_a_bias(model)
    if settings.flex_tiles is not None:
        _pass_flex_tiles(model, settings.flex_tiles)
    trainer = SFTTrainer(
        model=model, args=SFTConfig(**sft_arguments(settings, steps, output_dir)), train_dataset=sft_dataset(rows),
        processing_class=tokenizer,
    )
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    trainer.add_callback(step_timer(start, tick, counter))
    return trainer
