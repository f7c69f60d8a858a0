"""Deterministic mode's trainer side on CUDA: the engine's own kernels forward, ordinary autograd backward.

`kernel_forward(kernel, reference, *tensors)` returns `kernel(*tensors)` — a Triton launcher whose
reduction order does not depend on the batch, exactly what the rollout engine ran — and, when autograd is
recording, differentiates through `reference`, a plain-torch function of the same math, recomputed in the
backward pass. So the trainer's logprobs equal the engine's bitwise while its gradients come from
ordinary kernels (they need not be batch invariant). `set_deterministic_all(module, flag)` switches every
submodule that has a deterministic mode (each defines `set_deterministic(flag)`). Not here: the kernels
themselves (kernels/).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: Callable, reference: Callable, *inputs: torch.Tensor):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in inputs if x.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else ())
        return (None, None, *[next(got, None) if x.requires_grad else None for x in inputs])


def kernel_forward(kernel: Callable, reference: Callable, *inputs: torch.Tensor):
    """`kernel(*inputs)`, differentiable through `reference(*inputs)` when autograd records."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return _KernelFunction.apply(kernel, reference, *inputs)
    return kernel(*inputs)


def set_deterministic_all(module: nn.Module, deterministic: bool) -> None:
    """Call `set_deterministic(deterministic)` on every submodule of `module` (itself excluded) that defines it."""
    for sub in module.modules():
        if sub is not module and callable(getattr(sub, "set_deterministic", None)):
            sub.set_deterministic(deterministic)
