"""Compiling the decoder layers (and setting them aside for a model that decodes), and the compile cache that later
processes read."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from clozemath import console
from clozemath.config import ExperimentConfig


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal_lm.get_decoder().layers


COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
"""Where compiled code is kept (torch 2.11-2.13, read from the environment when a compilation looks it up): every
modular cache of torch.compile (Inductor's FX graphs and the Triton kernels it generates, AOTAutograd's joint graphs,
autotuning results; on by default) under `TORCHINDUCTOR_CACHE_DIR` (PyTorch's "Compile Time Caching" recipe), and the
binaries of Triton kernels that Triton compiles itself (liger-kernel's fused loss) under `TRITON_CACHE_DIR`. Both write
by atomic rename, so concurrent trials can share a folder; their keys hold the torch and Triton versions and the card,
so another machine misses rather than loads a wrong kernel. (`torch.compiler.save_cache_artifacts` packs the same
caches into bytes, for a store that is not a shared folder.)"""


def use_compile_cache(folder: Path) -> None:
    """Keep this process's compilations in `folder` (created), to be found by every later process pointed there:
    the trials after the first of a grid, on any node that sees the folder, compile from the cache."""
    folder.mkdir(parents=True, exist_ok=True)
    for variable, sub in COMPILE_CACHE_ENV.items():
        os.environ[variable] = str(folder / sub)


COMPILED_MARKS = "compiled"
"""Under a compile cache folder: a file per compiled training shape whose first step has run there (`mark_compiled`)."""


def compiled_shape_key(config: ExperimentConfig, row_tokens: int, device: torch.device) -> str:
    """What a compiled training step's code depends on: the model's shape (name, dtype, LoRA, attention), the row, the
    ZeRO stage, the method's attention and loss, the card and torch; not its weights' location or the data."""
    model = config.model
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    shape = {
        "model": [model.name, model.dtype, model.attn_implementation, model.lora.model_dump(mode="json"),
                  model.random_init],
        "row_tokens": row_tokens, "zero_stage": config.train.zero_stage, "fused_loss": config.train.fused_loss,
        "attention": config.method.attention, "card": card, "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def compiled_before(folder: Path, key: str) -> bool:
    """Whether a compiled run of this shape got past its first step with `folder` as its compile cache (a mark that
    cannot be read counts as none: the run decides as on a cold cache)."""
    return (folder / COMPILED_MARKS / key).is_file()


def mark_compiled(folder: Path, key: str) -> None:
    """Record that the compile cache in `folder` now holds this shape's compiled step (for `compile: auto`). A mark
    that cannot be written (something else in its place, a read-only or full disk) costs later runs only the choice
    of compiling: a warning naming it, never the run."""
    marks = folder / COMPILED_MARKS
    try:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / key).touch()
    except OSError as exc:
        console.warn(f"{marks / key}: the compile cache's mark cannot be written ({exc.strerror}); later runs of this "
                     f"shape decide to compile as on a cold cache (remove {marks} if it is not a folder)")


def compile_decoder_layers(model: torch.nn.Module, zero_stage: int) -> None:
    """Regional compilation: each decoder layer (with its LoRA adapters) compiled in place, fixed shapes. The layers
    share one compiled graph (their weights are its inputs), so compiling costs about one layer's time; the
    embedding and the loss stay eager (the loss's shape follows the number of target tokens).

    Under ZeRO-3 only each layer's `forward` is compiled. DeepSpeed gathers and releases a layer's weights in hooks
    on the module, and a compiled module call traces them: their guards hold each layer's own ids, so every layer
    compiled again until Dynamo's recompile limit (8), and the rest ran eagerly (2 x H200, the 8B shape:
    bench/results/scaling_8b_h200_2026-11-28). Outside the compiled code the hooks run eagerly around the one graph.
    That takes DeepSpeed's plain linear too (`clozemath.train.zero.zero3_settings`): its memory-efficient one looks up
    each weight's `ds_id` inside the layer, the same per-layer guard."""
    for layer in decoder_layers(model):
        if zero_stage == 3:
            layer.forward = torch.compile(layer.forward, dynamic=False)
        else:
            layer.compile(dynamic=False)


def uncompile_decoder_layers(model: torch.nn.Module) -> None:
    """Undo `compile_decoder_layers` outside ZeRO-3 for good (a model done training, decoded from then on, whose
    shapes change every call): `Module.compile` only sets `_compiled_call_impl`, which torch 2.x has no public call to
    clear."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None


@contextmanager
def decoder_layers_uncompiled(model: torch.nn.Module) -> Iterator[None]:
    """`compile_decoder_layers` outside ZeRO-3 set aside for the block (a model in training that decodes for a while,
    `clozemath.train.inference`), the same compiled layers back after: their compiled code, guards and cache are never
    touched, so training goes on without compiling again."""
    layers = decoder_layers(model)
    compiled = [layer._compiled_call_impl for layer in layers]
    uncompile_decoder_layers(model)
    try:
        yield
    finally:
        for layer, call in zip(layers, compiled, strict=True):
            layer._compiled_call_impl = call
