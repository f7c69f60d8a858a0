"""A sparse MoE block at a few tokens (decode) in two Triton launches: routing, experts and combine.

At batch 1-2 a Mixture-of-Experts layer reads only the k chosen experts' weights, and the launches between
the router's logits and the block's output (the top-k kernel, the expert GEMMs, the combine) cost about as
much as those reads. `moe_decode` takes the router's logits and the residual stream after attention, and
does the rest in two launches, with no sort or alignment:

1. gate_up, one program per (token t, choice j) pair and block of the expert's intermediate columns: the
   softmax top-k of t's logits (each program recomputes it: the same bits in every program), RMSNorm of
   t's residual stream (the post-attention norm, computed as `kernels/norm.py` rounds it), then
   x_norm @ w13[e]^T for the gate and the up columns of expert e = the j-th choice, SiLU-and-mul as
   `kernels/moe.py`: act [T * k, I]. The programs of column block 0 also write the ids, the weights and
   (with a routing store) the ids at each token's KV slot.
2. down + combine, one program per token and block of output columns: the B operand gathers the k chosen
   experts' w2 rows side by side ([BLOCK_K, K_PAD * BLOCK_N]), so one MMA loop over I computes every
   choice's output columns; each choice's term is rounded to the activation dtype after its routing weight
   (as `kernels/moe.py` rounds z), and the terms are summed in float32 in the order j = 0..k-1, rounded once.
   No atomics: each output element is written by one program.

With the norm fused into the router's GEMV (`kernels.gemv.fused_gemv(prologue="rms_norm")`, which returns the
residual sum), a sparse block is three launches instead of six. Numerics: the routing is `kernels/routing.py`'s
(k rounds of argmax, lowest index first among equal probabilities; renormalised weights); the result agrees
with the reference (`kernels/moe_decode_ref.py`) to GEMM-summation-order error. Same bits on every run (fixed
grid and reduction order) but not batch invariant by contract: deterministic mode keeps `kernels/moe.py`.

Expert parallelism (`expert_start=s`, w13 / w2 hold experts [s, s + E_local)): the top-k is over all of the
router's experts; a pair routed outside the range writes no act row and contributes exactly 0. Each token is
read per chosen expert with no deduplication across tokens, so beyond a few tokens the aligned kernel of
`kernels/moe.py` reads fewer bytes (the model's threshold: `SparseMoeBlock.decode_pairs`). Not here: shared
experts, routing replay (given ids), grouped top-k, sigmoid routers, quantized weights, autograd.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.moe_ref import MAX_EXPERTS

_SMEM_BUDGET = 144 * 1024  # bytes of pipelined operand tiles per program (as kernels/moe.py)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Tiles of the two launches of `moe_decode`."""

    up_block_n: int = 32
    """Intermediate columns per gate_up program (the program loads as many gate and as many up columns). 32:
    the fastest of 16 and 32 at the Qwen3-30B-A3B shape on an H200 (`bench/moe.py --layer`: 31.5 against
    36.6 us per layer at one token, 49.1 against 66.3 at two; the unfused chain 32.1 and 53.1)."""
    up_block_k: int = 256
    """Hidden elements per step of the gate_up loop."""
    up_stages: int = 3
    """Software-pipelining depth of the gate_up weight loads (capped by the shared-memory budget)."""
    down_columns: int = 128
    """Columns of the down program's gathered weight tile: K_PAD choices x (down_columns / K_PAD) output
    columns each (K_PAD: top_k rounded up to a power of two)."""
    down_block_k: int = 128
    """Intermediate elements per step of the down loop."""
    down_stages: int = 3
    """Software-pipelining depth of the down weight loads (capped by the shared-memory budget)."""
    num_warps: int = 4
    """Warps per program of both launches."""


