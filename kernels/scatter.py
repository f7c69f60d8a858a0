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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import SIGNED_VIEW, device_index, upload

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


@dataclass(frozen=True, slots=True)
class TensorTable:
    """The data pointers of k contiguous tensors of one dtype on one device, checked and uploaded once, for
    any number of `gather_many` / `scatter_many` calls. It does not keep the tensors alive: the caller does
    (and must not resize or reallocate them while the table is used)."""

    ptrs: torch.Tensor  # [k] int64 on the device
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(tensors: Sequence[torch.Tensor]) -> "TensorTable":
        if not tensors:
            raise ValueError("needs at least one tensor")
        device, dtype = tensors[0].device, tensors[0].dtype
        if tensors[0].element_size() not in SIGNED_VIEW:
            raise ValueError(f"supports 1-, 2- and 4-byte dtypes, not {dtype}")
        index = device_index(device)
        for t in tensors:
            if t.get_device() != index or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"tensors must be contiguous {dtype} on {device}; got {t.dtype} {tuple(t.shape)} "
                                 f"on {t.device}, contiguous={t.is_contiguous()}")
        return TensorTable(upload(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64), device), dtype, device)


def _table(tensors: TensorTable | Sequence[torch.Tensor], indices: torch.Tensor, segment: torch.Tensor) -> TensorTable:
    table = tensors if isinstance(tensors, TensorTable) else TensorTable.of(tensors)
    if indices.dtype != torch.int64 or segment.dtype != torch.int64 or indices.shape != segment.shape or indices.dim() != 1:
        raise ValueError(f"indices and segment must be [n] int64; got {indices.dtype} {tuple(indices.shape)} and "
                         f"{segment.dtype} {tuple(segment.shape)}")
    if indices.device != table.device or segment.device != table.device:
        raise ValueError(f"indices and segment must be on {table.device}")
    return table


def gather_many(tensors: TensorTable | Sequence[torch.Tensor], indices: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """[n] values: out[k] = tensors[segment[k]].view(-1)[indices[k]], in the tensors' dtype."""
    table = _table(tensors, indices, segment)
    out = torch.empty(indices.numel(), dtype=table.dtype, device=indices.device)
    if out.numel():
        elem = out.element_size()
        _gather_kernel[(triton.cdiv(out.numel(), _BLOCK),)](
            table.ptrs, segment, indices, out.view(SIGNED_VIEW[elem]), out.numel(), ELEM=elem, BLOCK=_BLOCK)
    return out


def scatter_many(tensors: TensorTable | Sequence[torch.Tensor], indices: torch.Tensor, segment: torch.Tensor,
                 values: torch.Tensor) -> None:
    """tensors[segment[k]].view(-1)[indices[k]] = values[k], in place."""
    table = _table(tensors, indices, segment)
    if values.shape != indices.shape or values.dtype != table.dtype or values.device != indices.device:
        raise ValueError(f"values must be [{indices.numel()}] {table.dtype} on {indices.device}; got "
                         f"{values.dtype} {tuple(values.shape)} on {values.device}")
    if values.numel():
        elem = values.element_size()
        _scatter_kernel[(triton.cdiv(values.numel(), _BLOCK),)](
            table.ptrs, segment, indices, values.contiguous().view(SIGNED_VIEW[elem]), values.numel(), ELEM=elem, BLOCK=_BLOCK)
