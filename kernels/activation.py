"""SiLU-and-multiply in Triton (the CUDA path of `kernels/activation_ref.py`): one kernel reads the fused
gate_up output [T, 2 * I] and writes silu(gate) * up [T, I], where torch needs two elementwise kernels
and a temporary.

Numerics follow the reference: SiLU in float32, rounded to the activation dtype, then the product in
float32 rounded once to the activation dtype (what a dtype multiply does). Agreement: float32 within
1e-6 relative; float16 / bfloat16 within two ulps, rarely more than zero (Triton's exp may differ from
torch's by an ulp of float32, which can move the rounded SiLU by one ulp of the dtype, and the product's
rounding by one more).

An optional float32 `delta` of x's shape (a LoRA delta the gate_up projection left to this kernel,
`EngineConfig.lora_deferred`) is added to gate and up in float32 and rounded to the dtype before the activation,
as `silu_and_mul_ref` does.

Not here: GELU or other activations, quantized outputs, in-place variants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, delta_ptr, out_ptr, stride_x, stride_d, stride_o, inter, BLOCK: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the projection's LoRA delta, added in float32 and rounded once
        dg = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        du = tl.load(delta_ptr + row * stride_d + inter + cols, mask=mask, other=0.0)
        gate = (gate.to(tl.float32) + dg).to(x_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + du).to(x_ptr.dtype.element_ty)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2 * I] (gate, then up) -> [..., I] in x's dtype: `out` ([N, I], N rows of x, contiguous) when
    given, else a new tensor. `delta` (float32, x's shape, contiguous rows): added to x in float32 and rounded to
    x's dtype before the activation (a LoRA delta the projection left to this kernel)."""
    if x.dim() < 1 or x.dtype not in _DTYPES or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * I] of {_DTYPES}; got {x.dtype} {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != torch.float32 or delta.device != x.device or delta.stride(-1) != 1:
            raise ValueError(f"delta must be a float32 {tuple(x.shape)} tensor on {x.device}, contiguous in its last "
                             f"dimension; got {delta.dtype} {tuple(delta.shape)} on {delta.device}")
        delta = delta.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.shape != (x2.shape[0], inter) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{x2.shape[0]}, {inter}] {x.dtype} tensor on {x.device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if x2.shape[0] and inter:
        grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](x2, x2 if delta is None else delta, out, x2.stride(0),
                                   0 if delta is None else delta.stride(0), out.stride(0), inter, BLOCK=_BLOCK,
                                   HAS_DELTA=delta is not None, num_warps=4)
    return out.view(*x.shape[:-1], inter)
