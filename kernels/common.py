"""Torch-only helpers shared by the Triton launchers and their callers (imports without Triton or CUDA).

- `SIGNED_VIEW`: the same-width signed integer dtype of an element size, for reading a tensor's bits.
- `upload`: a small host tensor (step metadata, index arrays, pointer tables) on a device without blocking
  the host. A copy from pageable memory waits for the device to drain; one through pinned memory is queued
  like a kernel.
"""

from __future__ import annotations

import torch

SIGNED_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; a host tensor bound for CUDA goes through pinned memory, non-blocking. Other moves
    are plain `.to`."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
