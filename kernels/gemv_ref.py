"""The plain-torch counterpart of `kernels/gemv.py`: the unfused layers composed (reference and tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation_ref import silu_and_mul_ref
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref


def fused_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prologue: str = "none",
    norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What `kernels.gemv.fused_gemv` computes, by the reference kernels and `F.linear`."""
    if prologue == "silu_mul":
        return F.linear(silu_and_mul_ref(x), weight, bias)
    if prologue == "rms_norm":
        if residual is None:
            normed, summed = rms_norm_ref(x, norm_weight, eps), x
        else:
            normed, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
        return F.linear(normed, weight, bias), summed
    return F.linear(x, weight, bias)
