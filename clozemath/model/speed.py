"""Levers that speed a model loaded for inference up, applied once to the instance after its adapter is merged:
the same function of the same weights, fewer kernels a decoding step (issue 49: at 64 rows an H200's step spent 1.18
ms in 7 thin matrix products a layer and 1.28 ms in ~500 small element-wise kernels, against 0.51 ms for its weights).

- `fused_projections`: q, k and v as one matrix product, gate and up as one (their weights, and Qwen2's q/k/v biases,
  concatenated once). transformers' attention and MLP forwards are kept as they are: each of the modules they call
  (`self.q_proj(x)`, `self.k_proj(x)`, ...) becomes a part of one `FusedLinear`, whose first part called on an input
  computes every part's output and whose other parts take theirs from it (the same input tensor). So the levers
  hold whatever transformers version runs (5.17's `past_key_values`, 5.24's `cache`) and whatever calls those
  forwards: the prompt pass (causal or PrefixLM masks), the graph engine's step and its CUDA-graph capture, beam
  search and CoT-decoding alike.
- `liger_kernels`: liger-kernel's Triton RMSNorm, rotary embedding and SwiGLU (a GPU only). Into this instance only:
  liger's `apply_liger_kernel_to_llama/qwen2(model=...)` would also swap transformers' module-level classes and rotary
  function for every model built after it in the process (`bench/train_throughput.py` runs TRL last for that
  reason), so the norms and MLPs take liger's forwards through the per-instance helpers those functions use, and the
  attention modules run transformers' own forward code read with liger's rotary function in place of transformers'.

Only the Llama family (Llama, SmolLM2) and Qwen2 are changed; any other architecture (Gemma 3) is left as it is.
Which levers a model loaded for inference gets is decided here (`inference_levers`, read by `clozemath.model.load`):
the levers change the model's modules and weights once, after the merge (which needs q/k/v apart), not per decoding
call, and they are no setting of an experiment (the config and its grid key stay as they are; an evaluation
folder's source names them, so that no set's predictions mix two: `clozemath.eval.folder`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clozemath.errors import ClozeMathError

FAMILIES = ("llama", "qwen2")
"""`config.model_type` of the models the levers change (their attention, MLP and norms have the same layout)."""


@dataclass(frozen=True)
class SpeedLevers:
    fused_projections: bool = False
    liger_kernels: bool = False

    def describe(self) -> str:
        parts = [name for name, on in (("fused q/k/v and gate/up", self.fused_projections),
                                      ("liger RMSNorm, RoPE, SwiGLU", self.liger_kernels)) if on]
        return " + ".join(parts) or "plain"


INFERENCE_LEVERS = SpeedLevers(fused_projections=False, liger_kernels=True)
"""What a model loaded for inference gets, where it can run (`inference_levers`). Measured on one H200
(`bench/results/levers_vllm_h200_2026-12-02/`): liger's kernels decode 1.11-1.44x faster (greedy 1.25-1.44x, beam-5
1.11-1.16x, CoT 1.23-1.24x; Llama-3.2-1B's shape and Qwen2.5-Coder-1.5B); the fused products gain 0-10% at 64 rows,
nothing at 512 and lose 4% on Qwen there, and with liger they add nothing: off."""
PLAIN = SpeedLevers()
"""transformers' modules as they are (a merged model exported as a Hugging Face folder)."""


def inference_levers(device: torch.device) -> SpeedLevers:
    """`INFERENCE_LEVERS` less what cannot run on `device`: liger's kernels need a CUDA device and liger-kernel (the
    `gpu` extra). A CPU, or a GPU without liger-kernel, decodes with transformers' modules: the same tokens in
    float32 (`tests/test_decode_gpu.py -k levers`), bf16's rounding apart."""
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        return INFERENCE_LEVERS
    return dataclasses.replace(INFERENCE_LEVERS, liger_kernels=False)


