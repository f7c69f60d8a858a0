"""Torch-only helpers shared by the Triton launchers and their callers (imports without Triton or CUDA).

- `SIGNED_VIEW`: the same-width signed integer dtype of an element size, for reading a tensor's bits.
- `upload`: a small host tensor (step metadata, index arrays, pointer tables) on a device without blocking
  the host. A copy from pageable memory waits for the device to drain; one through pinned memory is queued
  like a kernel.
- `device_index`: what `Tensor.get_device()` returns for tensors on a device, so that loops over hundreds
  of tensors compare ints instead of building a `torch.device` per tensor (~1 µs each).
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


def device_index(device: torch.device | str) -> int:
    """-1 for the CPU; for CUDA the GPU's index (the current GPU for an index-less "cuda"): equal to
    `t.get_device()` exactly for the tensors `t` on `device`."""
    device = torch.device(device)
    if device.type == "cpu":
        return -1
    if device.type != "cuda":
        raise ValueError(f"only cpu and cuda devices are supported, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index
