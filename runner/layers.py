"""Linear layers whose kernel depends on the model's mode.

`Linear` holds `weight [out, in]` and an optional `bias [out]` under the same names as `nn.Linear`, so
checkpoint layouts are unchanged. In deterministic mode its forward uses a batch-invariant matmul (each
row's reduction order fixed: `kernels/matmul.py` on CUDA, `kernels/matmul_ref.py` on the CPU); otherwise
`F.linear`. A forward of at most `gemv_rows` rows (the engine sets it on CUDA outside deterministic mode,
`EngineConfig.fused_gemv_rows`) runs the Triton matrix-vector kernel `kernels.gemv.fused_gemv` instead. A layer
that LoRA adapters target gets a `lora` hook (runner/lora/runtime.py), which adds each token's adapter delta to
the output in place; its `start(x)` runs before the matmul, so that (on CUDA) the adapters' shrink can run on a
side stream beside it. Not here: tensor-parallel sharding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.matmul_ref import batch_invariant_linear_ref
from runner.deterministic import kernel_forward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deterministic: bool) -> torch.Tensor:
    if not deterministic:
        return F.linear(x, weight, bias)
    if not x.is_cuda:
        return batch_invariant_linear_ref(x, weight, bias)
    from kernels.matmul import batch_invariant_linear

    # the Triton kernel forward (what the engine runs); gradients through F.linear
    if bias is None:
        return kernel_forward(batch_invariant_linear, F.linear, x, weight)
    return kernel_forward(batch_invariant_linear, F.linear, x, weight, bias)


class Linear(nn.Module):
    gemv_rows = 0  # forwards of at most this many rows (x [T, in], no autograd) take kernels.gemv.fused_gemv

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.deterministic = False
        self.lora = None  # runner.lora.runtime.LoraHook when adapters target this layer: lora(out, x, lora.start(x))

    def set_deterministic(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_lora(x, self.bias)
        if fused is not None:
            return fused
        partials = None if self.lora is None else self.lora.start(x)  # the LoRA shrink, beside the matmul
        if self.takes_gemv(x):
            from kernels.gemv import fused_gemv

            out = fused_gemv(x, self.weight, self.bias)
        else:
            out = linear(x, self.weight, self.bias, self.deterministic)
        return out if self.lora is None else self.lora(out, x, partials)

    def fused_lora(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x W^T (+ bias) with the LoRA delta, when the hook takes the layer in one launch
        (`runner.lora.runtime.LoraHook.linear`); None otherwise (and in deterministic mode)."""
        if self.lora is None or self.deterministic:
            return None
        return self.lora.linear(x, self.weight, bias)

    def lora_residual(self, residual: torch.Tensor) -> None:
        """The residual sum [T, out] this layer's next output is about to join, for a LoRA hook that adds its delta
        there (`runner.lora.runtime.LoraHook.set_residual`); nothing without a hook."""
        if self.lora is not None:
            self.lora.set_residual(residual)

    def lora_delta(self) -> torch.Tensor | None:
        """The float32 LoRA delta [T, out] of this layer's last output, left to the kernel that reads the output
        to add (`runner.lora.runtime.LoraHook.take_delta`); None when nothing was left (or without a hook)."""
        return None if self.lora is None else self.lora.take_delta()

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether a forward of x runs the matrix-vector kernel (see `gemv_rows`)."""
        return (x.dim() == 2 and 0 < x.shape[0] <= self.gemv_rows and not self.deterministic
                and not torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
