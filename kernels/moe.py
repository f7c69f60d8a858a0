"""Fused Mixture-of-Experts feed-forward layer in Triton (the CUDA path of `kernels/moe_ref.py`).

One `fused_moe` call is four launches of static grids (at most five), with no host sync, so it can be
captured in a CUDA graph at any token count:

1. `moe_align_block_size` (skipped for at most `ROW_BLOCK_ROWS` rows: each row is then a block of its
   own): the T * k (token, j) rows sorted by expert — stable, so each expert's rows
   keep their order — and each expert's run padded to a multiple of BLOCK_M with the sentinel T * k; also
   the expert of every block and the padded count. One launch for small T * k, two (per-chunk counts,
   then placement) for more. Sizes are static: T * k + min(E, T * k) * (BLOCK_M - 1) slots, rounded up to
   whole blocks; the blocks past the padded count exit at once.
2. gate_up: a grouped GEMM, one expert per block of rows, x[t] @ w13[e]^T with a gate and an up
   accumulator per tile; the epilogue writes silu(gate) * up: act [T * k, I].
3. down: a grouped GEMM act @ w2[e]^T whose epilogue multiplies each row by its routing weight:
   z [T * k, H] (row t * k + j).
4. the combine: out[t] = sum over j = 0..k-1, in that order, of z[t * k + j], in float32 (no atomics).

Numerics: float32 accumulation; gate and up are rounded to the activation dtype before SiLU-and-mul,
which follows `kernels/activation.py`; the down GEMM rounds (acc * weight) to the activation dtype once
(the reference rounds acc, then multiplies in float32); the combine rounds once. So the result agrees with
the reference to GEMM-summation-order error: float32 about 1e-5 relative, bfloat16 a few ulps.

Tile configs come from `moe_config` per shape: BLOCK_M by the average rows per expert (16 for decode up
to 128 for long prefills), BLOCK_N / BLOCK_K by the GEMM's N and K. `deterministic=True` takes one fixed
config whatever the row count, and no kernel here splits K, so a row's reduction order depends on the
model's widths alone: each token's output is bitwise independent of the other tokens and of T (the MMA
computes an output row from that row of A and the weight only; padding rows are zeros that are never
stored).

Expert parallelism (`expert_start=s`: the weights are experts [s, s + E) of a larger set, topk_ids global):
the ids are shifted by s on the device, the alignment leaves out the rows whose shifted id is outside
[0, E), the row-block GEMMs skip such rows' blocks, and the combine leaves their (never written) z rows
out of the sum, so they contribute exactly 0; no host sync either way. Not here: the router, shared experts,
the communication of expert parallelism, quantized weights, split-K.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.moe_ref import MAX_EXPERTS, check_moe_args

_TILE_ELEMENTS = 8192  # elements of the [rows, experts] tiles of the alignment kernels (registers of 4 warps)
_MAX_CHUNKS = 128  # programs of the counting pass; each placement program reads every chunk's counts
_SMEM_BUDGET = 144 * 1024  # bytes of pipelined operand tiles; fits the A100's 164 KiB with room to spare
_COMBINE_BLOCK = 512
ROW_BLOCK_ROWS = 16
"""At most this many (token, j) rows skip the alignment: each row is its own block (the k experts of one token
are distinct, so at batch 1 no expert's weights are read twice; beyond about two tokens, repeats among the
rows would cost more weight reads than the alignment launch saves)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """Tile config of one grouped GEMM launch."""

    block_m: int
    """Rows (sorted (token, j) pairs) per block; every block holds one expert's rows. Both GEMMs of a call
    share it, since it fixes the alignment."""
    block_n: int
    """Output columns per program (for gate_up: gate columns, with as many up columns beside them)."""
    block_k: int
    """Reduction step; with the MMA shape it fixes each output element's summation order."""
    group_m: int
    """Row blocks that share a column tile in launch order (L2 reuse of the weight tile)."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipelining depth of the operand loads."""


# BLOCK_M by the average rows per expert: (upper bound of that average, block_m, block_n, block_k, group_m, warps)
_CLASSES = ((8, 16, 64, 128, 1, 4), (16, 32, 128, 128, 1, 4), (32, 64, 128, 64, 8, 4), (None, 128, 128, 64, 8, 8))
_DETERMINISTIC = (64, 64, 64, 8, 4)  # block_m, block_n, block_k, group_m, warps: fixed, whatever the rows
MAX_BLOCK_M = max(max(c[1] for c in _CLASSES), _DETERMINISTIC[0])


