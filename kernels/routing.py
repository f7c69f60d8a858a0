"""Mixture-of-Experts routing in one Triton kernel (the CUDA path of `kernels/routing_ref.py`).

One program per token reads its row of router logits [E], takes the softmax in float32, picks the top-k
experts (k rounds of argmax, lowest index first among equal probabilities — torch.topk's order for distinct
values; equal ones, frequent among bfloat16 logits, torch may order otherwise) or takes the given experts (routing replay), writes their probabilities (renormalised when asked) and
ids, and, with a routing store, the ids at the token's KV slot of one layer's plane — what the torch path
does in six kernels. The weights agree with the reference to float32 rounding (the softmax's sum is
reduced in another order); batch invariant: each row's result depends on that row only.

Not here: grouped top-k (DeepSeek's node-limited routing), sigmoid routers, autograd (`kernels/routing_ref.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, ids_in_ptr, weights_ptr, ids_ptr, store_ptr, slots_ptr, stride_l, num_experts,
                  store_row, layer_offset, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, GIVEN: tl.constexpr, STORE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=-float("inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    e = tl.where(valid, tl.exp(x - top), 0.0)
    probs = e / tl.sum(e, axis=0)
    ks = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    chosen_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if GIVEN:
        chosen_ids = tl.load(ids_in_ptr + row * TOP_K + ks, mask=ks < TOP_K, other=0).to(tl.int32)
        for j in tl.static_range(TOP_K):
            pick = tl.sum(tl.where(ks == j, chosen_ids, 0), axis=0)
            w = tl.sum(tl.where(cols == pick, probs, 0.0), axis=0)
            chosen_w = tl.where(ks == j, w, chosen_w)
    else:
        remaining = tl.where(valid, probs, -1.0)
        for j in tl.static_range(TOP_K):
            w = tl.max(remaining, axis=0)
            pick = tl.min(tl.where(remaining == w, cols, BLOCK_E), axis=0)
            chosen_ids = tl.where(ks == j, pick, chosen_ids)
            chosen_w = tl.where(ks == j, w, chosen_w)
            remaining = tl.where(cols == pick, -1.0, remaining)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(tl.where(ks < TOP_K, chosen_w, 0.0), axis=0)
    kmask = ks < TOP_K
    tl.store(weights_ptr + row * TOP_K + ks, chosen_w, mask=kmask)
    tl.store(ids_ptr + row * TOP_K + ks, chosen_ids, mask=kmask)
    if STORE:
        slot = tl.load(slots_ptr + row)
        keep = kmask & ((ks * 0 + slot) >= 0)  # a vector mask (a scalar one is not broadcast by every backend)
        tl.store(store_ptr + slot * store_row + layer_offset + ks, chosen_ids, mask=keep)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *, ids: torch.Tensor | None = None,
               store: torch.Tensor | None = None, slots: torch.Tensor | None = None,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] (float32 / float16 / bfloat16, unit stride in E) -> (weights [N, k] float32,
    ids [N, k] int32). With `ids` [N, k] the experts are those (replay) and only their weights are computed.
    With `store` [S, L, k] int32 and `slots` [N] int64, row n's ids also go to store[slots[n], layer]
    (rows with a negative slot are skipped)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [N, E] with unit stride in E; got {tuple(logits.shape)}")
    n, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    weights = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    given = ids is not None
    if given:
        if tuple(ids.shape) != (n, top_k):
            raise ValueError(f"ids must be [{n}, {top_k}], got {tuple(ids.shape)}")
        out_ids = ids.to(torch.int32).contiguous()  # read, and written back unchanged
    else:
        out_ids = torch.empty((n, top_k), dtype=torch.int32, device=logits.device)
    with_store = store is not None
    if with_store:
        assert store.dtype == torch.int32 and store.is_contiguous() and store.shape[2] == top_k, store.shape
        assert slots is not None and slots.shape == (n,), "slots [N] go with the store"
        assert 0 <= layer < store.shape[1], layer
    if n:
        _route_kernel[(n,)](
            logits, out_ids, weights, out_ids, store if with_store else out_ids,
            slots if with_store else out_ids, logits.stride(0), num_experts,
            store.shape[1] * top_k if with_store else 0, layer * top_k,
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, GIVEN=given, STORE=with_store, num_warps=1 if num_experts <= 256 else 4,
        )
    return weights, out_ids
