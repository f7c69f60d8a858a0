"""Sparse weight patches decoded, checked, read and written block by block (the CUDA path of a weight-update
session's patch groups, `weight_updates/session.py`).

A session's patches of one engine dtype are laid end to end: their index streams (delta gaps, see
`weight_updates/encoding.py`), values (new bits, or int8 bit deltas with escapes) and overflow values. Every
patch is cut into blocks of at most ``BLOCK`` elements (no block straddles two patches), each described by one
row of an int64 table (``COLUMNS``: its elements, its patch's size, live tensor address and overflow / escape
ranges) that ``block_table`` builds on the device from the patches' counts (the host only counts the blocks
of each patch, ``blocks_per_patch``). Then:

1. ``block_counts``: per block, the sum of its plain gaps, its escaped gaps, its gaps < 0 and its escaped
   deltas (one read of the 1-, 2- or 4-byte gaps and of the 1-byte deltas).
2. The caller turns those into per-block starting points with a few scans over the blocks (not the
   elements): the block's first index and its first overflow and escape values (``block_starts``).
3. ``decode``: per block, in registers, the indices (a scan of the gaps, escapes taking their overflow
   values by rank), clamped into the patch's bounds so that reading through them is safe before the
   checks are known; the old values read through the live tensor's address; the new values (old bits +
   delta, or the escape value by rank, or the plain value); and the block's checksum change
   ``sum (s(new) - s(old)) * w(index)`` (the weights recomputed as in `kernels/checksum.py`). It writes
   [n] int32 indices, old and new values, and one int64 per block.
4. ``block_access``: scatter values (``SCATTER``: the write, and a rollback's) or count read-back
   mismatches per block (``COMPARE``) through the same table.

So the elements are read once by ``block_counts``, once by ``decode`` and once per later pass; nothing of
size [n] is int64. Bounds, stream and checksum *checks* are the caller's (from the per-block sums); this
module only keeps every access in bounds of its patch. Not here: dense records, 8-byte dtypes.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.common import SIGNED_VIEW

BLOCK = 2048  # elements per program (read when a session plans its blocks; bench/weight_sync.py --patch-sweep)
DECODE_WARPS = 4  # warps per decode program
WIDE_NUMEL = 1 << 31  # members of this many elements or more make a run's decode scans int64 (int32 below)

# Columns of the block table (int64 [B, NCOL]), all filled on the device from the patches' counts (``block_table``); ``block_starts``
# then rewrites index_base, ovf_pos and esc_pos on the device. start / end: the block's elements, counted
# over the group's patches end to end; numel, addr: its patch's parameter (elements, live data pointer);
# ovf_hi / esc_hi: the end of its patch's overflow / escape values; first: its patch's first block.
COLUMNS = ("start", "end", "numel", "addr", "ovf_hi", "esc_hi", "index_base", "ovf_pos", "esc_pos", "first")
START, END, NUMEL, ADDR, OVF_HI, ESC_HI, INDEX_BASE, OVF_POS, ESC_POS, FIRST = range(len(COLUMNS))
NCOL = len(COLUMNS)

SCATTER, COMPARE = range(2)


@triton.jit
def _typed(addr, ELEM: tl.constexpr):
    if ELEM == 1:
        return addr.to(tl.pointer_type(tl.int8))
    elif ELEM == 2:
        return addr.to(tl.pointer_type(tl.int16))
    else:
        return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def _gaps(gaps_ptr, offs, mask, GAP_BITS: tl.constexpr, WIDE: tl.constexpr = True):
    """[BLOCK] gaps (0 = escape) of a stream stored as signed integers of GAP_BITS bits: int64, or int32 unless WIDE
    (a 4-byte gap is then taken as stored: a valid one is below 2**31)."""
    g = tl.load(gaps_ptr + offs, mask=mask, other=1)
    g = g.to(tl.int64) if WIDE else g.to(tl.int32)
    if GAP_BITS < 32:
        g = g & ((1 << GAP_BITS) - 1)  # uint8 / uint16 gaps, read through a signed view
    return g


@triton.jit(do_not_specialize=["block0", "shift"])  # no new compilation per run's first block / element
def _counts_kernel(table_ptr, gaps_ptr, deltas_ptr, out_ptr, block0, shift,
                   NCOL: tl.constexpr, GAP_BITS: tl.constexpr, DELTA: tl.constexpr, BLOCK: tl.constexpr):
    b = block0 + tl.program_id(0).to(tl.int64)
    start = tl.load(table_ptr + b * NCOL + 0)
    end = tl.load(table_ptr + b * NCOL + 1)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    g = _gaps(gaps_ptr, offs - shift, mask, GAP_BITS)
    escaped = (g == 0) & mask
    plain = mask & (g != 0)
    tl.store(out_ptr + b * 4 + 0, tl.sum(tl.where(plain, g, 0), 0))
    tl.store(out_ptr + b * 4 + 1, tl.sum(escaped.to(tl.int64), 0))
    tl.store(out_ptr + b * 4 + 2, tl.sum((plain & (g < 0)).to(tl.int64), 0))
    if DELTA:
        d = tl.load(deltas_ptr + offs - shift, mask=mask, other=1)
        tl.store(out_ptr + b * 4 + 3, tl.sum(((d == 0) & mask).to(tl.int64), 0))


@triton.jit(do_not_specialize=["block0", "shift"])
def _decode_kernel(table_ptr, gaps_ptr, overflow_ptr, values_ptr, escapes_ptr, idx_ptr, old_ptr, new_ptr, terms_ptr,
                   block0, shift, NCOL: tl.constexpr, GAP_BITS: tl.constexpr, DELTA: tl.constexpr,
                   ELEM: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BITS: tl.constexpr, WIDE: tl.constexpr):
    b = block0 + tl.program_id(0).to(tl.int64)
    row = table_ptr + b * NCOL
    start = tl.load(row + 0)
    end = tl.load(row + 1)
    numel = tl.load(row + 2)
    addr = tl.load(row + 3)
    ovf_hi = tl.load(row + 4)
    esc_hi = tl.load(row + 5)
    index_base = tl.load(row + 6)
    ovf_pos = tl.load(row + 7)
    esc_pos = tl.load(row + 8)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    # The scans run in int32 unless a member has 2**31 elements or more (WIDE): within a block of a valid stream
    # the escape ranks stay below BLOCK and the gaps' running sum below numel. A malformed stream may wrap; its
    # indices are clamped into bounds all the same, and the checks come from block_counts' int64 sums.
    g = _gaps(gaps_ptr, offs - shift, mask, GAP_BITS, WIDE)
    escaped = (g == 0) & mask
    rank = tl.cumsum(escaped.to(tl.int32), 0)  # escapes up to and including each element
    at = tl.maximum(tl.minimum(ovf_pos + rank - 1, ovf_hi - 1), 0)  # in range even for a malformed stream
    g = tl.where(escaped, tl.load(overflow_ptr + at, mask=escaped, other=1).to(g.dtype), g)
    g = tl.where(mask, g, 0)
    idx = index_base + (tl.cumsum(g, 0) - 1).to(tl.int64)
    idx = tl.minimum(tl.maximum(idx, 0), numel - 1)  # where the checks pass this changes nothing
    old = tl.load(_typed(addr, ELEM) + idx, mask=mask, other=0)
    if DELTA:
        d = tl.load(values_ptr + offs - shift, mask=mask, other=1)  # int8
        escaped_delta = (d == 0) & mask
        rank_delta = tl.cumsum(escaped_delta.to(tl.int32), 0)
        at_delta = tl.maximum(tl.minimum(esc_pos + rank_delta - 1, esc_hi - 1), 0)
        escape = tl.load(escapes_ptr + at_delta, mask=escaped_delta, other=0)
        if ELEM == 4:
            summed = old.to(tl.int64) + d.to(tl.int64)
        else:
            summed = old.to(tl.int32) + d.to(tl.int32)
        new = tl.where(escaped_delta, escape, summed.to(old.dtype))  # wraps in the width
    else:
        new = tl.load(values_ptr + offs - shift, mask=mask, other=0)
    # w(i) = T[i mod 2**22] + 2 * (i div 2**22), T[j] = (mix32(j) mod 2**15) | 1 (weight_updates.checksum)
    h = (idx & ((1 << CHUNK_BITS) - 1)).to(tl.uint32) * 2654435761
    h = h ^ (h >> 16)
    h = h * 0x45D9F3B
    h = h ^ (h >> 16)
    w = ((h & 0x7FFF) | 1).to(tl.int64) + 2 * (idx >> CHUNK_BITS)
    term = tl.where(mask, (new.to(tl.int64) - old.to(tl.int64)) * w, 0)
    tl.store(terms_ptr + b, tl.sum(term, 0))
    tl.store(idx_ptr + offs, idx.to(tl.int32), mask=mask)
    tl.store(old_ptr + offs, old, mask=mask)
    tl.store(new_ptr + offs, new, mask=mask)


@triton.jit
def _access_kernel(table_ptr, idx_ptr, values_ptr, out_ptr, NCOL: tl.constexpr, MODE: tl.constexpr,
                   ELEM: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(table_ptr + b * NCOL + 0)
    end = tl.load(table_ptr + b * NCOL + 1)
    addr = tl.load(table_ptr + b * NCOL + 3)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    ptrs = _typed(addr, ELEM) + tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int64)
    if MODE == 0:  # scatter
        tl.store(ptrs, tl.load(values_ptr + offs, mask=mask), mask=mask)
    else:  # compare: mismatching elements per block
        got = tl.load(ptrs, mask=mask, other=0)
        want = tl.load(values_ptr + offs, mask=mask, other=0)
        tl.store(out_ptr + b, tl.sum(((got != want) & mask).to(tl.int32), 0))


def _signed(t: torch.Tensor) -> torch.Tensor:
    return t.view(SIGNED_VIEW[t.element_size()])


def block_counts(table: torch.Tensor, blocks: range, gaps: torch.Tensor, deltas: torch.Tensor | None, shift: int,
                 out: torch.Tensor) -> None:
    """Fill ``out`` [B, 4] int64 (zeros on entry) rows ``blocks`` (one run of patches with one gap dtype, and bit deltas or not):
    the sum of the plain gaps, the number of escaped gaps, of gaps < 0, of escaped deltas (0 without deltas).
    ``gaps`` / ``deltas``: the run's streams end to end, element ``shift`` first (the table's ``start``
    counts from the group's first element)."""
    if len(blocks):
        signed = _signed(gaps)
        _counts_kernel[(len(blocks),)](table, signed, signed if deltas is None else deltas, out, blocks.start, shift,
                                       NCOL=NCOL, GAP_BITS=8 * gaps.element_size(), DELTA=deltas is not None, BLOCK=BLOCK)


