"""Update records (``Dense``, ``Patch``) and the delta-gap index codec.

A ``Patch`` carries the flat checkpoint indices whose bit patterns changed, compressed as gaps
between consecutive indices (``gap[0] = idx[0] + 1``, ``gap[k] = idx[k] - idx[k-1]``, all >= 1) in the
narrowest of uint8 / uint16 / int32 that minimises bytes. A gap that does not fit is written as the
escape value 0 and its true value goes, in order, into an int32 ``overflow`` array. Decoding is
vectorised and runs on the tensors' device.

This module does not decide what changed (see ``differ``) and does not validate records against a
target (see ``session``); ``decode_many`` only checks the codec's own invariants.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.common import SIGNED_VIEW, upload
from weight_updates.checksum import checksum, concat_to, segment_sums
from weight_updates.errors import WeightUpdateError

GAP_DTYPES = (torch.uint8, torch.uint16, torch.int32)
_GAP_LIMIT = {torch.uint8: (1 << 8) - 1, torch.uint16: (1 << 16) - 1, torch.int32: (1 << 31) - 1}
MAX_PATCH_NUMEL = 1 << 31  # indices and overflow gaps are int32-representable below this


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedIndices:
    """Strictly increasing flat indices, delta-encoded."""

    gaps: torch.Tensor  # [num_indices] uint8 | uint16 | int32; 0 = escape, value in overflow
    overflow: torch.Tensor  # [num_escapes] int32, the escaped gaps in order

    @property
    def num_indices(self) -> int:
        return self.gaps.numel()

    @property
    def nbytes(self) -> int:
        return self.gaps.numel() * self.gaps.element_size() + self.overflow.numel() * 4

    def decode(self, device: torch.device) -> torch.Tensor:
        """[num_indices] int64 indices on ``device``. Raises WeightUpdateError on a malformed stream
        (see ``decode_many``). One host sync."""
        (indices,), malformed, _ = decode_many([self], device)
        if malformed.item():
            raise WeightUpdateError(f"malformed index stream: {self.gaps.numel()} gaps, {self.overflow.numel()} overflow values")
        return indices

    @staticmethod
    def encode(indices: torch.Tensor) -> "PackedIndices":
        """[n] int64 strictly increasing indices (< MAX_PATCH_NUMEL) -> the smallest encoding."""
        assert indices.dtype == torch.int64 and indices.dim() == 1
        gaps = torch.diff(indices, prepend=indices.new_full((1,), -1))  # [n], all >= 1
        over8, over16 = torch.stack([(gaps > _GAP_LIMIT[torch.uint8]).sum(), (gaps > _GAP_LIMIT[torch.uint16]).sum()]).tolist()
        n = gaps.numel()
        cost = {torch.uint8: n + 4 * over8, torch.uint16: 2 * n + 4 * over16, torch.int32: 4 * n}
        gap_dtype = min(GAP_DTYPES, key=lambda d: cost[d])  # ties go to the narrower type
        too_big = gaps > _GAP_LIMIT[gap_dtype]
        overflow = gaps[too_big].to(torch.int32)
        gaps = gaps.masked_fill(too_big, 0).to(gap_dtype)
        return PackedIndices(gaps=gaps, overflow=overflow)


def decode_many(packed: Sequence[PackedIndices], device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Decode k streams in a few kernels, without a host sync.

    Returns ([n_i] int64 indices per stream, [k] bool ``malformed``, [k] int64 last index or -1 if
    empty), all on ``device``. ``malformed[i]`` is set when stream i's escape count differs from its
    overflow count or one of its overflow gaps is < 1; while no stream is malformed, every stream's
    indices are strictly increasing and >= 0 (upper bounds are the caller's). Dtypes and ranks are
    checked on the host (WeightUpdateError).
    """
    for p in packed:
        if p.gaps.dtype not in GAP_DTYPES or p.gaps.dim() != 1:
            raise WeightUpdateError(f"gaps must be 1-D {GAP_DTYPES}, got {p.gaps.dtype} {tuple(p.gaps.shape)}")
        if p.overflow.dtype != torch.int32 or p.overflow.dim() != 1:
            raise WeightUpdateError(f"overflow must be 1-D int32, got {p.overflow.dtype}")
    lengths = [p.num_indices for p in packed]
    num_overflow = [p.overflow.numel() for p in packed]
    sentinel = torch.ones(1, dtype=torch.int32)  # keeps the overflow gather in range when nothing escaped
    gaps = concat_to([p.gaps for p in packed], torch.int32, device).to(torch.int64)  # [total]
    overflow = concat_to([*(p.overflow for p in packed), sentinel], torch.int32, device).to(torch.int64)  # [escapes + 1]
    escapes = gaps == 0  # [total]
    rank = (torch.cumsum(escapes, 0) - 1).clamp_(0, overflow.numel() - 1)  # [total] which overflow value
    gaps = torch.where(escapes, overflow[rank], gaps)
    num_escapes = segment_sums(escapes.to(torch.int64), lengths)  # [k]
    num_bad_overflow = segment_sums((overflow[:-1] < 1).to(torch.int64), num_overflow)  # [k]
    expected_escapes = upload(torch.tensor(num_overflow, dtype=torch.int64), device)
    malformed = (num_escapes != expected_escapes) | (num_bad_overflow > 0)
    # Per-stream cumsum: the global running sum minus what came before the stream.
    running = torch.cat([gaps.new_zeros(1), torch.cumsum(gaps, 0)])  # [total + 1]
    bounds = upload(torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64), device)  # [k + 1]
    before = running[bounds[:-1]]  # [k]
    sizes = upload(torch.tensor(lengths, dtype=torch.int64), device)  # [k]
    indices = running[1:] - torch.repeat_interleave(before, sizes, output_size=sum(lengths)) - 1  # [total]
    last = torch.where(sizes > 0, running[bounds[1:]] - before - 1, -1)  # [k]
    return list(torch.split(indices, lengths)), malformed, last


