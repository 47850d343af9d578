"""What a benchmark's profile says: the share of the wall time the GPU ran kernels, the costliest GPU operations and
where the host's time went (torch.profiler). Shared by `train_throughput.py` (a few training steps) and
`eval_throughput.py` (one decoding pass)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    return kinds


def kernel_ms(events: Iterable[Any]) -> float:
    """Milliseconds the GPU ran kernels, from a profile's averaged events: their device-side self time, leaving out
    the `ProfilerStep*` annotations, which also carry a device time (each step's whole span; counting them put the
    GPU at over 100% busy in the 2026-11-28 H100 profiles)."""
    return sum(event.self_device_time_total for event in events
               if event.device_type == torch.autograd.DeviceType.CUDA
               and not event.key.startswith("ProfilerStep")) / 1000


def profile_summary(prof: torch.profiler.profile, wall_ms: float, device: torch.device, spans: int = 1,
                    span: str = "step") -> str:
    """The costliest operations, and the share of a `span`'s wall time (`wall_ms`, the mean of the `spans`
    profiled) during which the GPU ran kernels."""
    averages = prof.key_averages()
    if device.type != "cuda":
        return averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    busy_ms = kernel_ms(averages) / spans
    head = f"GPU busy {busy_ms:.1f} ms of a {wall_ms:.1f} ms {span} ({busy_ms / wall_ms:.0%})\n"
    gpu = averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
    host = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    return f"{head}{gpu}\nThe host's side (where its CPU time goes):\n{host}"
