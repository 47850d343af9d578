"""The GPU memory a process plans with: the whole card, or its share when several trials share one
(`train.gpu_share`: Ray gives each worker and evaluation actor that fraction of a GPU).

The share is PyTorch's per-process memory fraction, so the allocator itself refuses to go beyond it; the
memory-sized defaults (packed rows, decoding batches) read it back from there (torch >= 2.6)."""

from __future__ import annotations

import torch


def share_gpu(share: float) -> None:
    """Keep this process within `share` of its GPU's memory (nothing to do for a whole card or on CPU)."""
    if share < 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(share)


def usable_bytes(device: torch.device) -> int:
    """This process's share of the card less what it has allocated: a plan that does not depend on what other
    processes hold at the moment (a restarted run plans the same)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    share = torch.cuda.get_per_process_memory_fraction(index)
    return int(share * total) - torch.cuda.memory_allocated(device)


def free_bytes(device: torch.device) -> int:
    """What this process can allocate now: the card's free memory plus what PyTorch's allocator holds unused,
    within the process's share."""
    free, _ = torch.cuda.mem_get_info(device)
    reclaimable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return min(free + reclaimable, usable_bytes(device))
