"""Mixture-of-Experts feed-forward layer in plain torch (reference, CPU path, and the autograd path of
`kernels/moe.py`).

One call computes, for every token t and each of its k routed experts e = topk_ids[t, j],

    y[t, j] = w2[e] @ (silu(g) * u),   (g, u) = split(w13[e] @ x[t])   (gate rows [0, I), up rows [I, 2I))
    out[t]  = sum over j = 0..k-1, in that order, of topk_weights[t, j] * y[t, j]

with the (token, j) pairs grouped per expert so that each expert runs two GEMMs over all of its rows.
Numerics: each projection's output is rounded to the activation dtype (what a linear layer in that dtype
does), SiLU-and-mul as `kernels/activation_ref.py`, then the weighted sum over j in float32, rounded once.
It is differentiable in x, w13, w2 and topk_weights (plain torch ops), and it syncs the host (it groups
rows by expert on the host), so it is no CUDA-graph path.

`deterministic=True` computes every projection with `batch_invariant_linear_ref` (each output element's
reduction order fixed by the model's widths), so a token's output depends only on that token's row, its
routing and the weights: bitwise the same alone or inside any batch. Not here: the router (softmax,
top-k), shared experts, expert parallelism, quantized weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation_ref import silu_and_mul_ref
from kernels.matmul_ref import batch_invariant_linear_ref

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 1024  # the Triton alignment kernel holds one counter per expert in registers


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    """Raise ValueError naming the argument and the rule unless the shapes, dtypes and devices fit the
    fused MoE contract (values of topk_ids are not looked at: that would sync the host)."""
    if x.dim() != 2 or x.dtype not in MOE_DTYPES:
        raise ValueError(f"x must be [T, H] of {MOE_DTYPES}; got {x.dtype} {tuple(x.shape)}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden or w13.dtype != x.dtype:
        raise ValueError(f"w13 must be [E, 2 * I, {hidden}] {x.dtype}; got {w13.dtype} {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if not 0 < experts <= MAX_EXPERTS or inter == 0:
        raise ValueError(f"w13 must have 1..{MAX_EXPERTS} experts and I > 0; got {tuple(w13.shape)}")
    if w2.shape != (experts, hidden, inter) or w2.dtype != x.dtype:
        raise ValueError(f"w2 must be [{experts}, {hidden}, {inter}] {x.dtype}; got {w2.dtype} {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [{tokens}, k] int32 or int64; got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if not 0 < topk_ids.shape[1] <= experts:
        raise ValueError(f"topk_ids must choose 1..{experts} experts per token; got k = {topk_ids.shape[1]}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be [{tokens}, {topk_ids.shape[1]}] float32; got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if len({t.device for t in (x, w13, w2, topk_weights, topk_ids)}) != 1:
        raise ValueError("x, w13, w2, topk_weights and topk_ids must be on one device")


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I) of every expert
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32 / int64 in [0, E)
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """-> [T, H] in x's dtype (see the module docstring for the sum and its order)."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    experts, top_k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [T * k]: row t * k + j is (token t, choice j)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= experts):
        raise ValueError(f"topk_ids must lie in [0, {experts})")
    order = torch.argsort(flat, stable=True)  # [T * k]: the rows grouped by expert, each group in row order
    counts = torch.bincount(flat, minlength=experts).tolist()
    rows = x[order // top_k]  # [T * k, H]
    linear = batch_invariant_linear_ref if deterministic else F.linear
    parts, start = [], 0
    for e, count in enumerate(counts):
        if count:
            part = rows[start : start + count]  # [count, H]
            parts.append(linear(silu_and_mul_ref(linear(part, w13[e])), w2[e]))  # [count, H]
            start += count
    grouped = torch.cat(parts) if parts else rows  # [T * k, H] in `order`
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = grouped[inverse].view(tokens, top_k, hidden)  # [T, k, H]
    out = y[:, 0].float() * topk_weights[:, 0, None]  # [T, H] float32
    for j in range(1, top_k):
        out = out + y[:, j].float() * topk_weights[:, j, None]
    return out.to(x.dtype)
