"""Small host values (indices, per-row parameters) onto the step's device without waiting for it.

`torch.tensor(values, device=cuda)` copies from pageable memory, which makes the host wait until
every kernel queued on the stream has run: with a step launched ahead of the host, that is the
whole forward the overlap exists to hide. `to_device` stages the values in pinned memory and
queues the copy behind the stream's work instead (torch's pinned-memory cache keeps the staging
block until the copy has run)."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