def blocks_per_patch(sizes: np.ndarray) -> np.ndarray:
    """[k] int64: the blocks of each of k patches of ``sizes`` elements (an empty patch has none)."""
    return -(-sizes // BLOCK)


def block_table(sizes: torch.Tensor, numels: torch.Tensor, addrs: torch.Tensor, overflows: torch.Tensor,
                escapes: torch.Tensor, blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The block table [B, NCOL] int64 of k patches laid end to end, built where the arguments are (on the device:
    a few launches, no host sync): ``sizes``, ``numels``, ``addrs`` (live data pointers), ``overflows`` and
    ``escapes`` (counts) and ``blocks`` (``blocks_per_patch``) are [k] int64; ``num_blocks``: their sum, B."""
    k = sizes.shape[0]
    first_block = torch.cumsum(blocks, 0) - blocks  # [k]
    member = torch.repeat_interleave(torch.arange(k, device=sizes.device), blocks, output_size=num_blocks)  # [B]
    first = first_block.index_select(0, member)
    elem_start = torch.cumsum(sizes, 0) - sizes
    ovf_start, esc_start = torch.cumsum(overflows, 0) - overflows, torch.cumsum(escapes, 0) - escapes
    start = elem_start.index_select(0, member) + (torch.arange(num_blocks, device=sizes.device) - first) * BLOCK
    columns = {
        START: start,
        END: torch.minimum(start + BLOCK, (elem_start + sizes).index_select(0, member)),
        NUMEL: numels.index_select(0, member),
        ADDR: addrs.index_select(0, member),
        OVF_HI: (ovf_start + overflows).index_select(0, member),
        ESC_HI: (esc_start + escapes).index_select(0, member),
        INDEX_BASE: torch.zeros_like(start),
        OVF_POS: ovf_start.index_select(0, member),
        ESC_POS: esc_start.index_select(0, member),
        FIRST: first,
    }
    return torch.stack([columns[c] for c in range(NCOL)], 1)


def block_starts(table: torch.Tensor, counts: torch.Tensor, overflow_scan: torch.Tensor) -> None:
    """Rewrite the device columns of ``table`` from ``counts`` ([B, 4], ``block_counts``): each block's gaps
    before it within its patch (its first index is that plus its first gap, minus one), first overflow value and first escape value (on entry ``ovf_pos`` / ``esc_pos``
    hold its patch's first ones); and ``counts[:, 0]`` becomes the sum of all the block's gaps. ``overflow_scan``: [e + 1] int64 inclusive scan of the overflow values after a 0."""
    escapes = counts[:, [1, 3]]  # [B, 2] escaped gaps, escaped deltas
    # two 1-D scans: a scan along dim 0 of a [B, 2] tensor runs serially over the blocks on CUDA (5 ms at 56k blocks)
    before = torch.stack([torch.cumsum(counts[:, 1], 0), torch.cumsum(counts[:, 3], 0)], 1) - escapes  # [B, 2] exclusive
    first = table[:, FIRST]
    ranks = before - before.index_select(0, first)  # [B, 2] within the block's patch
    starts = table[:, [OVF_POS, ESC_POS]] + ranks  # [B, 2]
    ovf_hi = table[:, OVF_HI]
    lo = torch.minimum(starts[:, 0], ovf_hi)
    hi = torch.minimum(starts[:, 0] + escapes[:, 0], ovf_hi)
    totals = counts[:, 0] + overflow_scan.index_select(0, hi) - overflow_scan.index_select(0, lo)  # [B] gap sums
    gap_before = torch.cumsum(totals, 0) - totals
    table[:, INDEX_BASE] = gap_before - gap_before.index_select(0, first)
    table[:, [OVF_POS, ESC_POS]] = starts
    counts[:, 0] = totals  # per block: the sum of all its gaps


def decode(table: torch.Tensor, blocks: range, gaps: torch.Tensor, overflow: torch.Tensor, values: torch.Tensor,
           escapes: torch.Tensor | None, shift: int, indices: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
           terms: torch.Tensor, *, max_numel: int) -> None:
    """Decode one run's blocks (``table`` complete, ``block_starts``) into ``indices`` [n] int32, ``old`` and
    ``new`` [n] (the engine dtype) and ``terms`` [B] int64 (each block's checksum change). ``overflow``: [e + 1]
    the group's overflow values and one spare; ``values``: the run's new values or int8 deltas, element
    ``shift`` first; ``escapes``: [num escapes + 1] the group's escape values and one spare (deltas only).
    ``max_numel``: the largest member's elements (from ``WIDE_NUMEL`` on, the scans run in int64)."""
    if not len(blocks):
        return
    delta = escapes is not None
    _decode_kernel[(len(blocks),)](
        table, _signed(gaps), overflow, values if delta else _signed(values), _signed(escapes if delta else old), indices,
        _signed(old), _signed(new), terms, blocks.start, shift, NCOL=NCOL, GAP_BITS=8 * gaps.element_size(),
        DELTA=delta, ELEM=old.element_size(), BLOCK=BLOCK, CHUNK_BITS=22, WIDE=max_numel >= WIDE_NUMEL,
        num_warps=DECODE_WARPS)


def block_access(table: torch.Tensor, mode: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """Through the table's blocks (``indices``: [n] int32): ``SCATTER`` writes ``values`` [n] and returns None,
    ``COMPARE`` returns [B] int32 counts of elements whose current bits differ from ``values``."""
    num_blocks = table.shape[0]
    elem = values.element_size()
    if mode == COMPARE:
        out = target = torch.zeros(num_blocks, dtype=torch.int32, device=values.device)
    else:
        out, target = None, indices
    if num_blocks:
        _access_kernel[(num_blocks,)](table, indices, _signed(values), target, NCOL=NCOL, MODE=mode, ELEM=elem, BLOCK=BLOCK)
    return out