@dataclass(frozen=True, kw_only=True, slots=True)
class Dense:
    """The whole checkpoint tensor of one parameter."""

    name: str
    tensor: torch.Tensor  # checkpoint shape, engine dtype
    checksum: int  # checksum.checksum of the parameter after the update

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> "Dense":
        """A Dense record with its checksum computed from ``tensor``."""
        return Dense(name=name, tensor=tensor, checksum=checksum(tensor))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(frozen=True, kw_only=True, slots=True)
class Patch:
    """New values at some flat indices of one parameter's checkpoint-shaped tensor.

    `values` holds either the new bit patterns (engine dtype) or int8 bit deltas: new bits = old bits +
    delta, as integers of the dtype's width, with 0 (never a real change) escaping to the next entry of
    `escapes`, which holds the new value itself. A small optimizer step moves most bf16 weights by one or
    two units in the last place, so most changes take one byte instead of two. Deltas are exact and need
    the receiver's base to be the sender's, which the post-update checksum verifies before any write.
    """

    name: str
    indices: PackedIndices  # num_indices == values.numel()
    values: torch.Tensor  # [num_indices] engine dtype (new bit patterns) or int8 (bit deltas, 0 = escape)
    checksum: int  # checksum.checksum of the parameter after the update
    escapes: torch.Tensor | None = None  # [num_escapes] engine dtype, new values of the escaped deltas

    @property
    def is_delta(self) -> bool:
        return self.values.dtype == torch.int8

    @property
    def nbytes(self) -> int:
        extra = 0 if self.escapes is None else self.escapes.numel() * self.escapes.element_size()
        return self.indices.nbytes + self.values.numel() * self.values.element_size() + extra

Update = Dense | Patch


def bit_deltas(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 deltas [n], escapes [k] of new's dtype): new bits = old bits + delta, or, where the delta
    byte is 0, the next escape. old and new differ at every position."""
    int_dtype = SIGNED_VIEW[new.element_size()]
    delta = new.view(int_dtype).to(torch.int64) - old.view(int_dtype).to(torch.int64)  # [n]
    fits = (delta >= -128) & (delta <= 127) & (delta != 0)
    return torch.where(fits, delta, 0).to(torch.int8), new[~fits]


def apply_bit_deltas(old: torch.Tensor, delta: torch.Tensor, escapes: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
    """New values [n] (old's dtype) from old values [n], int8 deltas [n] and escapes. Raises
    WeightUpdateError when the number of escape bytes is not the number of escapes (a host sync; skipped
    when the caller has `checked` the counts already). Concatenated patches decode together: escapes are
    consumed in order."""
    int_dtype = SIGNED_VIEW[old.element_size()]
    escaped = delta == 0  # [n]
    if not checked and int(escaped.sum()) != escapes.numel():
        raise WeightUpdateError(f"{int(escaped.sum())} escaped deltas but {escapes.numel()} escape values")
    new = (old.view(int_dtype).to(torch.int64) + delta.to(torch.int64)).to(int_dtype).view(old.dtype)
    if escapes.numel():
        new[escaped] = escapes.to(old.dtype)
    return new
