"""What makes a training run repeat itself: the seed in every random draw, and torch's deterministic kernels.

The seed (`train.seed`) decides, whatever `train.deterministic` says:
- LoRA's initialisation (`clozemath.model.load.apply_lora`, drawn from the seed alone);
- the data order: a seeded permutation per epoch and rank (`clozemath.train.batches.micro_batch_rows`), over rows
  that reach each worker in a fixed order (the cache holds them in an order their contents decide,
  `ray_jobs.preprocess.canonical_order`; the workers' streaming split keeps its blocks' order, `preserve_order`);
- dropout and MFT's noise: drawn after `torch.manual_seed(step_seed(seed, step, rank))`, every step;
- the samples themselves (group members masked, random spans, balancing copies): `data.seed`, by default the seed.

Python's and NumPy's generators are seeded too, for whatever a library draws from them.

`train.deterministic: true` adds the switches of PyTorch's reproducibility notes: `torch.use_deterministic_algorithms`
(which also stops Inductor from autotuning on timings), cuDNN without benchmarking, and cuBLAS with a fixed workspace
(`CUBLAS_WORKSPACE_CONFIG`). An operation with no deterministic implementation warns, naming itself, instead of
failing the run (`warn_only`). With them, two uncompiled runs on sdpa still parted on a GPU, as much as two runs without
them, and no operation was named; two runs on eager attention, or compiled (FlexAttention), repeated bit for bit even
without them. So on a GPU a deterministic packed run compiles under `train.compile: auto`, and attends with eager
attention where it is told not to compile (`clozemath.train.layout`). On a CPU the same config, data, software and
machine give the same adapter bit for bit (tests/test_determinism.py); on a GPU, `bench/reproducibility.py` measures it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's deterministic workspace setting (CUDA >= 10.2; `:16:8` is the other, smaller one). It must be set before
the process's first cuBLAS call: the Train worker sets it first thing."""


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global generators (every device's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def use_deterministic_kernels() -> None:
    """For the rest of this process: torch's deterministic algorithms (an operation without one warns), cuDNN
    deterministic and not benchmarking, cuBLAS's fixed workspace."""
    if os.environ.get(CUBLAS_WORKSPACE_ENV) not in (CUBLAS_WORKSPACE, ":16:8"):
        os.environ[CUBLAS_WORKSPACE_ENV] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextmanager
def deterministic_kernels(on: bool) -> Iterator[None]:
    """`use_deterministic_kernels` within (when `on`; else nothing changes), the process's settings restored on the
    way out."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, os.environ.get(CUBLAS_WORKSPACE_ENV))
    use_deterministic_kernels()
    try:
        yield
    finally:
        enabled, warn_only, cudnn_deterministic, cudnn_benchmark, workspace = before
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE_ENV, None)
        else:
            os.environ[CUBLAS_WORKSPACE_ENV] = workspace