def apply_levers(model: nn.Module, levers: SpeedLevers | None = None) -> nn.Module:
    """`model` (a causal LM in eval mode, its adapter merged) with `levers` applied in place; the same model. None:
    what a model loaded for inference gets on the model's device (`inference_levers`); levers asked for by name are
    refused in one line where they cannot run."""
    if levers is None:
        levers = inference_levers(next(model.parameters()).device)
    if not (levers.fused_projections or levers.liger_kernels) or _family(model) is None:
        return model
    liger = _liger(model) if levers.liger_kernels else None  # refused before anything is changed
    for layer in _decoder(model).layers:
        if levers.fused_projections:
            fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
            fuse(layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")
        if liger is not None:
            liger.layer(layer)
    if liger is not None:
        liger.norm(_decoder(model).norm)
    return model


def _family(model: nn.Module) -> str | None:
    model_type = getattr(model.config, "model_type", None)
    return model_type if model_type in FAMILIES else None


def _decoder(model: nn.Module) -> Any:
    return getattr(model, model.base_model_prefix, model)


# --------------------------------------------------------------------------------------------------------------
# Fused projections


class FusedLinear(nn.Module):
    """Linear maps of one input as one matrix product: their weights (and biases: zeros for a map without) stacked
    once. `part(i)` stands for the i-th map: the first part called on an input computes every part's output, a part
    called on the input the outputs were computed from takes its own (a view of the product), and the last part's
    call lets them go. A part called on another input (or out of order) computes the product again: never a stale
    output, only a slower one."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.weight = nn.Parameter(weight, requires_grad=False)
        if any(linear.bias is not None for linear in linears):
            biases = [linear.bias.detach() if linear.bias is not None else weight.new_zeros(linear.out_features)
                      for linear in linears]
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
        else:
            self.bias = None
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:
            self._outputs = nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
            self._input = x
        out = self._outputs[index]
        if index == len(self.sizes) - 1:
            self._input, self._outputs = None, ()
        return out

    def part(self, index: int) -> FusedPart:
        return FusedPart(self, index)


class FusedPart(nn.Module):
    """The `index`-th map of a `FusedLinear`, where the module it replaces was. The fused module is held outside
    the module tree (its parameters are registered once, where `fuse` puts it)."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self._fused = (fused,)
        self.index = index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].output(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused product, out_features={self.out_features}"


def fuse(module: nn.Module, names: Sequence[str], into: str) -> FusedLinear:
    """`module`'s linear maps `names` (of one input, called in this order by its forward) made one product: a
    `FusedLinear` registered as `into` (Phi-3's names: `qkv_proj`, `gate_up_proj`), each name a part of it."""
    fused = FusedLinear([getattr(module, name) for name in names])
    module.add_module(into, fused)
    for index, name in enumerate(names):
        setattr(module, name, fused.part(index))
    return fused


# --------------------------------------------------------------------------------------------------------------
# liger-kernel's kernels


@dataclass(frozen=True)
class _Liger:
    """liger-kernel's per-instance swaps, as its `apply_liger_kernel_to_llama/qwen2(model=...)` makes them."""

    patch_norm: Callable[[nn.Module], None]
    patch_mlp: Callable[[nn.Module], None]
    rotary: Callable[..., Any]

    def layer(self, layer: nn.Module) -> None:
        self.patch_norm(layer.input_layernorm)
        self.patch_norm(layer.post_attention_layernorm)
        self.patch_mlp(layer.mlp)
        attention = layer.self_attn
        attention.forward = types.MethodType(with_globals(type(attention).forward, apply_rotary_pos_emb=self.rotary),
                                             attention)

    def norm(self, norm: nn.Module) -> None:
        self.patch_norm(norm)


def _liger(model: nn.Module) -> _Liger:
    """liger-kernel's swaps, or a one-line refusal where they cannot run (no GPU, no liger-kernel)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ClozeMathError(
            f"liger kernels need a GPU (liger-kernel's kernels are Triton's); the model is on {device}")
    try:
        from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except ImportError as exc:
        raise ClozeMathError(f"liger kernels need liger-kernel==0.8.5 ({exc}): pip install 'clozemath[gpu]'") from None
    return _Liger(_patch_rms_norm_module, lambda mlp: _patch_swiglu_module(mlp, LigerSwiGLUMLP), liger_rotary_pos_emb)


def with_globals(method: Callable[..., Any], **names: Any) -> Callable[..., Any]:
    """A copy of `method`'s own function (under its decorators: transformers' `deprecate_kwarg`, which only renames
    an argument its callers no longer pass) that reads `names` where the original reads its module's globals of those
    names; the module and the original are left as they are."""
    function = inspect.unwrap(method)
    copied = types.FunctionType(function.__code__, {**function.__globals__, **names}, function.__name__,
                                function.__defaults__, function.__closure__)
    copied.__kwdefaults__ = function.__kwdefaults__
    return copied
