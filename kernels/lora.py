"""Many LoRA adapters in one batch in Triton (the CUDA path of `kernels/lora_ref.py`, whose docstring states the
contract: the slot stacks A [S, R, in] / B [S, N, r_max], the slices of a fused output, the numerics).

Punica's segmented idea (SGMV): the tokens of a step are sorted by adapter slot once (`lora_batch`, shared by
every layer of the step), cut into tiles of `BLOCK_M` tokens of one slot, and each tile is a small GEMM
against its slot's weights, so tokens of one adapter read its weights once per tile and a batch of many
adapters is one launch per matmul. Two kernels per fused layer:

  - shrink: y = x @ A[slot]^T, float32 sums, the `in` axis cut into a fixed number of splits (one program
    each: decode has few tiles, so the splits are the parallelism); each split writes its partial sum.
  - expand: the partials summed in split order, rounded to the weights' dtype, times B[slot]^T (float32
    sums), scaled, added to the base output in float32 and rounded once. One program per (tile, column
    block, slice); the slices of a fused output (q|k|v, gate|up; at most three) each read their own rows of
    y and of B.

Tiles past the batch's last one exit at once, and so do tiles of tokens without an adapter (-1), reading no
weights: the shrink writes their rows of y as zeros, the expand leaves their output rows alone (or zeroes
them when it replaces rather than accumulates). The grid depends on T and S only, nothing is read back to
the host and `lora_batch` is torch ops on the device: all of it can be captured in a CUDA graph and
replayed with new slot assignments.

Batch invariance: a token's arithmetic is fixed by the shapes alone. The tile height (BLOCK_M = 16, under
the 64 rows Hopper's wgmma needs, so the dot is the same mma.sync on sm_90 as on sm_80 at every batch
size), the K chunks and the number of splits of the shrink, the rank chunks of the expand and the order of
the partials never depend on T; a row of a tile's GEMM depends on that row alone. What depends on T
(`_expand_block_n`: wider column blocks for prefill) only partitions the output columns. So a token gets
the same bits alone, in a decode batch of 256 or in a prefill chunk, whichever adapters share the batch.

Not here: the base GEMM, LoRA on embeddings or the LM head, DoRA and other variants, autograd, tensor
parallelism (the caller passes its shard's stacks: B's rows of a column-parallel layer; A's columns of a
row-parallel one, whose partial delta added before the all-reduce sums to the full one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per tile; part of the numerics contract (see the module docstring)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SLICES = 3
_SPLIT_K_CHUNK = 512  # in-features per shrink split (at most _MAX_SPLIT_K splits)
_MAX_SPLIT_K = 8
_DECODE_TOKENS = 64  # up to this many tokens: the decode column blocks


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's tokens sorted into tiles of one adapter slot each (built by `lora_batch` on the device)."""

    idx: torch.Tensor  # [T] int32: each token's slot, -1 for none
    order: torch.Tensor  # [T] int32: token ids sorted by slot (stable); tokens without a slot last
    tile_start: torch.Tensor  # [max_tiles] int32: each tile's first position in `order`
    tile_len: torch.Tensor  # [max_tiles] int32: tokens in the tile, 0 for an unused tile
    tile_slot: torch.Tensor  # [max_tiles] int32: the tile's slot, -1 for tokens without one
    num_slots: int  # S, the number of slots of the stacks it is used with

    @property
    def num_tokens(self) -> int:
        return self.idx.shape[0]


