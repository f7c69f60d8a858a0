"""The plain-torch counterpart of `kernels/moe_decode.py`: the post-attention RMSNorm, the router's top-k and the
experts composed from their references (tests; the CPU runs the unfused block of runner/models/qwen_moe.py).

Routing ties: torch.topk orders equal probabilities as it likes, the kernel lowest index first; the tests use
logits without ties. Not here: the router's linear layer (its logits are an input), autograd concerns.
"""

from __future__ import annotations

import torch

from kernels.moe_ref import fused_moe_ref
from kernels.norm_ref import rms_norm_ref
from kernels.routing_ref import routing_weights_ref, topk_ids_ref


def moe_decode_ref(
    hidden_sum: torch.Tensor,  # [T, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    router_logits: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [E_local, 2I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    top_k: int,
    renormalize: bool,
    *,
    expert_start: int | None = None,
    store: torch.Tensor | None = None,  # [S, L, k] int32
    slots: torch.Tensor | None = None,  # [T] int64 (negative: not recorded)
    layer: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `kernels.moe_decode.moe_decode` computes: (out [T, H], weights [T, k] float32, ids [T, k] int32)."""
    ids = topk_ids_ref(router_logits, top_k)  # [T, k] int64
    weights = routing_weights_ref(router_logits, ids, renormalize)
    if store is not None:
        keep = slots >= 0
        store[slots[keep], layer] = ids[keep].to(torch.int32)
    out = fused_moe_ref(rms_norm_ref(hidden_sum, norm_weight, eps), w13, w2, weights, ids, expert_start=expert_start)
    return out, weights, ids.to(torch.int32)
