"""Gather from and scatter into many tensors in one Triton launch (the CUDA path of sparse weight patches).

A patch of a few hundred checkpoint tensors touches each at scattered flat indices. Done per tensor that is
several launches each (and a host round trip per launch's setup); here one launch reads or writes every
element of every patch through a table of data pointers: element k goes to tensor `segment[k]` at flat
index `indices[k]`. All tensors share one element size and are contiguous; bounds are the caller's (the
weight-update session checks them before anything is written).

Not here: bounds checks, duplicate-index semantics (patch indices are strictly increasing per tensor),
non-contiguous tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.common import SIGNED_VIEW, upload

_BLOCK = 1024


@triton.jit
def typed_pointer(addr, ELEM: tl.constexpr):
    """An int64 address (a tensor's data_ptr) as a pointer to same-width signed integers of ELEM bytes."""
    if ELEM == 1:
        return addr.to(tl.pointer_type(tl.int8))
    elif ELEM == 2:
        return addr.to(tl.pointer_type(tl.int16))
    else:
        return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def _element_pointers(ptrs_ptr, segment_ptr, indices_ptr, offs, mask, ELEM: tl.constexpr):
    seg = tl.load(segment_ptr + offs, mask=mask, other=0)
    idx = tl.load(indices_ptr + offs, mask=mask, other=0)
    addr = tl.load(ptrs_ptr + seg, mask=mask, other=0)
    return typed_pointer(addr, ELEM) + idx


@triton.jit
def _gather_kernel(ptrs_ptr, segment_ptr, indices_ptr, out_ptr, n, ELEM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = _element_pointers(ptrs_ptr, segment_ptr, indices_ptr, offs, mask, ELEM)
    tl.store(out_ptr + offs, tl.load(src, mask=mask), mask=mask)


@triton.jit
def _scatter_kernel(ptrs_ptr, segment_ptr, indices_ptr, values_ptr, n, ELEM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dst = _element_pointers(ptrs_ptr, segment_ptr, indices_ptr, offs, mask, ELEM)
    tl.store(dst, tl.load(values_ptr + offs, mask=mask), mask=mask)


def _check(tensors: Sequence[torch.Tensor], indices: torch.Tensor, segment: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not tensors:
        raise ValueError("needs at least one tensor")
    device, dtype = tensors[0].device, tensors[0].dtype
    if tensors[0].element_size() not in SIGNED_VIEW:
        raise ValueError(f"supports 1-, 2- and 4-byte dtypes, not {dtype}")
    for t in tensors:
        if t.device != device or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"tensors must be contiguous {dtype} on {device}; got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}, contiguous={t.is_contiguous()}")
    if indices.dtype != torch.int64 or segment.dtype != torch.int64 or indices.shape != segment.shape or indices.dim() != 1:
        raise ValueError(f"indices and segment must be [n] int64; got {indices.dtype} {tuple(indices.shape)} and "
                         f"{segment.dtype} {tuple(segment.shape)}")
    if indices.device != device or segment.device != device:
        raise ValueError(f"indices and segment must be on {device}")
    ptrs = upload(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64), device)
    return ptrs, tensors[0].element_size()


def gather_many(tensors: Sequence[torch.Tensor], indices: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """[n] values: out[k] = tensors[segment[k]].view(-1)[indices[k]], in the tensors' dtype."""
    ptrs, elem = _check(tensors, indices, segment)
    out = torch.empty(indices.numel(), dtype=tensors[0].dtype, device=indices.device)
    if out.numel():
        _gather_kernel[(triton.cdiv(out.numel(), _BLOCK),)](
            ptrs, segment, indices, out.view(SIGNED_VIEW[elem]), out.numel(), ELEM=elem, BLOCK=_BLOCK)
    return out


def scatter_many(tensors: Sequence[torch.Tensor], indices: torch.Tensor, segment: torch.Tensor,
                 values: torch.Tensor) -> None:
    """tensors[segment[k]].view(-1)[indices[k]] = values[k], in place."""
    ptrs, elem = _check(tensors, indices, segment)
    if values.shape != indices.shape or values.dtype != tensors[0].dtype or values.device != indices.device:
        raise ValueError(f"values must be [{indices.numel()}] {tensors[0].dtype} on {indices.device}; got "
                         f"{values.dtype} {tuple(values.shape)} on {values.device}")
    if values.numel():
        _scatter_kernel[(triton.cdiv(values.numel(), _BLOCK),)](
            ptrs, segment, indices, values.contiguous().view(SIGNED_VIEW[elem]), values.numel(), ELEM=elem, BLOCK=_BLOCK)
