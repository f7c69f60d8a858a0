"""Linear layers whose kernel depends on the model's mode.

`Linear` holds `weight [out, in]` and an optional `bias [out]` under the same names as `nn.Linear`, so
checkpoint layouts are unchanged. In deterministic mode its forward uses a batch-invariant matmul (each
row's reduction order fixed); otherwise `F.linear`. Not here: tensor-parallel sharding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.matmul_ref import batch_invariant_linear_ref


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deterministic: bool) -> torch.Tensor:
    if not deterministic:
        return F.linear(x, weight, bias)
    if x.is_cuda:
        raise ValueError("deterministic mode has no CUDA matmul kernel yet; run it on the CPU")
    return batch_invariant_linear_ref(x, weight, bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.deterministic = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.deterministic)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
