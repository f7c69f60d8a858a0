"""Many LoRA adapters in one batch in Triton (the CUDA path of `kernels/lora_ref.py`, whose docstring states the
contract: the slot stacks A [S, R, in] / B [S, N, r_max], the slices of a fused output, the numerics).

Punica's segmented idea (SGMV): the tokens of a step are sorted by adapter slot once (`lora_batch`, one launch,
shared by every layer of the step) and cut into tiles of `BLOCK_M` tokens of one slot; each tile is a small GEMM
against its slot's weights, so tokens of one adapter read its weights once per tile and a batch of many adapters
is one launch per matmul. Only tokens with an adapter get tiles: the number of tiles (`LoraBatch.num_tiles`, on
the device) is what the kernels loop over, so their grids depend on T and the layer's shape, not on the number
of slots, and a step whose tokens have few adapters launches few working programs. Two kernels per fused layer:

  - shrink: y = x @ A[slot]^T, float32 sums, the `in` axis cut into a fixed number of splits. One program per
    (split, tile group); a group's programs take the tiles g, g + groups, ... below `num_tiles`. Each split
    writes its partial sum; the last split of a tile to finish (a per-tile arrival counter, reset by that
    program) sums the partials in split order into y once, so the expand reads one y row per token.
  - expand: y rounded to the weights' dtype, times B[slot]^T (float32 sums), scaled, added to the base output
    in float32 and rounded once. One program per (column block, slice, tile group), looping over its tiles;
    the slices of a fused output (q|k|v, gate|up; at most three) each read their own rows of y and of B.

Rows of tokens without an adapter (-1, or outside the stacks) are in no tile: nothing reads or writes them (the
public `lora_shrink` returns zeros there, `lora_expand(accumulate=False)` zeroes them). Nothing is read back to
the host: the grids are functions of T and the shapes, the counts live on the device, the arrival counters are
left at zero by every launch, so all of it can be captured in a CUDA graph and replayed with new slot
assignments.

Batch invariance: a token's arithmetic is fixed by the shapes alone. The tile height (BLOCK_M = 16, under the
64 rows Hopper's wgmma needs, so the dot is the same mma.sync on sm_90 as on sm_80 at every batch size), the K
chunks and the number of splits of the shrink, the order in which the partials are summed, the rank chunks and
column blocks of the expand never depend on T; a row of a tile's GEMM depends on that row alone, and which
program runs a tile (the tile groups) changes no arithmetic. So a token gets the same bits alone, in a decode
batch of 256 or in a prefill chunk, whichever adapters share the batch.

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
_MAX_SPLIT_K = 16  # the down projection (in 14336) takes 16: shorter K loops for decode
_BLOCK_N = 128  # output columns per expand program
_GROUPS_PER_TILE_ROW = 2  # tile groups per BLOCK_M tokens of the step (see `_tile_groups`)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's adapter tokens sorted into tiles of one adapter slot each (built by `lora_batch` on the device).
    The first `num_tiles[0]` tiles hold the adapter tokens; tokens without an adapter are in none."""

    order: torch.Tensor  # [T] int32: token ids sorted by slot (stable); tokens without a slot last
    tile_start: torch.Tensor  # [max_tiles] int32: each tile's first position in `order`
    tile_len: torch.Tensor  # [max_tiles] int32: tokens in the tile, 0 for an unused tile
    tile_slot: torch.Tensor  # [max_tiles] int32: the tile's slot, -1 for an unused tile
    num_tiles: torch.Tensor  # [1] int32: the tiles in use
    arrivals: torch.Tensor  # [max_tiles] int32: the shrink's per-tile split counters, zero between launches
    num_slots: int  # S, the number of slots of the stacks it is used with

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0]


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """The most tiles T tokens over S slots can need: each slot's last tile may be partial, and a tile holds at
    least one token."""
    return min(num_tokens, triton.cdiv(num_tokens, BLOCK_M) + num_slots)


def _tile_groups(num_tokens: int, num_slots: int) -> int:
    """Programs along the tile axis of a launch: a few per BLOCK_M tokens (so one or two tiles each in a decode
    step), never more than the tiles there can be. Only spreads tiles over programs (see the module docstring)."""
    return max(1, min(max_tiles(num_tokens, num_slots), _GROUPS_PER_TILE_ROW * triton.cdiv(num_tokens, BLOCK_M)))


