"""A linear layer and its LoRA deltas, in plain torch (the reference of `kernels/lora_linear.py`, whose contract it
shares): the layer's output rounded to its dtype, then `kernels/lora_ref.add_lora_ref`'s per-token deltas added
in float32 and rounded once. Not here: anything but the composition (the numerics are lora_ref's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.lora_ref import add_lora_ref


def linear_lora_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                    B: torch.Tensor, idx: torch.Tensor, scaling: torch.Tensor, *,
                    slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [T, in], weight [N, in], bias [N] or None, the stacks A [S, R, in] / B [S, N, r_max], idx [T] (-1: no
    adapter), scaling [S] float32 -> new [T, N]: F.linear(x, weight, bias) plus each token's scaled delta."""
    return add_lora_ref(F.linear(x, weight, bias), x, A, B, idx, scaling, slices=slices)
