"""Position-weighted bit checksums of many tensors in one Triton launch (the CUDA path of
`weight_updates.checksum.checksum_tensor`, whose docstring defines the checksum).

The torch path widens every element to int64 and multiplies by a weight table held in memory (tens of
bytes of traffic per 2-byte element, and a few launches per tensor). Here each program reads one block of
one tensor and adds one int64 partial sum into that tensor's result. Per launch the host uploads three
numbers per tensor (element offset from the first tensor, size, first block); a program finds its tensor
by binary search over the first blocks, so no host or device work grows with the number of blocks.
Per element the work is one load (vectorised when every address is 16-byte aligned) and a
32-bit hash: with ``w(i) = T[i mod 2**22] + 2 * (i div 2**22)`` and a block inside one 2**22 chunk,

    sum_block s(i) * w(i) = sum_block s(i) * T[j(i)]  +  2 * chunk * sum_block s(i)

where ``T[j] < 2**15`` is recomputed in uint32 registers and ``s * T`` fits in int32 for 1- and 2-byte
elements. Integer sums modulo 2**64 do not depend on order, so the result equals the torch path bitwise.

Not here: the checksum's definition or its patch deltas (`weight_updates/checksum.py`), 8-byte dtypes,
non-contiguous tensors (callers make them contiguous).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.common import SIGNED_VIEW, upload

_BLOCK = 4096  # divides 2**22, so no block straddles a chunk of the position weights
_CHUNK_BITS = 22  # w(i) = T[i mod 2**22] + 2 * (i div 2**22), as in weight_updates.checksum
_ALIGN = 16  # bytes; addresses that are all multiples of this get vector loads


@triton.jit(do_not_specialize=["num_tensors"])  # one compilation for any number of tensors
def _checksum_blocks_kernel(
    anchor_ptr, offsets_ptr, numels_ptr, first_block_ptr, num_tensors, out_ptr,
    ELEM: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BITS: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # The tensor of this block: the last t with first_block[t] <= pid (first_block: [k + 1], ascending).
    lo = 0
    hi = num_tensors
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(first_block_ptr + mid) <= pid:
            lo = mid
        else:
            hi = mid
    tid = lo
    start = (pid - tl.load(first_block_ptr + tid)) * BLOCK  # int64 flat index of the block's first element
    numel = tl.load(numels_ptr + tid)
    offset = tl.load(offsets_ptr + tid)  # the tensor's first element, in elements from anchor_ptr
    if ALIGNED:
        offset = tl.multiple_of(offset, 16 // ELEM)
    base = anchor_ptr + offset + start
    local = tl.arange(0, BLOCK)  # [BLOCK] int32
    if start + BLOCK <= numel:
        s = tl.load(base + local)
    else:
        s = tl.load(base + local, mask=local < numel - start, other=0)
    # T[j] = (mix32(j) mod 2**15) | 1 for j = i mod 2**22, in wrapping uint32 (the torch table's int64
    # arithmetic masked to 32 bits is the same)
    h = ((start & ((1 << CHUNK_BITS) - 1)).to(tl.uint32) + local.to(tl.uint32)) * 2654435761
    h = h ^ (h >> 16)
    h = h * 0x45D9F3B
    h = h ^ (h >> 16)
    t = ((h & 0x7FFF) | 1).to(tl.int32)  # [BLOCK], < 2**15
    if ELEM == 4:
        weighted = tl.sum(s.to(tl.int64) * t.to(tl.int64), 0)
        plain = tl.sum(s.to(tl.int64), 0)
    else:
        weighted = tl.sum((s.to(tl.int32) * t).to(tl.int64), 0)  # |s * t| < 2**30
        plain = tl.sum(s.to(tl.int32), 0).to(tl.int64)  # |sum| < 2**15 * BLOCK
    tl.atomic_add(out_ptr + tid, weighted + 2 * (start >> CHUNK_BITS) * plain, sem="relaxed")


def checksum_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[k] int64 checksums of k contiguous tensors of one element size (1, 2 or 4 bytes) on one device."""
    if not tensors:
        raise ValueError("checksum_many needs at least one tensor")
    device, elem = tensors[0].device, tensors[0].element_size()
    if elem not in SIGNED_VIEW:
        raise ValueError(f"checksums support 1-, 2- and 4-byte dtypes, not {tensors[0].dtype}")
    for t in tensors:
        if t.device != device or t.element_size() != elem or not t.is_contiguous():
            raise ValueError(f"tensors must be contiguous, on {device}, of one element size ({elem} bytes); "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}")
    k = len(tensors)
    # Addresses as element offsets from the first tensor, so that loads go through a pointer argument
    # whose 16-byte alignment the compiler knows (it cannot know that of an address loaded from memory).
    anchor = tensors[0].view(SIGNED_VIEW[elem])
    offsets = [(t.data_ptr() - anchor.data_ptr()) // elem for t in tensors]
    numels = [t.numel() for t in tensors]
    first_block = [0, *itertools.accumulate(triton.cdiv(n, _BLOCK) for n in numels)]  # [k + 1]
    table = upload(torch.tensor([*offsets, *numels, *first_block], dtype=torch.int64), device)  # [3k + 1]
    out = torch.zeros(k, dtype=torch.int64, device=device)
    if first_block[-1]:
        aligned = all(t.data_ptr() % _ALIGN == 0 for t in tensors)
        _checksum_blocks_kernel[(first_block[-1],)](
            anchor, table[:k], table[k : 2 * k], table[2 * k :], k, out,
            ELEM=elem, BLOCK=_BLOCK, CHUNK_BITS=_CHUNK_BITS, ALIGNED=aligned, num_warps=8)
    return out