@triton.jit
def _lora_batch_kernel(idx_ptr, order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr, num_tiles_ptr, arrivals_ptr,
                       num_tokens, num_slots, num_tile_rows,
                       BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: a counting sort of the tokens by slot (bucket S: no adapter), then the tiles of each slot."""
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S] buckets: the slots, then S for tokens without one
    counts = tl.zeros([BLOCK_S], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        raw = tl.load(idx_ptr + t, mask=t < num_tokens, other=-1)
        key = tl.where((raw >= 0) & (raw < num_slots), raw, num_slots)
        hit = (key[:, None] == s[None, :]) & (t < num_tokens)[:, None]  # [BLOCK_T, BLOCK_S]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    seg_start = tl.cumsum(counts, axis=0) - counts  # [BLOCK_S]: each bucket's first position in `order`
    seen = tl.zeros([BLOCK_S], dtype=tl.int32)  # tokens of each bucket placed so far
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        raw = tl.load(idx_ptr + t, mask=t < num_tokens, other=-1)
        key = tl.where((raw >= 0) & (raw < num_slots), raw, num_slots)
        hit = ((key[:, None] == s[None, :]) & (t < num_tokens)[:, None]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # earlier tokens of the chunk in the same bucket
        pos = tl.sum(hit * (seg_start + seen)[None, :] + hit * before, axis=1)  # [BLOCK_T]
        tl.store(order_ptr + pos, t, mask=t < num_tokens)
        seen += tl.sum(hit, axis=0)
    tiles = tl.where(s < num_slots, (counts + BLOCK_M - 1) // BLOCK_M, 0)  # [BLOCK_S]
    tiles_end = tl.cumsum(tiles, axis=0)
    tiles_begin = tiles_end - tiles
    tl.store(num_tiles_ptr, tl.sum(tiles, axis=0))
    for j0 in range(0, num_tile_rows, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)  # [BLOCK_T] tiles
        inside = ((j[:, None] >= tiles_begin[None, :]) & (j[:, None] < tiles_end[None, :])).to(tl.int32)
        first = (j[:, None] - tiles_begin[None, :]) * BLOCK_M  # [BLOCK_T, BLOCK_S]: the tile's offset in its slot
        start = tl.sum(inside * (seg_start[None, :] + first), axis=1)
        length = tl.sum(inside * tl.minimum(counts[None, :] - first, BLOCK_M), axis=1)
        slot = tl.sum(inside * (s[None, :] + 1), axis=1) - 1
        jmask = j < num_tile_rows
        tl.store(tile_start_ptr + j, start, mask=jmask)
        tl.store(tile_len_ptr + j, length, mask=jmask)
        tl.store(tile_slot_ptr + j, slot, mask=jmask)
        tl.store(arrivals_ptr + j, tl.zeros([BLOCK_T], dtype=tl.int32), mask=jmask)


def lora_batch(idx: torch.Tensor, num_slots: int) -> LoraBatch:
    """The tiles of a step's slot assignment idx [T] (int32 or int64; -1: no adapter) for stacks of
    `num_slots` slots, in one launch. Values outside [-1, num_slots) count as no adapter (the kernels never read
    outside the stacks). No host synchronisation; the sizes are functions of T and S (`max_tiles`), so the result
    can be built inside a captured CUDA graph."""
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be a [T] int32 or int64 tensor; got {idx.dtype} {tuple(idx.shape)}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    n, dev = idx.shape[0], idx.device
    rows = max_tiles(n, num_slots)
    ints = torch.empty(n + 4 * rows + 1, dtype=torch.int32, device=dev)  # one allocation for every field
    order, tile_start, tile_len, tile_slot, arrivals, num_tiles = ints.split([n, rows, rows, rows, rows, 1])
    block_s = triton.next_power_of_2(num_slots + 1)
    block_t = max(16, min(128, 8192 // block_s))
    _lora_batch_kernel[(1,)](idx, order, tile_start, tile_len, tile_slot, num_tiles, arrivals, n, num_slots, rows,
                             BLOCK_M=BLOCK_M, BLOCK_T=block_t, BLOCK_S=block_s, num_warps=8)
    return LoraBatch(order=order, tile_start=tile_start, tile_len=tile_len, tile_slot=tile_slot, num_tiles=num_tiles,
                     arrivals=arrivals, num_slots=num_slots)


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, part_ptr, y_ptr, order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
                        num_tiles_ptr, arrivals_ptr, rows, in_features, k_per_split, stride_xt, stride_as, stride_ar,
                        stride_pp, stride_pt, stride_yt, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    split = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    m = tl.arange(0, BLOCK_M)
    kk0 = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(1), num_tiles, tl.num_programs(1)):
        length = tl.load(tile_len_ptr + tile)
        slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
        mmask = m < length
        tok = tl.load(order_ptr + tl.load(tile_start_ptr + tile) + m, mask=mmask, other=0).to(tl.int64)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < rows
            a_base = a_ptr + slot * stride_as + r[None, :] * stride_ar
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                kk = k + kk0
                kmask = kk < k_hi
                xt = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                             other=0.0)
                at = tl.load(a_base + kk[:, None], mask=rmask[None, :] & kmask[:, None],
                             other=0.0)  # [BLOCK_K, BLOCK_R]
                acc = tl.dot(xt, at, acc, input_precision="ieee")
            if SPLITS == 1:
                tl.store(y_ptr + tok[:, None] * stride_yt + r[None, :], acc, mask=mmask[:, None] & rmask[None, :])
            else:
                tl.store(part_ptr + split * stride_pp + tok[:, None] * stride_pt + r[None, :], acc,
                         mask=mmask[:, None] & rmask[None, :])
        if SPLITS > 1:
            tl.debug_barrier()  # every thread's partial stored before the arrival is published
            arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the tile's last split: sum the partials in split order into y
                tl.debug_barrier()
                for r0 in range(0, rows, BLOCK_R):
                    r = r0 + tl.arange(0, BLOCK_R)
                    ymask = mmask[:, None] & (r < rows)[None, :]
                    p_ptrs = part_ptr + tok[:, None] * stride_pt + r[None, :]
                    y = tl.load(p_ptrs, mask=ymask, other=0.0, cache_modifier=".cg")
                    for p in tl.static_range(1, SPLITS):
                        y += tl.load(p_ptrs + p * stride_pp, mask=ymask, other=0.0, cache_modifier=".cg")
                    tl.store(y_ptr + tok[:, None] * stride_yt + r[None, :], y, mask=ymask)
                tl.atomic_xchg(arrivals_ptr + tile, 0)  # ready for the next launch over these tiles


@triton.jit
def _lora_expand_kernel(y_ptr, b_ptr, out_ptr, scaling_ptr, order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
                        num_tiles_ptr, rank, width0, width1, width2, stride_yt, stride_bs, stride_bn, stride_ot,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    sl = tl.program_id(1)
    width = tl.where(sl == 0, width0, tl.where(sl == 1, width1, width2))
    if tl.program_id(0) * BLOCK_N >= width:  # a column block past a narrower slice's end
        return
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < width
    cols = tl.where(sl >= 1, width0, 0) + tl.where(sl >= 2, width1, 0) + n  # columns of the fused output
    m = tl.arange(0, BLOCK_M)
    num_tiles = tl.load(num_tiles_ptr)
    for tile in range(tl.program_id(2), num_tiles, tl.num_programs(2)):
        length = tl.load(tile_len_ptr + tile)
        slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
        mmask = m < length
        tok = tl.load(order_ptr + tl.load(tile_start_ptr + tile) + m, mask=mmask, other=0).to(tl.int64)
        y_base = y_ptr + tok[:, None] * stride_yt + sl * rank
        b_base = b_ptr + slot * stride_bs + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            rmask = rr < rank
            yt = tl.load(y_base + rr[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
            bt = tl.load(b_base + rr[:, None], mask=rmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            acc = tl.dot(yt.to(bt.dtype), bt, acc, input_precision="ieee")
        out_ptrs = out_ptr + tok[:, None] * stride_ot + cols[None, :]
        omask = mmask[:, None] & nmask[None, :]
        acc = acc * tl.load(scaling_ptr + slot) + tl.load(out_ptrs, mask=omask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def _block_r(n: int) -> int:
    return min(64, max(16, triton.next_power_of_2(n)))


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


def _shrink(x: torch.Tensor, A: torch.Tensor, batch: LoraBatch, y: torch.Tensor) -> torch.Tensor:
    """y [T, R] float32 (the adapter tokens' rows written; the others left as they were) = x @ A[slot]^T."""
    num_tokens, in_features = x.shape
    rows = A.shape[1]
    block_k = 32 if x.dtype == torch.float32 else 64
    splits, per_split = _shrink_split(in_features, block_k)
    partials = y.new_empty(splits, num_tokens, rows) if splits > 1 else y.unsqueeze(0)  # [splits, T, R]
    grid = (splits, _tile_groups(num_tokens, batch.num_slots))
    _lora_shrink_kernel[grid](x, A, partials, y, batch.order, batch.tile_start, batch.tile_len, batch.tile_slot,
                              batch.num_tiles, batch.arrivals, rows, in_features, per_split, x.stride(0), A.stride(0),
                              A.stride(1), partials.stride(0), partials.stride(1), y.stride(0), SPLITS=splits,
                              BLOCK_M=BLOCK_M, BLOCK_R=_block_r(rows), BLOCK_K=block_k, num_warps=4)
    return y


def _expand(y: torch.Tensor, B: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor, out: torch.Tensor,
            slices: tuple[int, ...]) -> None:
    """out[adapter tokens] += scaling * y @ B[slot]^T per slice, as `lora_expand` with accumulate."""
    rank = B.shape[2]
    widths = slices + (0,) * (_MAX_SLICES - len(slices))
    grid = (triton.cdiv(max(slices), _BLOCK_N), len(slices), _tile_groups(out.shape[0], batch.num_slots))
    _lora_expand_kernel[grid](y, B, out, scaling, batch.order, batch.tile_start, batch.tile_len, batch.tile_slot,
                              batch.num_tiles, rank, *widths, y.stride(0), B.stride(0), B.stride(1), out.stride(0),
                              BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=_block_r(rank), num_warps=4)


def lora_shrink(x: torch.Tensor, A: torch.Tensor, lora: torch.Tensor | LoraBatch) -> torch.Tensor:
    """x [T, in], A [S, R, in] (x's dtype), lora: idx [T] or its `lora_batch` -> y [T, R] float32:
    y[t] = A[idx[t]] @ x[t], zeros for tokens without a slot."""
    _check_x_a(x, A)
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    y = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)
    return _shrink(x, A, batch, y) if x.shape[0] else y


def lora_expand(y: torch.Tensor, B: torch.Tensor, lora: torch.Tensor | LoraBatch, scaling: torch.Tensor,
                out: torch.Tensor, accumulate: bool = True, *, slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """y [T, R] float32 (R = num_slices * r_max), B [S, N, r_max], lora: idx [T] or its `lora_batch`,
    scaling [S] float32, out [T, N] (B's dtype): each token's slice j of `out` gets
    scaling[slot] * y[t, j * r_max:(j + 1) * r_max] @ B[slot, slice j]^T, added in place (`accumulate`) or
    written in place of it (`out` zeroed first, so rows without a slot become zeros). `slices`: the output
    widths of a fused layer, (N,) when None. Returns out."""
    slices = _check_expand(B, scaling, out, slices)
    rows = len(slices) * B.shape[2]
    if y.shape != (out.shape[0], rows) or y.dtype != torch.float32 or y.stride(1) != 1 or y.device != out.device:
        raise ValueError(f"y must be [{out.shape[0]}, {rows}] float32 (num_slices * r_max) with unit stride on "
                         f"{out.device}; got {y.dtype} {tuple(y.shape)} on {y.device}")
    batch = _as_batch(lora, out.shape[0], B.shape[0])
    if not accumulate:
        out.zero_()
    if out.shape[0]:
        _expand(y, B, batch, scaling, out, slices)
    return out


def add_lora(out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, lora: torch.Tensor | LoraBatch,
             scaling: torch.Tensor, *, slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """out [T, N] (the base layer's output) += each token's scaled LoRA delta: the shrink then the expand, two
    launches, y only in the adapter tokens' rows (bitwise the same as `lora_shrink` then `lora_expand`).
    x [T, in], A [S, R, in], B [S, N, r_max], scaling [S] float32, all but scaling in one dtype. Returns out."""
    _check_x_a(x, A)
    slices = _check_expand(B, scaling, out, slices)
    if B.shape[0] != A.shape[0] or B.dtype != x.dtype or A.shape[1] != len(slices) * B.shape[2]:
        raise ValueError(f"A [S, num_slices * r_max, in] and B [S, N, r_max] must agree in S, r_max and dtype; got "
                         f"A {A.dtype} {tuple(A.shape)}, B {B.dtype} {tuple(B.shape)}, {len(slices)} slices")
    if out.shape[0] != x.shape[0] or out.device != x.device:
        raise ValueError(f"out must have x's {x.shape[0]} rows on x's device; got {tuple(out.shape)} on {out.device}")
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    if x.shape[0]:
        y = torch.empty(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)  # [T, R]
        _expand(_shrink(x, A, batch, y), B, batch, scaling, out, slices)
    return out
