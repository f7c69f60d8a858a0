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
routing and the weights: bitwise the same alone or inside any batch.

Expert parallelism: with `expert_start=s` the weights hold the E experts [s, s + E) of a larger set and
topk_ids are global ids; a (token, j) pair routed outside that range contributes exactly 0 (its term is
left out of the sum), so summing the outputs of ranks that hold disjoint ranges covering every expert
gives every term once. Not here: the router (softmax, top-k), shared experts, the communication of
expert parallelism, quantized weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation_ref import silu_and_mul_ref
from kernels.matmul_ref import batch_invariant_linear_ref

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 1024  # the Triton alignment kernel holds one counter per expert in registers


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, local: bool = False) -> None:
    """Raise ValueError naming the argument and the rule unless the shapes, dtypes and devices fit the
    fused MoE contract (values of topk_ids are not looked at: that would sync the host). `local`: w13 holds
    a range of the experts (expert parallelism), so k may exceed its expert count."""
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
    if not 0 < topk_ids.shape[1] <= (MAX_EXPERTS if local else experts):
        raise ValueError(f"topk_ids must choose 1..{MAX_EXPERTS if local else experts} experts per token; got "
                         f"k = {topk_ids.shape[1]}")
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
    expert_start: int | None = None,
) -> torch.Tensor:
    """-> [T, H] in x's dtype (see the module docstring for the sum and its order). `expert_start`: None,
    topk_ids must lie in [0, E); an int s >= 0, the weights are experts [s, s + E) and pairs routed to any
    other (non-negative) id contribute 0."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, local=expert_start is not None)
    tokens, hidden = x.shape
    experts, top_k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [T * k]: row t * k + j is (token t, choice j)
    if expert_start is not None:
        if expert_start < 0:
            raise ValueError(f"expert_start must be >= 0; got {expert_start}")
        if flat.numel() and int(flat.min()) < 0:
            raise ValueError("topk_ids must be >= 0")
        flat = flat - expert_start
        flat = torch.where((flat >= 0) & (flat < experts), flat, experts)  # id E: another rank's expert
    elif flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= experts):
        raise ValueError(f"topk_ids must lie in [0, {experts})")
    order = torch.argsort(flat, stable=True)  # [T * k]: the rows grouped by expert, each group in row order
    counts = torch.bincount(flat, minlength=experts + 1).tolist()  # [E + 1]: the last, rows of other ranks
    rows = x[order // top_k]  # [T * k, H]
    linear = batch_invariant_linear_ref if deterministic else F.linear
    parts, start = [], 0
    for e, count in enumerate(counts[:experts]):
        if count:
            part = rows[start : start + count]  # [count, H]
            parts.append(linear(silu_and_mul_ref(linear(part, w13[e])), w2[e]))  # [count, H]
            start += count
    if counts[experts]:  # rows of other ranks' experts: placeholders, left out of the sum below
        parts.append(rows[start:])
    grouped = torch.cat(parts) if parts else rows  # [T * k, H] in `order`
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = grouped[inverse].view(tokens, top_k, hidden)  # [T, k, H]
    mine = (flat < experts).view(tokens, top_k, 1)  # [T, k, 1]: the pair's expert is one of these weights'
    out = None  # [T, H] float32: the sum over j of the pairs routed here, in order j = 0..k-1
    for j in range(top_k):
        term = y[:, j].float() * topk_weights[:, j, None]
        if expert_start is not None:
            term = torch.where(mine[:, j], term, 0.0)
        out = term if out is None else out + term
    return out.to(x.dtype)
