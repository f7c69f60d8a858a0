"""SiLU-and-multiply in Triton (the CUDA path of `kernels/activation_ref.py`): one kernel reads the fused
gate_up output [T, 2 * I] and writes silu(gate) * up [T, I], where torch needs two elementwise kernels
and a temporary.

Numerics follow the reference: SiLU in float32, rounded to the activation dtype, then the product in
float32 rounded once to the activation dtype (what a dtype multiply does). Agreement: float32 within
1e-6 relative; float16 / bfloat16 within two ulps, rarely more than zero (Triton's exp may differ from
torch's by an ulp of float32, which can move the rounded SiLU by one ulp of the dtype, and the product's
rounding by one more).

Not here: GELU or other activations, quantized outputs, in-place variants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2 * I] (gate, then up) -> [..., I] in x's dtype: `out` ([N, I], N rows of x, contiguous) when
    given, else a new tensor."""
    if x.dim() < 1 or x.dtype not in _DTYPES or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * I] of {_DTYPES}; got {x.dtype} {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.shape != (x2.shape[0], inter) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{x2.shape[0]}, {inter}] {x.dtype} tensor on {x.device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if x2.shape[0] and inter:
        grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], inter)
