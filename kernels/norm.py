"""RMSNorm and fused residual-add + RMSNorm in Triton (the CUDA path of `kernels/norm_ref.py`).

Numerics follow the reference: the residual add happens in the activation dtype, the mean of squares and
the normalization in float32, the result is cast back to the activation dtype, and then multiplied by
the weight in the activation dtype. One program normalizes one row, held in registers whole.

Agreement with the reference: float32 within 1e-5 (relative); float16 / bfloat16 within two ulps of the
output, rarely more than zero (the float32 mean of squares is summed in a different order and rsqrt may
round differently, which can move the cast normalized value by one ulp, and the weight multiply's
rounding by one more); the residual sum is bitwise identical.

Not here: LayerNorm, norms without a weight, quantized outputs, in-place variants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 65536  # one row must fit in one program's registers


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add, rounded to the activation dtype
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, 0) / hidden
    normed = (h * tl.math.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)  # one rounding, as a dtype multiply
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [..., H] of {_DTYPES}; got {x.dtype} {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[-1]}] {x.dtype} on {x.device}; got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if not 0 < x.shape[-1] <= _MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {_MAX_HIDDEN}]; got {x.shape[-1]}")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight must be contiguous in the hidden dimension")


def _check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(like.shape)} {like.dtype} tensor on {like.device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., H], weight [H] (same dtype) -> [..., H] in x's dtype: `out` ([N, H], N rows of x) when given,
    else a new tensor."""
    _check(x, weight)
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)  # [N, H]
    if out is None:
        out = torch.empty_like(x2d)
    _check_out(out, x2d)
    if x2d.shape[0]:
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d, x2d, weight, out, out,
            x2d.stride(0), x2d.stride(0), out.stride(0), out.stride(0), hidden, float(eps),
            HAS_RESIDUAL=False, BLOCK_H=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out: torch.Tensor | None = None,  # [T, H]: where the normalized rows go; a new tensor when None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), both [T, H] in x's dtype; the sum is a new tensor."""
    _check(x, weight)
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"x and residual must both be [T, H] {x.dtype} on one device; got {tuple(x.shape)} "
                         f"and {residual.dtype} {tuple(residual.shape)} on {residual.device}")
    if residual.stride(-1) != 1:
        raise ValueError("residual must be contiguous in the hidden dimension")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_out(out, x)
    summed = torch.empty_like(out)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, summed,
            x.stride(0), residual.stride(0), out.stride(0), summed.stride(0), x.shape[1], float(eps),
            HAS_RESIDUAL=True, BLOCK_H=triton.next_power_of_2(x.shape[1]),
        )
    return out, summed
