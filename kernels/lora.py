"""Many LoRA adapters in one batch in Triton (the CUDA path of `kernels/lora_ref.py`, whose docstring states the
contract: the slot stacks A [S, R, in] / B [S, N, r_max], the slices of a fused output, the numerics).

Punica's segmented idea (SGMV): the tokens of a step are sorted by adapter slot once (`lora_batch`, one launch,
shared by every layer of the step) and cut into tiles of `BLOCK_M` tokens of one slot; each tile is a small GEMM
against its slot's weights, so tokens of one adapter read its weights once per tile and a batch of many adapters
is one launch per layer. Only tokens with an adapter get tiles, and the tiles in use come first (a tile in use
has a slot; the first tile without one ends the list), so the grids depend on T and the layer's shape, not on
how many slots the step uses, and programs past the tiles in use stop after one load. Two parts per layer:

  - shrink: partial sums x @ A[slot]^T in float32 over a fixed number of splits of the `in` axis; one program
    per (split, tile group), a group taking the tiles g, g + groups, ... Each program stores its partial and
    counts itself into the tile's arrival counter (a release atomic).
  - expand: one program per (column block of one slice, tile group). Per tile it loads its B block and the
    base output rows first, then waits until all the tile's splits have arrived (an acquire), sums the
    partials in split order, rounds that y to the weights' dtype, multiplies by B[slot]^T (float32 sums),
    scales, adds the base output in float32 and rounds once. The slices of a fused output (q|k|v, gate|up; at
    most three) each read their own entries of y and rows of B.

`add_lora` runs the two parts as two launches by default, which the stream orders: nothing waits on anything.
`LoraKernelConfig.fused` runs both in ONE launch: each program takes a ticket when it starts (an atomic count,
`LoraBatch.ticket`; the last taker sets it back to zero), the lower tickets run the shrink and the later ones the
expand, so a waiting expand program holds a later ticket than every shrink program it waits on, which has
therefore started, and the waits end whatever order the GPU hands out blocks in (with `ticketed=False` the role
is the block id, which trusts in-order dispatch: on an H100 a step graph of 32 layers at 16 distinct adapters
never finished that way, `python bench/lora_kernels.py --systems block_ids --distinct 16`, 2026-12-06). The
expand's loads of B and of the base rows overlap the shrink. Each tile's counter is taken back to zero by the
last expand program to pass it (the counter also counts the expand programs), so every launch leaves the
counters as it found them.

The two launches are bitwise equal to the one: `lora_shrink_partials` launches the shrink
(the partials allocated on the caller's stream) and returns a `LoraPartials`; `lora_expand_partials` launches the
expand from it. Those launches neither count nor wait: the stream orders them, and the counters stay at zero.
Given a second stream, `lora_shrink_partials` forks the shrink onto it (that stream waits for the caller's), so
the caller's stream can run the base layer's matmul meanwhile (the shrink needs only the layer's input), and
`lora_expand_partials` joins it back (the caller's stream waits for it) before the expand: the LoRA work left
after the matmul is the expand alone (runner/lora/runtime.py does this, `EngineConfig.lora_overlap`). The fork
and the join are stream waits, which a CUDA-graph capture records as edges. `add_lora`'s default is the same two
launches on one stream.

Rows of tokens without an adapter (-1, or outside the stacks) are in no tile: nothing reads or writes them (the
public `lora_shrink` returns zeros there, `lora_expand(accumulate=False)` zeroes them). Nothing is read back to
the host: the grids are functions of T, S and the shapes, the plan lives on the device and the counters are
left at zero, so all of it can be captured in a CUDA graph and replayed with new slot assignments.

Batch invariance: a token's arithmetic is fixed by the shapes and `LoraKernelConfig.split_k_chunk` alone. The
tile height (BLOCK_M = 16, under the 64 rows Hopper's wgmma needs, so the dot is the same mma.sync on sm_90 as on
sm_80 at every batch size), the K chunks and the number of splits of the shrink, the order in which the partials
are summed, the rank chunks of the expand never depend on T; a row of a tile's GEMM depends on that row alone,
and which program runs a tile (the tile groups, the column blocks, one launch or two) changes no arithmetic. So a
token gets the same bits alone, in a decode batch of 256 or in a prefill chunk, whichever adapters share it.

Not here: the base GEMM, LoRA on embeddings or the LM head, DoRA and other variants, autograd, tensor
parallelism (the caller passes its shard's stacks: B's rows of a column-parallel layer; A's columns of a
row-parallel one, whose partial delta added before the all-reduce sums to the full one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per tile; part of the numerics contract (see the module docstring)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SLICES = 3
_FLAG_STRIDE = 32  # int32s between two tiles' arrival counters: one 128-byte line each, apart from the others


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraKernelConfig:
    """How `add_lora` / `lora_shrink` / `lora_expand` launch. Only `split_k_chunk` and `max_split_k` change a
    token's bits (they fix the shrink's sums); everything else only moves work between programs."""

    fused: bool = False
    """`add_lora` in one launch (expand programs wait on the shrink's per-tile counters); False: two launches that
    the stream orders (`lora_shrink_partials` then `lora_expand_partials`), in which nothing waits: 10.8 / 11.7 /
    15.8 µs a hook at 1 / 4 / 16 distinct adapters against the ticketed one launch's 13.2 / 13.9 / 19.1 (8B
    shape, batch 64, one H100, `python bench/lora_kernels.py --systems default,one_launch,block_ids`)."""
    groups_per_tile_row: int = 4
    """Tile groups (programs along the tile axis) per BLOCK_M tokens of the step, at most the tiles there can
    be: 4 gives a decode batch of 64 sixteen groups, one tile each even when 16 adapters share it."""
    block_n: int = 128
    """Output columns per expand program."""
    split_k_chunk: int = 512
    """In-features per shrink split, rounded up to the K chunk; the splits are at most `max_split_k`."""
    max_split_k: int = 32
    """The most splits of the shrink (the down projection, in 14336, takes 28 at the defaults)."""
    num_warps: int = 4
    """Warps per program, shrink and expand."""
    block_k: int | None = None
    """In-features per step of the shrink's loop: None takes 256 for 16-bit weights (two steps a split, both
    loads in flight: the shrink is bound by load latency, 8 dependent steps of 64 took 1.4x as long on an H200)
    and 32 for float32."""
    shrink_stages: int = 2
    """Software-pipeline stages of the shrink's loop over its split (1: none)."""
    ticketed: bool = True
    """The one-launch kernels (`add_lora` fused, `kernels/lora_linear.py`) give each program its role by a ticket
    (an atomic count taken when the program starts, `LoraBatch.ticket`): a waiting program then holds a later
    ticket than every program it waits on, which has therefore started, whatever order the GPU dispatches blocks
    in. False: the role is the block id, one atomic round trip less per program, safe only where the GPU hands a
    grid's blocks out in id order (on an H100 a 32-layer step graph at 16 distinct adapters hung that way)."""

    def __post_init__(self) -> None:
        for name in ("groups_per_tile_row", "split_k_chunk", "max_split_k", "num_warps", "shrink_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoraKernelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"LoraKernelConfig.block_n must be a power of two >= 16, got {self.block_n}")
        if self.block_k is not None and (self.block_k < 16 or self.block_k & (self.block_k - 1)):
            raise ValueError(f"LoraKernelConfig.block_k must be None or a power of two >= 16, got {self.block_k}")


DEFAULT_CONFIG = LoraKernelConfig()


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's adapter tokens sorted into tiles of one adapter slot each (built by `lora_batch` on the device).
    The first `num_tiles[0]` tiles hold the adapter tokens; tokens without an adapter are in none."""

    order: torch.Tensor  # [T] int32: token ids sorted by slot (stable); tokens without a slot last
    tile_start: torch.Tensor  # [max_tiles] int32: each tile's first position in `order`
    tile_len: torch.Tensor  # [max_tiles] int32: tokens in the tile, 0 for an unused tile
    tile_slot: torch.Tensor  # [max_tiles] int32: the tile's slot, -1 for an unused tile (and every later one)
    tile_tokens: torch.Tensor  # [max_tiles, BLOCK_M] int32: the tile's token ids, -1 past its length
    num_tiles: torch.Tensor  # [1] int32: the tiles in use
    arrivals: torch.Tensor  # [max_tiles] int32 (stride _FLAG_STRIDE): per-tile launch counters, zero between launches
    token_slot: torch.Tensor  # [T] int32: each token's slot, -1 for none (values outside the stacks included)
    done: torch.Tensor  # [1] int32 (kernels/lora_linear.py): the shrink programs of the step's launches so far
    # (zero when built), or with `LinearLoraConfig.step_count=False` a launch-wide counter, zero between launches
    ticket: torch.Tensor  # [1] int32: role tickets (LoraKernelConfig.ticketed), zero between launches
    used_slots: torch.Tensor  # [S] int32: the slots the step's adapter tokens use, ascending; -1 past num_used
    num_used: torch.Tensor  # [1] int32: how many slots the step uses
    num_slots: int  # S, the number of slots of the stacks it is used with
    counted: list[int] = field(default_factory=lambda: [0])  # [1] host int: what `done` reaches with step_count

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0]


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """The most tiles T tokens over S slots can need: each slot's last tile may be partial, and a tile holds at
    least one token."""
    return min(num_tokens, triton.cdiv(num_tokens, BLOCK_M) + num_slots)


def _tile_groups(num_tokens: int, num_slots: int, per_tile_row: int) -> int:
    """Programs along the tile axis of a launch: `per_tile_row` per BLOCK_M tokens of the step, never more than
    the tiles there can be. Only spreads tiles over programs (see the module docstring)."""
    return max(1, min(max_tiles(num_tokens, num_slots), per_tile_row * triton.cdiv(num_tokens, BLOCK_M)))


@triton.jit
def _lora_batch_kernel(idx_ptr, order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr, tile_tokens_ptr,
                       num_tiles_ptr, arrivals_ptr, token_slot_ptr, done_ptr, ticket_ptr, used_slots_ptr,
                       num_used_ptr, num_tokens, num_slots, num_tile_rows, BLOCK_M: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, FLAG_STRIDE: tl.constexpr):
    """One program: a counting sort of the tokens by slot (bucket S: no adapter), then the list of the slots in
    use and the tiles of each slot."""
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S] buckets: the slots, then S for tokens without one
    counts = tl.zeros([BLOCK_S], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        raw = tl.load(idx_ptr + t, mask=t < num_tokens, other=-1)
        key = tl.where((raw >= 0) & (raw < num_slots), raw, num_slots)
        hit = (key[:, None] == s[None, :]) & (t < num_tokens)[:, None]  # [BLOCK_T, BLOCK_S]
        counts += tl.sum(hit.to(tl.int32), axis=0)
        tl.store(token_slot_ptr + t, tl.where(key < num_slots, key, -1), mask=t < num_tokens)
    seg_start = tl.cumsum(counts, axis=0) - counts  # [BLOCK_S]: each bucket's first position in `order`
    used = ((counts > 0) & (s < num_slots)).to(tl.int32)
    num_used = tl.sum(used, axis=0)
    tl.store(used_slots_ptr + tl.cumsum(used, axis=0) - 1, s, mask=used > 0)
    tl.store(used_slots_ptr + s, tl.full([BLOCK_S], -1, tl.int32), mask=(s >= num_used) & (s < num_slots))
    tl.store(num_used_ptr, num_used)
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
    tl.debug_barrier()  # `order` complete before the tiles read their tokens from it
    tiles = tl.where(s < num_slots, (counts + BLOCK_M - 1) // BLOCK_M, 0)  # [BLOCK_S]
    tiles_end = tl.cumsum(tiles, axis=0)
    tiles_begin = tiles_end - tiles
    tl.store(num_tiles_ptr, tl.sum(tiles, axis=0))
    tl.store(done_ptr, 0)
    tl.store(ticket_ptr, 0)
    m = tl.arange(0, BLOCK_M)
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
        tl.store(arrivals_ptr + j * FLAG_STRIDE, tl.zeros([BLOCK_T], dtype=tl.int32), mask=jmask)
        held = m[None, :] < length[:, None]  # [BLOCK_T, BLOCK_M]
        tokens = tl.load(order_ptr + start[:, None] + m[None, :], mask=held & jmask[:, None], other=-1)
        tl.store(tile_tokens_ptr + j[:, None] * BLOCK_M + m[None, :], tokens, mask=jmask[:, None])


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
    ints = torch.empty(2 * n + (3 + BLOCK_M + _FLAG_STRIDE) * rows + 2 * _FLAG_STRIDE + num_slots + 2,
                       dtype=torch.int32, device=dev)  # every field; the counters on 128-byte lines of their own
    (flags, done, ticket, order, token_slot, tile_start, tile_len, tile_slot, tile_tokens, num_tiles, used_slots,
     num_used) = ints.split([_FLAG_STRIDE * rows, _FLAG_STRIDE, _FLAG_STRIDE, n, n, rows, rows, rows, BLOCK_M * rows,
                             1, num_slots, 1])
    block_s = triton.next_power_of_2(num_slots + 1)
    block_t = max(16, min(128, 8192 // block_s))
    _lora_batch_kernel[(1,)](idx, order, tile_start, tile_len, tile_slot, tile_tokens, num_tiles, flags, token_slot,
                             done, ticket, used_slots, num_used, n, num_slots, rows, BLOCK_M=BLOCK_M, BLOCK_T=block_t,
                             BLOCK_S=block_s, FLAG_STRIDE=_FLAG_STRIDE, num_warps=8)
    return LoraBatch(order=order, tile_start=tile_start, tile_len=tile_len, tile_slot=tile_slot,
                     tile_tokens=tile_tokens.view(rows, BLOCK_M), num_tiles=num_tiles,
                     arrivals=flags.view(rows, _FLAG_STRIDE)[:, 0], token_slot=token_slot, done=done[:1],
                     ticket=ticket[:1], used_slots=used_slots, num_used=num_used, num_slots=num_slots)


@triton.jit
def _load_tile(tile_slot_ptr, tile_tokens_ptr, tile, num_tile_rows, BLOCK_M: tl.constexpr):
    """(slot, tokens [BLOCK_M] int32) of tile `tile`, loaded together (neither waits for the other); past the
    last tile row, slot -1 (the caller's loop ends) and tokens -1."""
    m = tl.arange(0, BLOCK_M)
    slot = tl.load(tile_slot_ptr + tile, mask=tile < num_tile_rows, other=-1)
    toks = tl.load(tile_tokens_ptr + tile * BLOCK_M + m, mask=tile * BLOCK_M + m < num_tile_rows * BLOCK_M, other=-1)
    return slot, toks


@triton.jit
def _shrink_tiles(pid, x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr, num_tile_rows, groups,
                  rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp, stride_pt,
                  SPLITS: tl.constexpr, SYNC: tl.constexpr, FLAG_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Shrink program `pid` = (split, group): partial[split, token] = x[token, split's K] @ A[slot, :, same]^T
    for the tokens of the group's tiles; with SYNC, counts itself into each tile's arrival counter."""
    split = pid % SPLITS
    tile = pid // SPLITS
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    kk0 = tl.arange(0, BLOCK_K)
    part_split = part_ptr + split.to(tl.int64) * stride_pp
    slot, toks = _load_tile(tile_slot_ptr, tile_tokens_ptr, tile, num_tile_rows, BLOCK_M)  # toks -1 past its length
    while slot >= 0:
        mmask = toks >= 0
        tok = tl.where(mmask, toks, 0).to(tl.int64)
        a_slot = a_ptr + slot.to(tl.int64) * stride_as
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < rows
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                kk = k + kk0
                kmask = kk < k_hi
                xt = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                             other=0.0)  # [BLOCK_M, BLOCK_K]
                at = tl.load(a_slot + r[None, :] * stride_ar + kk[:, None], mask=rmask[None, :] & kmask[:, None],
                             other=0.0)  # [BLOCK_K, BLOCK_R]
                acc = tl.dot(xt, at, acc, input_precision="ieee")
            tl.store(part_split + tok[:, None] * stride_pt + r[None, :], acc, mask=mmask[:, None] & rmask[None, :])
        if SYNC:
            tl.debug_barrier()  # every thread's partial stored before the arrival is published
            tl.atomic_add(arrivals_ptr + tile * FLAG_STRIDE, 1, sem="release")
        tile += groups
        slot, toks = _load_tile(tile_slot_ptr, tile_tokens_ptr, tile, num_tile_rows, BLOCK_M)


@triton.jit
def _expand_tiles(pid, part_ptr, b_ptr, out_ptr, scaling_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr,
                  num_tile_rows, groups, col_blocks, blocks0, blocks1, rank, width0, width1, width2, stride_pp,
                  stride_pt, stride_bs, stride_bn, stride_ot, SPLITS: tl.constexpr, SYNC: tl.constexpr,
                  FLAG_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  RANK_CHUNKS: tl.constexpr):
    """Expand program `pid` = (group, column block of one slice): for the group's tiles, out[token, block] +=
    scaling * round(sum of the partials in split order) @ B[slot, block]^T; with SYNC, first waits until every
    split of the tile arrived, and counts itself in (the last of the `col_blocks` resets the counter)."""
    f = pid % col_blocks  # column blocks of all slices, slice by slice
    tile = pid // col_blocks
    sl = (f >= blocks0).to(tl.int32) + (f >= blocks0 + blocks1).to(tl.int32)
    n = (f - tl.where(sl >= 1, blocks0, 0) - tl.where(sl >= 2, blocks1, 0)) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < tl.where(sl == 0, width0, tl.where(sl == 1, width1, width2))
    cols = tl.where(sl >= 1, width0, 0) + tl.where(sl >= 2, width1, 0) + n  # columns of the fused output
    r = tl.arange(0, BLOCK_R)
    slot, toks = _load_tile(tile_slot_ptr, tile_tokens_ptr, tile, num_tile_rows, BLOCK_M)
    while slot >= 0:
        mmask = toks >= 0
        tok = tl.where(mmask, toks, 0).to(tl.int64)
        slot64 = slot.to(tl.int64)
        b_base = b_ptr + slot64 * stride_bs + cols[None, :] * stride_bn
        out_ptrs = out_ptr + tok[:, None] * stride_ot + cols[None, :]
        omask = mmask[:, None] & nmask[None, :]
        # what does not depend on the shrink first: B's first rank chunk, the base rows, the scale
        bt = tl.load(b_base + r[:, None], mask=(r < rank)[:, None] & nmask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        base = tl.load(out_ptrs, mask=omask, other=0.0)
        scale = tl.load(scaling_ptr + slot64)
        if SYNC:
            flag = arrivals_ptr + tile * FLAG_STRIDE
            arrived = tl.load(flag, volatile=True)
            while arrived < SPLITS:
                arrived = tl.load(flag, volatile=True)
            seen = tl.atomic_add(flag, 1, sem="acquire")  # the partials visible from here on; counted in
            if seen == SPLITS + col_blocks - 1:  # the tile's last expand program: ready for the next launch
                tl.atomic_xchg(flag, 0, sem="relaxed")
        y_rows = part_ptr + tok[:, None] * stride_pt + sl * rank
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in tl.static_range(RANK_CHUNKS):  # mostly one: the loop unrolled, nothing kept for a next chunk
            rr = c * BLOCK_R + r
            rmask = rr < rank
            if c > 0:
                bt = tl.load(b_base + rr[:, None], mask=rmask[:, None] & nmask[None, :], other=0.0)
            ymask = mmask[:, None] & rmask[None, :]
            yt = tl.load(y_rows + rr[None, :], mask=ymask, other=0.0, cache_modifier=".cg")  # [BLOCK_M, BLOCK_R]
            for p in tl.static_range(1, SPLITS):
                yt += tl.load(y_rows + p * stride_pp + rr[None, :], mask=ymask, other=0.0, cache_modifier=".cg")
            acc = tl.dot(yt.to(bt.dtype), bt, acc, input_precision="ieee")
        acc = acc * scale + base.to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
        tile += groups
        slot, toks = _load_tile(tile_slot_ptr, tile_tokens_ptr, tile, num_tile_rows, BLOCK_M)


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr, num_tile_rows, groups,
                        rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp, stride_pt,
                        SPLITS: tl.constexpr, FLAG_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """The shrink alone (no arrival counts: the stream orders the expand after it)."""
    _shrink_tiles(tl.program_id(0), x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr,
                  num_tile_rows, groups, rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp,
                  stride_pt, SPLITS, False, FLAG_STRIDE, BLOCK_M, BLOCK_R, BLOCK_K, STAGES)


@triton.jit
def _lora_expand_kernel(part_ptr, b_ptr, out_ptr, scaling_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr,
                        num_tile_rows, groups, col_blocks, blocks0, blocks1, rank, width0, width1, width2,
                        stride_pp, stride_pt, stride_bs, stride_bn, stride_ot, SPLITS: tl.constexpr,
                        FLAG_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, RANK_CHUNKS: tl.constexpr):
    """The expand alone, of a shrink the stream (or a join of streams) ordered before it: no waits."""
    _expand_tiles(tl.program_id(0), part_ptr, b_ptr, out_ptr, scaling_ptr, tile_tokens_ptr, tile_slot_ptr,
                  arrivals_ptr, num_tile_rows, groups, col_blocks, blocks0, blocks1, rank, width0, width1, width2,
                  stride_pp, stride_pt, stride_bs, stride_bn, stride_ot, SPLITS, False, FLAG_STRIDE, BLOCK_M, BLOCK_N,
                  BLOCK_R, RANK_CHUNKS)


@triton.jit
def _program_role(ticket_ptr, programs, TICKETED: tl.constexpr):
    """This program's role id: its block id, or with TICKETED the next ticket (the last taker sets the counter back
    to zero for the next launch: every ticket of this launch is taken by then)."""
    if TICKETED:
        pid = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
        if pid == programs - 1:
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")
    else:
        pid = tl.program_id(0)
    return pid


@triton.jit
def _lora_fused_kernel(x_ptr, a_ptr, part_ptr, b_ptr, out_ptr, scaling_ptr, tile_tokens_ptr, tile_slot_ptr,
                       arrivals_ptr, ticket_ptr, programs, num_tile_rows, groups, shrink_programs, rows, in_features,
                       k_per_split, col_blocks, blocks0, blocks1, rank, width0, width1, width2, stride_xt, stride_as,
                       stride_ar, stride_pp, stride_pt, stride_bs, stride_bn, stride_ot, SPLITS: tl.constexpr,
                       FLAG_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_RA: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RB: tl.constexpr,
                       RANK_CHUNKS: tl.constexpr, STAGES: tl.constexpr, TICKETED: tl.constexpr):
    """The shrink programs (ids below `shrink_programs`), then the expand programs, which wait on them."""
    pid = _program_role(ticket_ptr, programs, TICKETED)
    if pid < shrink_programs:
        _shrink_tiles(pid, x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr, num_tile_rows,
                      groups, rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp, stride_pt,
                      SPLITS, True, FLAG_STRIDE, BLOCK_M, BLOCK_RA, BLOCK_K, STAGES)
    else:
        _expand_tiles(pid - shrink_programs, part_ptr, b_ptr, out_ptr, scaling_ptr, tile_tokens_ptr, tile_slot_ptr,
                      arrivals_ptr, num_tile_rows, groups, col_blocks, blocks0, blocks1, rank, width0, width1, width2,
                      stride_pp, stride_pt, stride_bs, stride_bn, stride_ot, SPLITS, True, FLAG_STRIDE, BLOCK_M,
                      BLOCK_N, BLOCK_RB, RANK_CHUNKS)


def _block_r(n: int) -> int:
    return min(64, max(16, triton.next_power_of_2(n)))


def _shrink_split(in_features: int, block_k: int, config: LoraKernelConfig) -> tuple[int, int]:
    """(splits, in-features per split) of the shrink: a function of the layer's width and the config only."""
    wanted = min(config.max_split_k, triton.cdiv(in_features, config.split_k_chunk))
    per = triton.cdiv(triton.cdiv(in_features, wanted), block_k) * block_k
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
    if out.dim() != 2 or out.shape[1] != n or out.dtype not in (B.dtype, torch.float32) or out.stride(1) != 1:
        raise ValueError(f"out must be [T, {n}] {B.dtype} or float32 with unit stride in N; got {out.dtype} "
                         f"{tuple(out.shape)}")
    if scaling.shape != (num_slots,) or scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be [{num_slots}] float32; got {scaling.dtype} {tuple(scaling.shape)}")
    if not B.device == scaling.device == out.device:
        raise ValueError("B, scaling and out must be on one device")
    return slices


def _block_k(dtype: torch.dtype, config: LoraKernelConfig) -> int:
    if config.block_k is not None:
        return config.block_k
    return 32 if dtype == torch.float32 else 256


def _shrink_args(x: torch.Tensor, A: torch.Tensor, part: torch.Tensor, batch: LoraBatch, groups: int,
                 per_split: int) -> tuple:
    """The shrink's arguments after its pointers, in `_shrink_tiles`' order (up to its constexprs)."""
    return (batch.tile_tokens, batch.tile_slot, batch.arrivals, batch.tile_slot.shape[0], groups, A.shape[1],
            x.shape[1], per_split, x.stride(0), A.stride(0), A.stride(1), part.stride(0), part.stride(1))


def _expand_args(part: torch.Tensor, B: torch.Tensor, out: torch.Tensor, batch: LoraBatch, groups: int,
                 slices: tuple[int, ...], block_n: int) -> tuple[tuple, int]:
    """(the expand's arguments after its pointers, in `_expand_tiles`' order; its programs per tile group)."""
    blocks = [triton.cdiv(w, block_n) for w in slices]
    widths = slices + (0,) * (_MAX_SLICES - len(slices))
    blocks += [0] * (_MAX_SLICES - len(blocks))
    args = (batch.tile_tokens, batch.tile_slot, batch.arrivals, batch.tile_slot.shape[0], groups, sum(blocks),
            blocks[0], blocks[1], B.shape[2], *widths, part.stride(0), part.stride(1), B.stride(0), B.stride(1),
            out.stride(0))
    return args, sum(blocks)


def _shrink(x: torch.Tensor, A: torch.Tensor, batch: LoraBatch, part: torch.Tensor,
            config: LoraKernelConfig) -> None:
    """part[split] [T, R] float32 (the adapter tokens' rows written; the others left as they were): the shrink's
    partial sums, one launch on the current stream."""
    block_k = _block_k(x.dtype, config)
    splits, per_split = _shrink_split(x.shape[1], block_k, config)
    assert part.shape == (splits, x.shape[0], A.shape[1]) and part.stride(2) == 1, (tuple(part.shape), splits)
    groups = _tile_groups(x.shape[0], batch.num_slots, config.groups_per_tile_row)
    _lora_shrink_kernel[(splits * groups,)](
        x, A, part, *_shrink_args(x, A, part, batch, groups, per_split), SPLITS=splits, FLAG_STRIDE=_FLAG_STRIDE,
        BLOCK_M=BLOCK_M, BLOCK_R=_block_r(A.shape[1]), BLOCK_K=block_k, STAGES=config.shrink_stages,
        num_warps=config.num_warps)


def _expand(part: torch.Tensor, B: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor, out: torch.Tensor,
            slices: tuple[int, ...], config: LoraKernelConfig) -> None:
    """out[adapter tokens] += scaling * (the sum of part's splits) @ B[slot]^T per slice, one launch on the current
    stream, which must have the shrink that wrote `part` ordered before it."""
    groups = _tile_groups(out.shape[0], batch.num_slots, config.groups_per_tile_row)
    args, col_blocks = _expand_args(part, B, out, batch, groups, slices, config.block_n)
    _lora_expand_kernel[(col_blocks * groups,)](
        part, B, out, scaling, *args, SPLITS=part.shape[0], FLAG_STRIDE=_FLAG_STRIDE, BLOCK_M=BLOCK_M,
        BLOCK_N=config.block_n, BLOCK_R=_block_r(B.shape[2]), RANK_CHUNKS=triton.cdiv(B.shape[2], _block_r(B.shape[2])),
        num_warps=config.num_warps)


def _fused(x: torch.Tensor, A: torch.Tensor, part: torch.Tensor, B: torch.Tensor, batch: LoraBatch,
           scaling: torch.Tensor, out: torch.Tensor, slices: tuple[int, ...], config: LoraKernelConfig) -> None:
    """`_shrink` then `_expand`, in one launch: the expand programs wait on the shrink's arrival counters."""
    block_k = _block_k(x.dtype, config)
    splits, per_split = _shrink_split(x.shape[1], block_k, config)
    groups = _tile_groups(x.shape[0], batch.num_slots, config.groups_per_tile_row)
    expand, col_blocks = _expand_args(part, B, out, batch, groups, slices, config.block_n)
    _lora_fused_kernel[((splits + col_blocks) * groups,)](
        x, A, part, B, out, scaling, batch.tile_tokens, batch.tile_slot, batch.arrivals, batch.ticket,
        (splits + col_blocks) * groups, batch.tile_slot.shape[0],
        groups, splits * groups, A.shape[1], x.shape[1], per_split, *expand[5:12], x.stride(0), A.stride(0),
        A.stride(1), *expand[12:], SPLITS=splits, FLAG_STRIDE=_FLAG_STRIDE, BLOCK_M=BLOCK_M,
        BLOCK_RA=_block_r(A.shape[1]), BLOCK_K=block_k, BLOCK_N=config.block_n, BLOCK_RB=_block_r(B.shape[2]),
        RANK_CHUNKS=triton.cdiv(B.shape[2], _block_r(B.shape[2])), STAGES=config.shrink_stages,
        TICKETED=config.ticketed, num_warps=config.num_warps)


def _empty_partials(x: torch.Tensor, A: torch.Tensor, config: LoraKernelConfig) -> torch.Tensor:
    """The shrink's partial sums, unset: [splits, T, R] float32 on x's device (the current stream's memory)."""
    splits, _ = _shrink_split(x.shape[1], _block_k(x.dtype, config), config)
    return torch.empty(splits, x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)


def lora_shrink(x: torch.Tensor, A: torch.Tensor, lora: torch.Tensor | LoraBatch, *,
                config: LoraKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [T, in], A [S, R, in] (x's dtype), lora: idx [T] or its `lora_batch` -> y [T, R] float32:
    y[t] = A[idx[t]] @ x[t], zeros for tokens without a slot (the splits' partials summed in split order, the
    bits `add_lora` rounds)."""
    _check_x_a(x, A)
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    part = _empty_partials(x, A, config).zero_()
    if x.shape[0]:
        _shrink(x, A, batch, part, config)
    y = part[0]
    for p in range(1, part.shape[0]):
        y += part[p]
    return y


def lora_expand(y: torch.Tensor, B: torch.Tensor, lora: torch.Tensor | LoraBatch, scaling: torch.Tensor,
                out: torch.Tensor, accumulate: bool = True, *, slices: tuple[int, ...] | None = None,
                config: LoraKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """y [T, R] float32 (R = num_slices * r_max), B [S, N, r_max], lora: idx [T] or its `lora_batch`,
    scaling [S] float32, out [T, N] (B's dtype or float32): each token's slice j of `out` gets
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
        _expand(y.unsqueeze(0), B, batch, scaling, out, slices, config)
    return out


def _check_layer(out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: torch.Tensor,
                 slices: tuple[int, ...] | None) -> tuple[int, ...]:
    """The slices, after checking one layer's out, x, A, B and scaling against each other (x and A already
    checked by `_check_x_a`)."""
    slices = _check_expand(B, scaling, out, slices)
    if B.shape[0] != A.shape[0] or B.dtype != x.dtype or A.shape[1] != len(slices) * B.shape[2]:
        raise ValueError(f"A [S, num_slices * r_max, in] and B [S, N, r_max] must agree in S, r_max and dtype; got "
                         f"A {A.dtype} {tuple(A.shape)}, B {B.dtype} {tuple(B.shape)}, {len(slices)} slices")
    if out.shape[0] != x.shape[0] or out.device != x.device:
        raise ValueError(f"out must have x's {x.shape[0]} rows on x's device; got {tuple(out.shape)} on {out.device}")
    return slices


@dataclass(frozen=True, slots=True)
class LoraPartials:
    """One layer's shrink, launched by `lora_shrink_partials`, for its `lora_expand_partials`."""

    part: torch.Tensor  # [splits, T, R] float32: the shrink's split-K partial sums (adapter tokens' rows only)
    x: torch.Tensor  # [T, in]: the shrink's input, held until the expand (another stream may still read it)
    A: torch.Tensor  # [S, R, in]
    batch: LoraBatch
    config: LoraKernelConfig
    stream: torch.cuda.Stream | None  # the stream the shrink runs on when not the caller's; the expand joins it


def lora_shrink_partials(x: torch.Tensor, A: torch.Tensor, lora: torch.Tensor | LoraBatch, *,
                         stream: torch.cuda.Stream | None = None,
                         config: LoraKernelConfig = DEFAULT_CONFIG) -> LoraPartials:
    """The first half of `add_lora` (x [T, in], A [S, R, in], lora: idx [T] or its `lora_batch`): the shrink's
    partial sums, for `lora_expand_partials`. The partials (and the tile plan, given idx) are allocated on the
    current stream. With `stream` (a CUDA stream of x's device), that stream first waits for the current one,
    then runs the shrink, so the current stream may go on with other work (the base layer's matmul) while it
    does; the expand joins it back. In a CUDA-graph capture the fork and the join become the graph's edges."""
    _check_x_a(x, A)
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    if stream is not None and (not x.is_cuda or stream.device != x.device):
        raise ValueError(f"stream must be a CUDA stream of x's device {x.device}; got {stream!r}")
    part = _empty_partials(x, A, config)
    if not x.shape[0]:
        stream = None  # nothing to run: no fork
    elif stream is None:
        _shrink(x, A, batch, part, config)
    else:
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            _shrink(x, A, batch, part, config)
    return LoraPartials(part=part, x=x, A=A, batch=batch, config=config, stream=stream)


def lora_expand_partials(out: torch.Tensor, partials: LoraPartials, B: torch.Tensor, scaling: torch.Tensor, *,
                         slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """The second half of `add_lora`: out [T, N] += each token's scaled LoRA delta from `partials`' shrink
    (B [S, N, r_max], scaling [S] float32), on the current stream, after it waits for the shrink's stream when
    there is one. The bits of `add_lora` with the same arguments. Returns out."""
    if partials.stream is not None:
        torch.cuda.current_stream(out.device).wait_stream(partials.stream)
    slices = _check_layer(out, partials.x, partials.A, B, scaling, slices)
    if out.shape[0]:
        _expand(partials.part, B, partials.batch, scaling, out, slices, partials.config)
    return out


def add_lora(out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, lora: torch.Tensor | LoraBatch,
             scaling: torch.Tensor, *, slices: tuple[int, ...] | None = None,
             config: LoraKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """out [T, N] (the base layer's output) += each token's scaled LoRA delta: the shrink then the expand, in
    one launch (`config.fused`) or two (`lora_shrink_partials` then `lora_expand_partials` on the current stream),
    bitwise the same as each other and as `lora_shrink` then `lora_expand`. x [T, in], A [S, R, in],
    B [S, N, r_max], scaling [S] float32, all but scaling in one dtype; out in that dtype or float32 (zeros: the
    delta itself, unrounded, for a later add). Returns out."""
    _check_x_a(x, A)
    slices = _check_layer(out, x, A, B, scaling, slices)
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    if not config.fused:
        return lora_expand_partials(out, lora_shrink_partials(x, A, batch, config=config), B, scaling, slices=slices)
    if x.shape[0]:
        _fused(x, A, _empty_partials(x, A, config), B, batch, scaling, out, slices, config)
    return out
