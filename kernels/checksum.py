"""Position-weighted bit checksums of many tensors in one Triton launch (the CUDA path of
`weight_updates.checksum.checksum_tensor`, whose docstring defines the checksum).

The torch path widens every element to int64 and multiplies by a weight table held in memory (tens of
bytes of traffic per 2-byte element, and a few launches per tensor). Here each program reads one block of
one tensor through a table of data pointers, recomputes the position weights in registers, and writes one
int64 partial sum; `index_add_` folds the partials per tensor. Integer sums modulo 2**64 do not depend on
order, so the result equals the torch path bitwise.

Not here: the checksum's definition or its patch deltas (`weight_updates/checksum.py`), 8-byte dtypes,
non-contiguous tensors (callers make them contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.common import SIGNED_VIEW, upload
from kernels.scatter import typed_pointer

_BLOCK = 4096
_CHUNK_BITS = 22  # w(i) = T[i mod 2**22] + 2 * (i div 2**22), as in weight_updates.checksum


@triton.jit
def _checksum_blocks_kernel(
    ptrs_ptr, numels_ptr, block_tensor_ptr, block_start_ptr, partial_ptr,
    ELEM: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    tid = tl.load(block_tensor_ptr + pid)
    start = tl.load(block_start_ptr + pid)  # int64
    numel = tl.load(numels_ptr + tid)
    base = typed_pointer(tl.load(ptrs_ptr + tid), ELEM)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK] flat element indices
    s = tl.load(base + offs, mask=offs < numel, other=0).to(tl.int64)  # sign-extended bits
    # T[j] = (mix32(j) mod 2**15) | 1, in int64 exactly as the torch table is built
    h = ((offs & ((1 << CHUNK_BITS) - 1)) * 2654435761) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    w = ((h & 0x7FFF) | 1) + 2 * (offs >> CHUNK_BITS)
    tl.store(partial_ptr + pid, tl.sum(s * w, 0))


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
    numels = [t.numel() for t in tensors]
    blocks = [triton.cdiv(n, _BLOCK) for n in numels]
    block_tensor = torch.repeat_interleave(torch.arange(len(tensors)), torch.tensor(blocks))  # [num blocks]
    block_start = torch.cat([torch.arange(b, dtype=torch.int64) * _BLOCK for b in blocks])  # [num blocks]
    table = torch.cat([torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64),
                       torch.tensor(numels, dtype=torch.int64), block_tensor, block_start])
    table = upload(table, device)
    k, nb = len(tensors), block_tensor.numel()
    ptrs, numel_t, block_tensor_d, block_start_d = table[:k], table[k : 2 * k], table[2 * k : 2 * k + nb], table[2 * k + nb :]
    out = torch.zeros(k, dtype=torch.int64, device=device)
    if nb:
        partial = torch.empty(nb, dtype=torch.int64, device=device)  # [num blocks]
        _checksum_blocks_kernel[(nb,)](ptrs, numel_t, block_tensor_d, block_start_d, partial,
                                       ELEM=elem, BLOCK=_BLOCK, CHUNK_BITS=_CHUNK_BITS, num_warps=4)
        out.index_add_(0, block_tensor_d, partial)
    return out