@triton.jit
def _topk_of_row(logits_ptr, row, stride_l, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_KK: tl.constexpr, RENORMALIZE: tl.constexpr):
    """(ids [BLOCK_KK] int32, weights [BLOCK_KK] float32) of one row of logits: the softmax in float32, then
    k rounds of argmax (lowest index first among equal probabilities), as `kernels/routing.py`. A probability
    and its index share one int64 key (the float's bits, non-negative, order like the floats), so a round is
    one max reduction."""
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=-float("inf")).to(tl.float32)
    e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    probs = e / tl.sum(e, axis=0)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, bits * BLOCK_E + (BLOCK_E - 1 - cols), -1)  # [BLOCK_E]
    ks = tl.arange(0, BLOCK_KK)
    ids = tl.zeros((BLOCK_KK,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_KK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        pick = (BLOCK_E - 1 - best % BLOCK_E).to(tl.int32)
        w = (best // BLOCK_E).to(tl.int32).to(tl.float32, bitcast=True)
        ids = tl.where(ks == j, pick, ids)
        weights = tl.where(ks == j, w, weights)
        keys = tl.where(cols == pick, -1, keys)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(ks < TOP_K, weights, 0.0), axis=0)
    return ids, weights


@triton.jit
def _decode_gate_up_kernel(
    s_ptr, nw_ptr, logits_ptr, w13_ptr, act_ptr, ids_ptr, weights_ptr, store_ptr, slots_ptr,
    hidden, inter, num_experts, num_local, expert_start, eps,
    stride_s, stride_l, stride_we, stride_wn, stride_act, store_row, layer_offset,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr, RENORMALIZE: tl.constexpr,
    STORE: tl.constexpr, LOCAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    choice = pair % TOP_K
    ids, weights = _topk_of_row(logits_ptr, token, stride_l, num_experts, TOP_K, BLOCK_E, BLOCK_KK, RENORMALIZE)
    ks = tl.arange(0, BLOCK_KK)
    first = (ks < TOP_K) & (ks * 0 + choice == 0) & (ks * 0 + pid_n == 0)  # one program per token writes
    tl.store(ids_ptr + token * TOP_K + ks, ids, mask=first)
    tl.store(weights_ptr + token * TOP_K + ks, weights, mask=first)
    if STORE:
        slot = tl.load(slots_ptr + token + ks * 0)  # [BLOCK_KK], one value (a vector mask: see kernels/routing.py)
        tl.store(store_ptr + slot * store_row + layer_offset + ks, ids, mask=first & (slot >= 0))
    expert = (tl.sum(tl.where(ks == choice, ids, 0), axis=0) - expert_start).to(tl.int64)
    if LOCAL:
        if (expert < 0) | (expert >= num_local):
            return
    # RMSNorm of the token's residual stream, rounded as kernels/norm.py rounds it
    offs_k = tl.arange(0, BLOCK_K)
    s_row = s_ptr + token * stride_s
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        h = tl.load(s_row + k0 + offs_k, mask=offs_k < hidden - k0, other=0.0).to(tl.float32)
        squares += h * h
    rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
    dtype = act_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    row0 = (tl.arange(0, BLOCK_M) == 0)[:, None]  # [BLOCK_M, 1]: the MMA's one real row
    b_ptrs = w13_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        h = tl.load(s_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        xn = (nw * (h * rstd).to(dtype).to(tl.float32)).to(dtype)  # [BLOCK_K]
        a = tl.where(row0, xn[None, :], 0.0).to(dtype)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b_up = tl.load(b_ptrs + inter * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
            acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
            acc_up = tl.dot(a, b_up, acc_up)
        b_ptrs += BLOCK_K
    gate = acc.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = tl.sum(tl.where(row0, silu * up, 0.0), axis=0).to(dtype)  # [BLOCK_N]: row 0
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + offs_n, out, mask=n_ok)


@triton.jit
def _decode_down_kernel(
    act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter, num_local, expert_start, stride_act, stride_we, stride_wn, stride_o,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = tl.arange(0, K_PAD * BLOCK_N)  # column c: choice c // BLOCK_N, output column c % BLOCK_N of the block
    choice_c = cols // BLOCK_N
    offs_n = pid_n * BLOCK_N + cols % BLOCK_N
    local_c = tl.load(ids_ptr + token * TOP_K + choice_c, mask=choice_c < TOP_K, other=-1) - expert_start
    ok_c = (choice_c < TOP_K) & (local_c >= 0) & (local_c < num_local) & (offs_n < hidden)
    rows = tl.arange(0, BLOCK_M)  # row j: the act row of choice j
    local_r = tl.load(ids_ptr + token * TOP_K + rows, mask=rows < TOP_K, other=-1) - expert_start
    ok_r = (rows < TOP_K) & (local_r >= 0) & (local_r < num_local)  # the other rows were never written
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + (token * TOP_K + rows).to(tl.int64)[:, None] * stride_act + offs_k[None, :]  # [BM, BK]
    b_ptrs = (w2_ptr + tl.where(ok_c, local_c, 0).to(tl.int64)[None, :] * stride_we
              + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None])  # [BK, K_PAD * BN]
    acc = tl.zeros([BLOCK_M, K_PAD * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=ok_r[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & ok_c[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    own = tl.sum(tl.where(rows[:, None] == choice_c[None, :], acc, 0.0), axis=0)  # [K_PAD * BN]: choice c's row
    weight_c = tl.load(weights_ptr + token * TOP_K + choice_c, mask=choice_c < TOP_K, other=0.0)
    terms = tl.where(ok_c, (own * weight_c).to(dtype).to(tl.float32), 0.0)
    terms = tl.reshape(terms, [K_PAD, BLOCK_N])
    slots = tl.arange(0, K_PAD)[:, None]
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # the fixed order j = 0..k-1 (each masked sum is exact: one term)
        out += tl.sum(tl.where(slots == j, terms, 0.0), axis=0)
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token * stride_o + offs, out.to(dtype), mask=offs < hidden)


def _stages(wanted: int, stage_bytes: int) -> int:
    return max(1, min(wanted, _SMEM_BUDGET // stage_bytes))


def moe_decode(
    hidden_sum: torch.Tensor,  # [T, H]: the residual stream after attention (the post-attention norm's input)
    norm_weight: torch.Tensor,  # [H]: the post-attention RMSNorm's weight
    eps: float,
    router_logits: torch.Tensor,  # [T, E] (any float dtype; unit stride in E)
    w13: torch.Tensor,  # [E_local, 2I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor,  # [E_local, H, I]
    top_k: int,
    renormalize: bool,
    *,
    expert_start: int | None = None,
    store: torch.Tensor | None = None,  # [S, L, k] int32 routing store
    slots: torch.Tensor | None = None,  # [T] int64 KV slots (negative: not recorded)
    layer: int = 0,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out [T, H] in hidden_sum's dtype, weights [T, k] float32, ids [T, k] int32): the sparse block of
    rms_norm(hidden_sum) routed by `router_logits` (see the module docstring); with `store`, row t's ids also
    go to store[slots[t], layer]. Without `expert_start` w13 holds every expert of the logits; with it
    (an int >= 0) experts [expert_start, expert_start + E_local)."""
    if hidden_sum.dim() != 2 or hidden_sum.dtype not in (torch.float16, torch.bfloat16, torch.float32) \
            or hidden_sum.stride(1) != 1:
        raise ValueError(f"hidden_sum must be [T, H] float, contiguous in H; got {hidden_sum.dtype} "
                         f"{tuple(hidden_sum.shape)}")
    tokens, hidden = hidden_sum.shape
    dtype, device = hidden_sum.dtype, hidden_sum.device
    if norm_weight.shape != (hidden,) or norm_weight.dtype != dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be [{hidden}] {dtype}, contiguous; got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    if router_logits.dim() != 2 or router_logits.shape[0] != tokens or router_logits.stride(1) != 1 \
            or not router_logits.dtype.is_floating_point:
        raise ValueError(f"router_logits must be [{tokens}, E] float, unit stride in E; got "
                         f"{router_logits.dtype} {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"router_logits must have 1..{MAX_EXPERTS} experts; got {num_experts}")
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden or w13.dtype != dtype or w13.stride(2) != 1:
        raise ValueError(f"w13 must be [E, 2 * I, {hidden}] {dtype}, contiguous in H; got {w13.dtype} "
                         f"{tuple(w13.shape)}")
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_local, hidden, inter) or w2.dtype != dtype or w2.stride(2) != 1:
        raise ValueError(f"w2 must be [{num_local}, {hidden}, {inter}] {dtype}, contiguous in I; got {w2.dtype} "
                         f"{tuple(w2.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}]; got {top_k}")
    if expert_start is None:
        if num_local != num_experts:
            raise ValueError(f"w13 must hold all {num_experts} experts of router_logits without expert_start; "
                             f"got {num_local}")
    elif not 0 <= expert_start <= num_experts - num_local:
        raise ValueError(f"expert_start must be in [0, {num_experts - num_local}]; got {expert_start}")
    if len({t.device for t in (norm_weight, router_logits, w13, w2)} | {device}) != 1:
        raise ValueError("hidden_sum, norm_weight, router_logits, w13 and w2 must be on one device")
    with_store = store is not None
    if with_store:
        assert store.dtype == torch.int32 and store.is_contiguous() and store.shape[2] == top_k, store.shape
        assert slots is not None and slots.shape == (tokens,), "slots [T] go with the store"
        assert 0 <= layer < store.shape[1], layer
    cfg = config or DecodeConfig()
    out = torch.empty(tokens, hidden, dtype=dtype, device=device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    if tokens == 0:
        return out, weights, ids
    act = torch.empty(tokens * top_k, inter, dtype=dtype, device=device)  # [T * k, I]
    item, ieee = hidden_sum.element_size(), dtype == torch.float32
    block_m = 16  # the smallest MMA tile: row 0 is the pair's
    up_n = min(cfg.up_block_n, max(16, triton.next_power_of_2(inter)))
    up_k = min(cfg.up_block_k, max(16, triton.next_power_of_2(hidden)))
    start = 0 if expert_start is None else expert_start
    _decode_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, up_n))](
        hidden_sum, norm_weight, router_logits, w13, act, ids, weights,
        store if with_store else ids, slots if with_store else ids,
        hidden, inter, num_experts, num_local, start, float(eps),
        hidden_sum.stride(0), router_logits.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        store.shape[1] * top_k if with_store else 0, layer * top_k,
        TOP_K=top_k, BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_KK=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, STORE=with_store,
        LOCAL=expert_start is not None, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=up_n, BLOCK_K=up_k,
        num_warps=cfg.num_warps, num_stages=_stages(cfg.up_stages, (block_m + 2 * up_n) * up_k * item),
    )
    k_pad = triton.next_power_of_2(top_k)
    down_n = min(max(1, cfg.down_columns // k_pad), triton.next_power_of_2(hidden))
    down_n = max(down_n, triton.cdiv(16, k_pad))  # the MMA's N: at least 16 columns
    down_k = min(cfg.down_block_k, max(16, triton.next_power_of_2(inter)))
    down_m = max(16, k_pad)
    _decode_down_kernel[(tokens, triton.cdiv(hidden, down_n))](
        act, w2, ids, weights, out,
        hidden, inter, num_local, start, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, K_PAD=k_pad, IEEE=ieee, BLOCK_M=down_m, BLOCK_N=down_n, BLOCK_K=down_k,
        num_warps=cfg.num_warps, num_stages=_stages(cfg.down_stages, (down_m + k_pad * down_n) * down_k * item),
    )
    return out, weights, ids