def moe_config(num_experts: int, n: int, k: int, m: int, *, fused_gate_up: bool = False, itemsize: int = 2,
               deterministic: bool = False) -> MoeConfig:
    """The tile config of a grouped GEMM with `num_experts` experts, `n` output columns (for the gate_up
    GEMM: I, the width after SiLU-and-mul, with `fused_gate_up=True`: a program then loads a gate and an
    up weight tile), reduction width `k` and `m` rows (T * top_k), for elements of `itemsize` bytes.
    block_m depends on (num_experts, m) only, so the two GEMMs of a call agree on it; with
    `deterministic=True` nothing depends on m."""
    if deterministic:
        block_m, block_n, block_k, group_m, warps = _DETERMINISTIC
    else:
        per_expert = m / max(1, min(num_experts, m))
        _, block_m, block_n, block_k, group_m, warps = next(c for c in _CLASSES if c[0] is None or per_expert <= c[0])
    if fused_gate_up:
        block_n //= 2  # the program's gate and up tiles together are as wide as the plain GEMM's
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    stage_bytes = (block_m * block_k + (2 if fused_gate_up else 1) * block_k * block_n) * itemsize
    stages = max(2, min(4, _SMEM_BUDGET // stage_bytes))
    return MoeConfig(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m, num_warps=warps,
                     num_stages=stages)


@triton.jit
def _expert_histogram(ids_ptr, start, end, numel, num_experts, SUB: tl.constexpr, E_PAD: tl.constexpr):
    """Rows per expert among flat rows [start, end) (rows past numel and ids outside [0, E) count nowhere)."""
    experts = tl.arange(0, E_PAD)
    hist = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(start, end, SUB):
        offs = s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)
        hist += tl.sum(hit.to(tl.int32), 0)
    return hist


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, numel, num_experts, chunk, SUB: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    hist = _expert_histogram(ids_ptr, pid * chunk, pid * chunk + chunk, numel, num_experts, SUB, E_PAD)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit
def _moe_align_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    numel, num_experts, block_m, chunk, num_chunks, num_slots, num_blocks,
    COUNTED: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, E_PAD: tl.constexpr,
):
    """Program p places the rows of chunk p (if any), fills padding slots [p * SUB, (p + 1) * SUB) and
    writes the experts of blocks [p * SUB, (p + 1) * SUB)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)  # rows per expert
    before = tl.zeros([E_PAD], dtype=tl.int32)  # rows per expert in the chunks before this program's
    if COUNTED:  # the counting pass wrote one row of counts per chunk
        for c0 in range(0, num_chunks, ROWS):
            crow = c0 + tl.arange(0, ROWS)
            tile = tl.load(counts_ptr + crow[:, None] * E_PAD + experts[None, :], mask=(crow < num_chunks)[:, None],
                           other=0)
            total += tl.sum(tile, 0)
            before += tl.sum(tl.where((crow < pid)[:, None], tile, 0), 0)
    else:  # one chunk, few rows: every program counts them all
        total = _expert_histogram(ids_ptr, 0, chunk, numel, num_experts, SUB, E_PAD)
    padded = (total + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, 0)  # [E_PAD]: end of each expert's padded run
    starts = ends - padded
    filled = starts + total  # end of each expert's real rows
    num_padded = tl.sum(padded, 0)
    if pid == 0:
        tl.store(num_padded_ptr, num_padded)
    if pid < num_chunks:
        running = starts + before  # next free slot of each expert
        for s in range(pid * chunk, pid * chunk + chunk, SUB):
            offs = s + tl.arange(0, SUB)
            ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
            hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)  # [SUB, E_PAD]
            hits = hit.to(tl.int32)
            rank = tl.cumsum(hits, 0)  # 1 + earlier rows of the same expert in this step
            slot = tl.sum(tl.where(hit, running[None, :] + rank - 1, 0), 1)
            tl.store(sorted_ptr + slot, offs, mask=tl.sum(hits, 1) > 0)
            running += tl.sum(hits, 0)
    slots = pid * SUB + tl.arange(0, SUB)
    real = (starts[None, :] <= slots[:, None]) & (slots[:, None] < filled[None, :])
    pad = (tl.sum(real.to(tl.int32), 1) == 0) & (slots < num_slots)
    tl.store(sorted_ptr + slots, tl.zeros([SUB], dtype=tl.int32) + numel, mask=pad)
    blocks = pid * SUB + tl.arange(0, SUB)
    first = blocks * block_m
    owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)  # experts whose runs end before the block
    tl.store(block_experts_ptr + blocks, tl.where(first < num_padded, owner, -1), mask=blocks < num_blocks)


def _num_slots(rows: int, num_experts: int, block_m: int) -> int:
    """Static size of the sorted-row array: enough for any routing of `rows` rows."""
    return triton.cdiv(rows + min(num_experts, rows) * (block_m - 1), block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 / int64 -> (sorted_ids [S] int32, block_experts [S // block_m] int32,
    num_padded [1] int32), S = T*k + min(E, T*k) * (block_m - 1) rounded up to a multiple of block_m.

    sorted_ids[:num_padded] lists the flat rows t * k + j grouped by expert in expert order, each expert's
    rows in ascending order, each group padded to a multiple of block_m with T * k; the slots past
    num_padded hold T * k too. block_experts[b] is the expert of block b, or -1 past num_padded. Rows
    whose id is outside [0, num_experts) are left out (never read past the weights); values are not
    checked, since that would sync the host."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T, k] int32 or int64; got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}]; got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be positive; got {block_m}")
    ids = topk_ids.reshape(-1)  # [T * k]
    numel, device = ids.numel(), ids.device
    num_slots = _num_slots(numel, num_experts, block_m)
    num_blocks = num_slots // block_m
    sorted_ids = torch.empty(num_slots, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if numel == 0:
        return sorted_ids, block_experts, torch.zeros(1, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)  # written by the first program
    e_pad = max(16, triton.next_power_of_2(num_experts))
    sub = min(256, max(16, _TILE_ELEMENTS // e_pad))
    counted = numel > 4 * sub
    chunk = sub * triton.cdiv(triton.cdiv(numel, sub), _MAX_CHUNKS) if counted else triton.cdiv(numel, sub) * sub
    num_chunks = triton.cdiv(numel, chunk)
    counts = sorted_ids  # not read unless counted
    if counted:
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)  # [chunks, E_PAD]
        _moe_count_kernel[(num_chunks,)](ids, counts, numel, num_experts, chunk, SUB=sub, E_PAD=e_pad, num_warps=4)
    grid = (max(num_chunks, triton.cdiv(num_slots, sub)),)
    _moe_align_kernel[grid](
        ids, counts, sorted_ids, block_experts, num_padded,
        numel, num_experts, block_m, chunk, num_chunks, num_slots, num_blocks,
        COUNTED=counted, SUB=sub, ROWS=max(1, _TILE_ELEMENTS // e_pad), E_PAD=e_pad, num_warps=4,
    )
    return sorted_ids, block_experts, num_padded


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    n, k, num_rows, a_row_div, num_m_blocks, num_experts, stride_am, stride_be, stride_bn, stride_cm,
    SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c[r, cols] for the sorted rows r of one block (one expert e) and one column tile:
    a[r // a_row_div] @ b[e, cols]^T, then silu(gate) * up (gate columns cols, up columns n + cols) or a
    multiply by weights[r]. a, b are contiguous in k. With ROW_BLOCKS (few rows: no alignment) block b holds
    the one row b, of expert block_experts[b] (the flat topk_ids), and the sorted arrays are not read; a row
    whose expert is outside [0, num_experts) is skipped (its c row is not written)."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(n, BLOCK_N)
    in_group = GROUP_M * num_n_blocks
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if ROW_BLOCKS:
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_rows)  # [BLOCK_M]: row pid_m, then padding
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] flat (token, j) rows
    row_ok = rows < num_rows
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if ROW_BLOCKS:
        if (expert < 0) | (expert >= num_experts):
            return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // a_row_div).to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = offs_k < k - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if SILU_MUL:
            b_up = tl.load(b_ptrs + n * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = c_ptr.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (silu * up).to(dtype)
    elif MUL_WEIGHT:
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
        out = (acc * weight[:, None]).to(dtype)
    else:
        out = acc.to(dtype)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(z_ptr, ids_ptr, out_ptr, hidden, top_k, num_experts, stride_z, stride_o,
                        BLOCK: tl.constexpr, LOCAL: tl.constexpr):
    """out[t] = sum over j of z[t * k + j]; with LOCAL only the j whose id ids[t * k + j] (shifted to the
    rank's range) is in [0, num_experts): the other z rows were never written."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):  # the fixed order j = 0..k-1
        ok = mask
        if LOCAL:
            expert = tl.load(ids_ptr + token * top_k + j + tl.zeros([BLOCK], dtype=tl.int64))  # [BLOCK], one value
            ok = mask & (expert >= 0) & (expert < num_experts)
        acc += tl.load(z_ptr + (token * top_k + j) * stride_z + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _grouped_gemm(a, b, c, weights, sorted_ids, block_experts, num_padded, *, n, a_row_div, silu_mul, cfg):
    """sorted_ids None: one block per row (`block_experts` = the flat expert ids)."""
    row_blocks = sorted_ids is None
    num_m_blocks = block_experts.numel() if row_blocks else sorted_ids.numel() // cfg.block_m
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, block_experts if row_blocks else sorted_ids, block_experts,
        block_experts if row_blocks else num_padded,
        n, a.shape[1], c.shape[0], a_row_div, num_m_blocks, b.shape[0], a.stride(0), b.stride(0), b.stride(1),
        c.stride(0),
        SILU_MUL=silu_mul, MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32, ROW_BLOCKS=row_blocks,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I) of every expert
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32 / int64 in [0, E)
    *,
    deterministic: bool = False,
    expert_start: int | None = None,
) -> torch.Tensor:
    """-> [T, H] in x's dtype: out[t] = sum over j = 0..k-1 of topk_weights[t, j] * (expert topk_ids[t, j]'s
    SwiGLU MLP of x[t]); see the module docstring. x, w13 and w2 must be contiguous in their last
    dimension. Without `expert_start`, topk_ids outside [0, E) are not checked (that would sync the host):
    their terms are undefined, but no memory outside the tensors is read. With `expert_start=s` (an int >= 0),
    the weights are experts [s, s + E) and the terms of pairs routed to any other id are exactly 0."""
    local = expert_start is not None
    check_moe_args(x, w13, w2, topk_weights, topk_ids, local=local)
    if local and expert_start < 0:
        raise ValueError(f"expert_start must be >= 0; got {expert_start}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 must be contiguous in their last dimension")
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    rows = tokens * top_k
    cfg_up = moe_config(experts, inter, hidden, rows, fused_gate_up=True, itemsize=x.element_size(),
                        deterministic=deterministic)
    cfg_down = moe_config(experts, hidden, inter, rows, itemsize=x.element_size(), deterministic=deterministic)
    assert cfg_up.block_m == cfg_down.block_m
    if local:
        topk_ids = topk_ids - expert_start  # [T, k]: ids in the rank's numbering; others fall outside [0, E)
    if rows <= ROW_BLOCK_ROWS:  # decode at batch 1-2: a block per row, no alignment launch
        sorted_ids, block_experts, num_padded = None, topk_ids.reshape(-1), None
    else:
        sorted_ids, block_experts, num_padded = moe_align_block_size(topk_ids, experts, cfg_up.block_m)
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
    _grouped_gemm(x, w13, act, None, sorted_ids, block_experts, num_padded, n=inter, a_row_div=top_k,
                  silu_mul=True, cfg=cfg_up)
    z = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)  # [T * k, H]: weighted expert outputs
    _grouped_gemm(act, w2, z, topk_weights.reshape(-1), sorted_ids, block_experts, num_padded, n=hidden,
                  a_row_div=1, silu_mul=False, cfg=cfg_down)
    grid = (tokens, triton.cdiv(hidden, _COMBINE_BLOCK))
    _moe_combine_kernel[grid](z, topk_ids.reshape(-1), out, hidden, top_k, experts, z.stride(0), out.stride(0),
                              BLOCK=_COMBINE_BLOCK, LOCAL=local, num_warps=4)
    return out


def moe_workspace_bytes(max_tokens: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    """An upper bound of the bytes one `fused_moe` call with up to `max_tokens` tokens allocates, its [T, H]
    output included: act and z exactly, the sorted-row arrays for the worst routing (every row its own
    expert) and the largest BLOCK_M, the per-chunk counts for the most experts."""
    if min(max_tokens, top_k, hidden, intermediate) < 0:
        raise ValueError("max_tokens, top_k, hidden and intermediate must be non-negative")
    item = torch.empty((), dtype=dtype).element_size()
    rows = max_tokens * top_k
    activations = rows * (intermediate + hidden) * item + max_tokens * hidden * item  # act, z, out
    routing = rows * (MAX_BLOCK_M + 1) * 4 + 4 + _MAX_CHUNKS * MAX_EXPERTS * 4  # sorted ids, block experts, counts
    flattened = rows * (8 + 8 + 4)  # topk_ids / topk_weights copies when not contiguous, the shifted ids (EP)
    return activations + routing + flattened
