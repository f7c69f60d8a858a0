"""Batch-invariant linear layer on CUDA (deterministic mode): cuBLAS over fixed-shape row blocks.

A GEMM library picks its kernel — tile shape, split-K, and so the summation order — by the problem's
shape, so with `F.linear` a row can round differently in a batch of 1 and a batch of 256. Here the
library never sees a different shape for a given weight: the input's rows are cut into blocks of exactly
`ROWS` rows (the last block zero-padded), and each block is one GEMM `[ROWS, K] x [K, N]` whose operands
sit at 16-byte-aligned addresses. The padding rows hold whatever the memory held: a row's result never
depends on another row, and the padding rows' results are dropped. An input allocated by `padded_rows`
already has its blocks and is read in place; any other input is staged into a padded copy. The library picks the same kernel for every such call, and a GEMM
kernel computes an output row from that row and the weight alone (tiles and split-K partition the output
and K, never mix rows), so a row's result depends on the row and the weight only: the same in decode at
any batch size, in chunked prefill, and in the trainer's full-sequence forward. `ROWS` = 256 keeps a
decode step's GEMMs at the cost of a 256-row batch (about that of a 64-row one: all of them are bound by
reading the weights on a large GPU) while a long prefill runs at full GEMM efficiency.

Used by the engine and by the trainer's forward in deterministic mode, always through this function with
the same `ROWS`. `kernels/matmul_ref.py` is the CPU counterpart (same contract, its own fixed order).
Torch-only (no Triton); not here: a general GEMM, fp8, tensor-parallel sharding.
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS = 256  # rows of every GEMM call; part of the numerics contract between engine and trainer
_ALIGN = 16  # bytes; the GEMM library picks vectorised kernels by operand alignment up to this


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % _ALIGN == 0


def padded_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An empty [rows, cols] tensor whose storage holds whole blocks of ROWS rows. Producers of linear
    inputs allocate their outputs with it in deterministic mode, so `batch_invariant_linear` reads the
    blocks in place instead of staging a padded copy (the rows past `rows` are scratch)."""
    return torch.empty(-(-rows // ROWS) * ROWS, cols, dtype=dtype, device=device)[:rows]


def _rows_in_storage(x2: torch.Tensor) -> int:
    """Rows of x2's width from x2's first element to the end of its storage."""
    row_bytes = x2.shape[1] * x2.element_size()
    return (x2.untyped_storage().nbytes() - x2.storage_offset() * x2.element_size()) // max(row_bytes, 1)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> new [..., N] in x's dtype, computed in GEMMs of
    exactly ROWS rows."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {_DTYPES}; got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[-1]}]; got {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}; got {bias.dtype} {tuple(bias.shape)}")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    if not weight.is_contiguous() or not _aligned(weight) or (bias is not None and not (bias.is_contiguous() and _aligned(bias))):
        raise ValueError("weight and bias must be contiguous and 16-byte aligned")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    m, k = x2.shape
    n = weight.shape[0]
    padded = -(-m // ROWS) * ROWS
    if x2.is_contiguous() and _aligned(x2) and _rows_in_storage(x2) >= padded:
        x2 = x2.as_strided((padded, k), (k, 1))  # [padded, K]: the rows past m are the storage's scratch
    else:
        staged = torch.empty(padded, k, dtype=x.dtype, device=x.device)  # [padded, K]; rows past m unused
        staged[:m] = x2
        x2 = staged
    out = torch.empty(padded, n, dtype=x.dtype, device=x.device)  # [padded, N]
    wt = weight.t()  # [K, N] view
    for start in range(0, padded, ROWS):
        block = slice(start, start + ROWS)
        if bias is None:
            torch.mm(x2[block], wt, out=out[block])
        else:
            torch.addmm(bias, x2[block], wt, out=out[block])
    return out[:m].view(*lead, n)
