"""Batch-invariant matmul in Triton (deterministic mode's linear layers on CUDA).

`F.linear` lets cuBLAS pick kernels, tile shapes and split-K by the number of rows, so a row can round
differently in a batch of 1 and a batch of 256. Here the tiles, warps and stages depend on the weight's
shape alone (narrower column tiles for narrow weights, so that small projections still fill the GPU), every
launch walks K in the same fixed order with no split-K, and M is never specialised on, so the compiled
kernel does not change with the batch. A row's result then depends on that row and the weight only.
Used by the engine and by the trainer's forward in deterministic mode; `kernels/matmul_ref.py` is the CPU
counterpart (same contract, its own fixed order). Not here: a fast general GEMM, fp8, autotuning (tuning
by shape would defeat the point).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M, BLOCK_K = 64, 64
_TARGET_PROGRAMS = 128  # column tiles wanted per row tile: about one per SM of a large GPU


def block_n(n: int) -> int:
    """Column tile for a weight of n rows: the widest of 64 / 32 / 16 that still gives ~_TARGET_PROGRAMS tiles.
    A function of the weight alone, never of the batch."""
    for width in (64, 32):
        if triton.cdiv(n, width) >= _TARGET_PROGRAMS:
            return width
    return 16


@triton.jit(do_not_specialize=["M"])
def _batch_invariant_matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> new [..., N] in x's dtype (fp32 accumulation)."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {_DTYPES}; got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[-1]}]; got {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}; got {bias.dtype} {tuple(bias.shape)}")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous in K")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        bn = block_n(N)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, bn))
        _batch_invariant_matmul_kernel[grid](
            x2, weight, bias if bias is not None else weight, out, M, N, K,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K,
            IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3,
        )
    return out.view(*lead, N)
