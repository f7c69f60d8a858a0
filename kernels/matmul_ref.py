"""Batch-invariant linear layer in plain torch (deterministic mode, CPU path and reference).

`F.linear` hands the whole batch to a BLAS whose blocking, and so whose summation order, depends on the
number of rows: the same row can round differently in a batch of 1 and a batch of 64. Here every output
element is the sum of its K products in one fixed order — an elementwise product followed by a reduction
over the contiguous K axis, whose length is a property of the model — so a row's result depends on that
row alone. Rows are processed in chunks only to bound the temporary; chunking does not touch the order.
It is differentiable (plain torch ops). Slow compared with BLAS: meant for the deterministic mode.
"""

from __future__ import annotations

import torch

_MAX_TEMP_ELEMENTS = 1 << 24


def batch_invariant_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] -> [..., N] with a per-row fixed reduction order."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    n, k = weight.shape
    chunk = max(1, _MAX_TEMP_ELEMENTS // max(1, n * k))
    outs = [(rows[i : i + chunk, None, :] * weight[None, :, :]).sum(-1) for i in range(0, rows.shape[0], chunk)]
    out = torch.cat(outs, dim=0) if len(outs) != 1 else outs[0]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, n)
