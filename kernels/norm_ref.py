"""RMSNorm and fused residual-add + RMSNorm in plain torch (reference and CPU path).

Numerics follow Hugging Face's Llama: the residual add happens in the activation dtype, the norm in
float32, and the weight multiplies the result after it is cast back to the activation dtype.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in x's dtype."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); all [T, H] in x's dtype."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
