"""SiLU-and-multiply of a fused gate_up projection in plain torch (reference and CPU path).

Numerics follow Hugging Face's MLP, `silu(gate) * up`: the SiLU is computed in float32 and rounded to the
activation dtype, then multiplied by `up` in the activation dtype (a second rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2 * I] (gate, then up) -> [..., I] in x's dtype. `delta` (float32, x's shape): added to x in float32
    and rounded to x's dtype first (a LoRA delta the projection left to this kernel)."""
    if delta is not None:
        x = (x.float() + delta).to(x.dtype)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
