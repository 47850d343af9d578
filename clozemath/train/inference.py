"""A model in training decoding for a while (the evaluations during training, `clozemath.eval.during_training`), then
given back to training as it was: every weight to the bit, the trained tensors themselves (what the optimizer and
DeepSpeed hold), train mode, training's attention and its compiled layers.

How depends on the engine that decodes (`clozemath.eval.during_training.during_training_engine`):
- the static engines ("graphs" on a CUDA worker under ZeRO-2): a step replayed as a CUDA graph may only launch work
  on the device, and should launch only what decoding needs. The trainable special-token rows are merged into their
  matrices for the while (`token_rows_merged`): training writes them over a copy of each whole matrix at every
  forward (`clozemath.model.load.merged_token_rows`), at Qwen2.5-1.5B's shape two matrices of 467 MB copied at every
  decoding step. LoRA stays unmerged (its forward is plain tensor work, and merging it would round the frozen
  weights). The compiled decoder layers are set aside (`decoder_layers_uncompiled`): decoding's shapes change every
  call, and each would compile anew; FlexAttention's decoding kernel compiles as it does for any model.
- the eager engine (ZeRO-3, whose every forward gathers the parameters from all ranks; a CPU): all compiled code runs
  eagerly (ZeRO-3's compiled layers have their `forward` replaced, which cannot be set aside).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

from clozemath.train.compilation import decoder_layers_uncompiled


@contextmanager
def decoding_in_training(model: torch.nn.Module, engine: str) -> Iterator[None]:
    """`model`, in training, ready to decode with `engine` for the block (see the module): eval mode (no dropout) and
    sdpa attention (decoding's dense PrefixLM prompt masks) either way; train mode, training's attention, compiled
    layers and merged rows restored after, whatever the block raised."""
    with ExitStack() as restore:
        restore.callback(model.train, model.training)
        restore.callback(model.set_attn_implementation, model.config._attn_implementation)
        model.eval()
        model.set_attn_implementation("sdpa")
        if engine == "eager":
            restore.enter_context(torch.compiler.set_stance("force_eager"))
        else:
            restore.enter_context(decoder_layers_uncompiled(model))
            restore.enter_context(token_rows_merged(model))
        yield


@contextmanager
def token_rows_merged(model: torch.nn.Module) -> Iterator[None]:
    """peft's trainable special-token rows written into the matrices they belong to for the block (peft's `merge`),
    so that the embedding and the output layer are plain layers; the frozen rows written back after (`unmerge`).

    Exact (peft 0.21, `TrainableTokensLayer`): `merge` makes the parameter's data a new matrix, the frozen one with
    the trained rows copied over its rows (`index_copy`); `unmerge` copies over them, in place, the rows the layer
    kept of the frozen matrix when it was made (`trainable_tokens_original`, never trained). The parameters stay the
    same objects, and the trained rows are only read. An output layer tied to the embedding has a layer of its own
    over the same matrix: both merge, and both unmerge."""
    merged: list[TrainableTokensLayer] = []
    try:
        with torch.no_grad():  # the merged matrix is no function of the trained rows for autograd
            for layer in (module for module in model.modules() if isinstance(module, TrainableTokensLayer)):
                layer.merge()
                merged.append(layer)
        yield
    finally:
        with torch.no_grad():
            for layer in reversed(merged):
                layer.unmerge()