def lora_batch(idx: torch.Tensor, num_slots: int) -> LoraBatch:
    """The tiles of a step's slot assignment idx [T] (int32 or int64; -1: no adapter) for stacks of
    `num_slots` slots. Values outside [-1, num_slots) count as no adapter (the kernels never read outside the
    stacks). No host synchronisation; the number of tiles, cdiv(T, BLOCK_M) + min(S + 1, T), is a function of
    T and S, so the result can be built inside a captured CUDA graph."""
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be a [T] int32 or int64 tensor; got {idx.dtype} {tuple(idx.shape)}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    n, dev = idx.shape[0], idx.device
    max_tiles = triton.cdiv(n, BLOCK_M) + min(num_slots + 1, n)
    key = torch.where((idx >= 0) & (idx < num_slots), idx.long(), num_slots)  # [T]; S: no adapter
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    seg_end = counts.cumsum(0)  # [S + 1]: end of each slot's tokens in `order`
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # [S + 1]
    tiles_end = tiles.cumsum(0)  # [S + 1]
    j = torch.arange(max_tiles, device=dev)
    seg = torch.searchsorted(tiles_end, j, right=True)  # [max_tiles]: the slot of tile j; S + 1 past the last
    seg_c = seg.clamp(max=num_slots)
    start = seg_end[seg_c] - counts[seg_c] + (j - tiles_end[seg_c] + tiles[seg_c]) * BLOCK_M
    length = torch.where(seg <= num_slots, (seg_end[seg_c] - start).clamp(0, BLOCK_M), 0)
    slot = torch.where(seg_c == num_slots, -1, seg_c)
    return LoraBatch(idx=idx.to(torch.int32), order=order, tile_start=start.clamp(0, max(n - 1, 0)).to(torch.int32),
                     tile_len=length.to(torch.int32), tile_slot=slot.to(torch.int32), num_slots=num_slots)


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, y_ptr, order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr, rows, in_features,
                        k_per_split, stride_xt, stride_as, stride_ar, stride_yp, stride_yt,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    length = tl.load(tile_len_ptr + tile)
    if length == 0:
        return
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    mmask = m < length
    tok = tl.load(order_ptr + tl.load(tile_start_ptr + tile) + m, mask=mmask, other=0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    split = tl.program_id(2).to(tl.int64)
    y_ptrs = y_ptr + split * stride_yp + tok[:, None] * stride_yt + r[None, :]
    ymask = mmask[:, None] & rmask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if slot < 0:  # tokens without an adapter: zero rows
        tl.store(y_ptrs, acc, mask=ymask)
        return
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    kk0 = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot * stride_as + r[None, :] * stride_ar
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + kk0
        kmask = kk < k_hi
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_base + kk[:, None], mask=rmask[None, :] & kmask[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
        acc = tl.dot(xt, at, acc, input_precision="ieee")
    tl.store(y_ptrs, acc, mask=ymask)


@triton.jit
def _lora_expand_kernel(y_ptr, b_ptr, out_ptr, scaling_ptr, order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
                        rank, width0, width1, width2, stride_yp, stride_yt, stride_bs, stride_bn, stride_ot,
                        NUM_PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, ACCUMULATE: tl.constexpr):
    tile = tl.program_id(0)
    length = tl.load(tile_len_ptr + tile)
    if length == 0:
        return
    sl = tl.program_id(2)
    width = tl.where(sl == 0, width0, tl.where(sl == 1, width1, width2))
    if tl.program_id(1) * BLOCK_N >= width:  # a column block past a narrower slice's end
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < width
    cols = tl.where(sl >= 1, width0, 0) + tl.where(sl >= 2, width1, 0) + n  # columns of the fused output
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    mmask = m < length
    tok = tl.load(order_ptr + tl.load(tile_start_ptr + tile) + m, mask=mmask, other=0).to(tl.int64)
    out_ptrs = out_ptr + tok[:, None] * stride_ot + cols[None, :]
    omask = mmask[:, None] & nmask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if slot < 0:  # tokens without an adapter: nothing to add; zeros when replacing
        if not ACCUMULATE:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
        return
    y_base = y_ptr + tok[:, None] * stride_yt + sl * rank
    b_base = b_ptr + slot * stride_bs + cols[None, :] * stride_bn
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rmask = rr < rank
        ymask = mmask[:, None] & rmask[None, :]
        yt = tl.load(y_base + rr[None, :], mask=ymask, other=0.0)  # [BLOCK_M, BLOCK_R] float32
        for p in tl.static_range(1, NUM_PARTIALS):  # the shrink's splits, summed in order
            yt += tl.load(y_base + p * stride_yp + rr[None, :], mask=ymask, other=0.0)
        bt = tl.load(b_base + rr[:, None], mask=rmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        acc = tl.dot(yt.to(bt.dtype), bt, acc, input_precision="ieee")
    acc = acc * tl.load(scaling_ptr + slot)
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def _block_r(n: int) -> int:
    return min(64, max(16, triton.next_power_of_2(n)))


def _expand_block_n(num_tokens: int) -> int:
    """Output columns per expand program: narrow for decode (more programs over few tiles), wide for prefill.
    Only partitions the columns (see the module docstring)."""
    return 64 if num_tokens <= _DECODE_TOKENS else 128


def _shrink_split(in_features: int, block_k: int) -> tuple[int, int]:
    """(splits, in-features per split) of the shrink: a function of the layer's width only."""
    per = triton.cdiv(triton.cdiv(in_features, min(_MAX_SPLIT_K, triton.cdiv(in_features, _SPLIT_K_CHUNK))),
                      block_k) * block_k
    return triton.cdiv(in_features, per), per


def _as_batch(lora: torch.Tensor | LoraBatch, num_tokens: int, num_slots: int) -> LoraBatch:
    batch = lora if isinstance(lora, LoraBatch) else lora_batch(lora, num_slots)
    if batch.num_tokens != num_tokens or batch.num_slots != num_slots:
        raise ValueError(f"the slot assignment is for {batch.num_tokens} tokens and {batch.num_slots} slots; "
                         f"the tensors have {num_tokens} tokens and {num_slots} slots")
    return batch


def _check_x_a(x: torch.Tensor, A: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, in] of {_DTYPES} with unit stride in `in`; got {x.dtype} {tuple(x.shape)}")
    if A.dim() != 3 or A.dtype != x.dtype or A.shape[2] != x.shape[1] or A.stride(2) != 1:
        raise ValueError(f"A must be [S, R, {x.shape[1]}] {x.dtype} with unit stride in `in`; got {A.dtype} "
                         f"{tuple(A.shape)}")
    if A.device != x.device:
        raise ValueError("x and A must be on one device")


def _check_expand(B: torch.Tensor, scaling: torch.Tensor, out: torch.Tensor,
                  slices: tuple[int, ...] | None) -> tuple[int, ...]:
    """The slices, after checking B, scaling and out against each other."""
    if B.dim() != 3 or B.dtype not in _DTYPES or B.stride(2) != 1:
        raise ValueError(f"B must be [S, N, r_max] of {_DTYPES} with unit stride in r_max; got {B.dtype} "
                         f"{tuple(B.shape)}")
    num_slots, n, r_max = B.shape
    slices = (n,) if slices is None else tuple(int(w) for w in slices)
    if not 1 <= len(slices) <= _MAX_SLICES or min(slices) < 1 or sum(slices) != n:
        raise ValueError(f"slices must be 1 to {_MAX_SLICES} positive widths summing to B's N = {n}; got {slices}")
    if out.dim() != 2 or out.shape[1] != n or out.dtype != B.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [T, {n}] {B.dtype} with unit stride in N; got {out.dtype} {tuple(out.shape)}")
    if scaling.shape != (num_slots,) or scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be [{num_slots}] float32; got {scaling.dtype} {tuple(scaling.shape)}")
    if not B.device == scaling.device == out.device:
        raise ValueError("B, scaling and out must be on one device")
    return slices


def _shrink_partials(x: torch.Tensor, A: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """[splits, T, R] float32 partial sums of y (every split's rows of tokens without a slot are zeros)."""
    num_tokens, in_features = x.shape
    rows = A.shape[1]
    block_k = 32 if x.dtype == torch.float32 else 64
    splits, per_split = _shrink_split(in_features, block_k)
    partials = torch.empty(splits, num_tokens, rows, dtype=torch.float32, device=x.device)
    block_r = _block_r(rows)
    grid = (batch.tile_len.shape[0], triton.cdiv(rows, block_r), splits)
    _lora_shrink_kernel[grid](x, A, partials, batch.order, batch.tile_start, batch.tile_len, batch.tile_slot, rows,
                              in_features, per_split, x.stride(0), A.stride(0), A.stride(1), partials.stride(0),
                              partials.stride(1), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return partials


def _expand(partials: torch.Tensor, B: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor, out: torch.Tensor,
            slices: tuple[int, ...], accumulate: bool) -> None:
    """partials [P, T, R] (summed in order) -> out, as `lora_expand`."""
    rank = B.shape[2]
    block_n = _expand_block_n(out.shape[0])
    widths = slices + (0,) * (_MAX_SLICES - len(slices))
    grid = (batch.tile_len.shape[0], triton.cdiv(max(slices), block_n), len(slices))
    _lora_expand_kernel[grid](partials, B, out, scaling, batch.order, batch.tile_start, batch.tile_len,
                              batch.tile_slot, rank, *widths, partials.stride(0), partials.stride(1), B.stride(0),
                              B.stride(1), out.stride(0), NUM_PARTIALS=partials.shape[0], BLOCK_M=BLOCK_M,
                              BLOCK_N=block_n, BLOCK_R=_block_r(rank), ACCUMULATE=accumulate, num_warps=4)


def lora_shrink(x: torch.Tensor, A: torch.Tensor, lora: torch.Tensor | LoraBatch) -> torch.Tensor:
    """x [T, in], A [S, R, in] (x's dtype), lora: idx [T] or its `lora_batch` -> y [T, R] float32:
    y[t] = A[idx[t]] @ x[t], zeros for tokens without a slot."""
    _check_x_a(x, A)
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    if x.shape[0] == 0:
        return torch.zeros(0, A.shape[1], dtype=torch.float32, device=x.device)
    partials = _shrink_partials(x, A, batch)
    y = partials[0]
    for p in range(1, partials.shape[0]):  # in split order: the expand kernel's sum of the same partials
        y += partials[p]
    return y


def lora_expand(y: torch.Tensor, B: torch.Tensor, lora: torch.Tensor | LoraBatch, scaling: torch.Tensor,
                out: torch.Tensor, accumulate: bool = True, *, slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """y [T, R] float32 (R = num_slices * r_max), B [S, N, r_max], lora: idx [T] or its `lora_batch`,
    scaling [S] float32, out [T, N] (B's dtype): each token's slice j of `out` gets
    scaling[slot] * y[t, j * r_max:(j + 1) * r_max] @ B[slot, slice j]^T, added in place (`accumulate`) or
    written in place of it (rows without a slot then zeroed). `slices`: the output widths of a fused layer,
    (N,) when None. Returns out."""
    slices = _check_expand(B, scaling, out, slices)
    rows = len(slices) * B.shape[2]
    if y.shape != (out.shape[0], rows) or y.dtype != torch.float32 or y.stride(1) != 1 or y.device != out.device:
        raise ValueError(f"y must be [{out.shape[0]}, {rows}] float32 (num_slices * r_max) with unit stride on "
                         f"{out.device}; got {y.dtype} {tuple(y.shape)} on {y.device}")
    batch = _as_batch(lora, out.shape[0], B.shape[0])
    if out.shape[0]:
        _expand(y.unsqueeze(0), B, batch, scaling, out, slices, accumulate)
    return out


def add_lora(out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, lora: torch.Tensor | LoraBatch,
             scaling: torch.Tensor, *, slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """out [T, N] (the base layer's output) += each token's scaled LoRA delta: `lora_shrink` then `lora_expand`
    in two launches, the shrink's partial sums read by the expand directly (bitwise the same as the two
    calls). x [T, in], A [S, R, in], B [S, N, r_max], scaling [S] float32, all but scaling in one dtype.
    Returns out."""
    _check_x_a(x, A)
    slices = _check_expand(B, scaling, out, slices)
    if B.shape[0] != A.shape[0] or B.dtype != x.dtype or A.shape[1] != len(slices) * B.shape[2]:
        raise ValueError(f"A [S, num_slices * r_max, in] and B [S, N, r_max] must agree in S, r_max and dtype; got "
                         f"A {A.dtype} {tuple(A.shape)}, B {B.dtype} {tuple(B.shape)}, {len(slices)} slices")
    if out.shape[0] != x.shape[0] or out.device != x.device:
        raise ValueError(f"out must have x's {x.shape[0]} rows on x's device; got {tuple(out.shape)} on {out.device}")
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    if x.shape[0]:
        _expand(_shrink_partials(x, A, batch), B, batch, scaling, out, slices, True)
    return out
