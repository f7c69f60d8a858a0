"""Update records (``Dense``, ``Patch``) and the delta-gap index codec.

A ``Patch`` carries the flat checkpoint indices whose bit patterns changed, compressed as gaps
between consecutive indices (``gap[0] = idx[0] + 1``, ``gap[k] = idx[k] - idx[k-1]``, all >= 1) in the
narrowest of uint8 / uint16 / int32 that minimises bytes. A gap that does not fit is written as the
escape value 0 and its true value goes, in order, into an int32 ``overflow`` array. Encoding and decoding
are vectorised and run on the tensors' device; many streams encode together (``stream_gaps``,
``encode_streams``) in a fixed number of kernels and without a host sync once the caller knows, per
stream, how many gaps exceed each width.

This module does not decide what changed (see ``differ``) and does not validate records against a
target (see ``session``); ``PackedIndices.decode`` only checks the codec's own invariants.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.common import SIGNED_VIEW, upload
from weight_updates.checksum import checksum, concat_to
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
        (its escape count differs from its overflow count, or a gap is < 1; dtypes and ranks are checked
        first). One host sync."""
        check_stream_dtypes([self])
        counts = upload(torch.tensor([self.num_indices, self.overflow.numel()], dtype=torch.int64), device)  # [2]
        decoded = decode_streams(concat_to([self.gaps], torch.int64, device), concat_to([self.overflow], torch.int64, device), counts[:1])
        if bool((decoded.sums[0, 1] != counts[1]) | decoded.bad.any()):
            raise WeightUpdateError(f"malformed index stream: {self.gaps.numel()} gaps, {self.overflow.numel()} overflow values")
        return decoded.indices

    @staticmethod
    def encode(indices: torch.Tensor) -> "PackedIndices":
        """[n] int64 strictly increasing indices (< MAX_PATCH_NUMEL) -> the smallest encoding. One host sync
        (``encode_streams`` encodes many streams with none)."""
        assert indices.dtype == torch.int64 and indices.dim() == 1
        gaps = torch.diff(indices, prepend=indices.new_full((1,), -1))  # [n], all >= 1
        over8, over16 = torch.stack([(gaps > _GAP_LIMIT[torch.uint8]).sum(), (gaps > _GAP_LIMIT[torch.uint16]).sum()]).tolist()
        gap_dtype = choose_gap_dtype(gaps.numel(), over8, over16)
        too_big = gaps > _GAP_LIMIT[gap_dtype]
        overflow = gaps[too_big].to(torch.int32)
        gaps = gaps.masked_fill(too_big, 0).to(gap_dtype)
        return PackedIndices(gaps=gaps, overflow=overflow)


def choose_gap_dtype(n: int, over8: int, over16: int) -> torch.dtype:
    """The gap dtype of a stream of ``n`` gaps, ``over8`` / ``over16`` of them above the uint8 / uint16 limit:
    the one with the fewest bytes (gaps plus 4 per escape); ties go to the narrower type."""
    cost = {torch.uint8: n + 4 * over8, torch.uint16: 2 * n + 4 * over16, torch.int32: 4 * n}
    return min(GAP_DTYPES, key=lambda d: cost[d])


def packed_nbytes(n: int, gap_dtype: torch.dtype, num_overflow: int) -> int:
    """``PackedIndices.nbytes`` of a stream of ``n`` gaps of ``gap_dtype`` with ``num_overflow`` escapes."""
    return n * gap_dtype.itemsize + 4 * num_overflow


def stream_gaps(indices: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Gaps of k concatenated index streams, as ``PackedIndices.encode`` computes them per stream.

    ``indices``: [n] int64, each stream's strictly increasing indices, streams one after another;
    ``segment``: [n] int64, the stream of each element (non-decreasing). Returns [n] int64 gaps, all >= 1:
    a stream's first gap is its first index + 1, every other gap the distance to the previous index."""
    prev = torch.nn.functional.pad(indices, (1, 0), value=-1)[:-1]  # [n]
    first = segment != torch.nn.functional.pad(segment, (1, 0), value=-1)[:-1]  # [n] the first element of a stream
    return indices - prev.masked_fill_(first, -1)


def gaps_over_limits(gaps: torch.Tensor) -> torch.Tensor:
    """[2, n] bool: which gaps exceed the uint8 and the uint16 limit (per-stream sums of these feed
    ``choose_gap_dtype`` and ``encode_streams``)."""
    return torch.stack([gaps > _GAP_LIMIT[torch.uint8], gaps > _GAP_LIMIT[torch.uint16]])


def encode_streams(gaps: torch.Tensor, lengths: Sequence[int], gap_dtypes: Sequence[torch.dtype | None],
                   over: Sequence[tuple[int, int]]) -> list["PackedIndices | None"]:
    """Encode k streams whose gaps are concatenated (``stream_gaps``) without a host sync: the same
    ``PackedIndices`` as ``PackedIndices.encode`` of each stream, as views into one array per gap dtype used.

    ``gaps``: [n] int64; ``lengths[i]``: stream i's number of gaps; ``gap_dtypes[i]``: its dtype, or None to
    skip it (its gaps still count for the positions of the others'); ``over[i]``: how many of its gaps exceed
    the uint8 and the uint16 limit. Streams of int32 gaps must index below MAX_PATCH_NUMEL (no escapes).
    Per gap dtype used: one narrowing and, for uint8 / uint16, one static-size compaction of the escaped gaps.
    """
    device = gaps.device
    starts = [0, *itertools.accumulate(lengths)]
    narrowed: dict[torch.dtype, torch.Tensor] = {}  # gap dtype -> [n] escaped narrow gaps
    overflow: dict[torch.dtype, torch.Tensor] = {}  # gap dtype -> [escapes of every stream] int32
    overflow_starts: dict[torch.dtype, list[int]] = {}  # gap dtype -> [k + 1] each stream's first escape
    for column, dtype in enumerate((torch.uint8, torch.uint16)):
        if dtype in gap_dtypes:
            too_big = gaps > _GAP_LIMIT[dtype]  # [n]
            overflow_starts[dtype] = [0, *itertools.accumulate(o[column] for o in over)]
            where = torch.nonzero_static(too_big, size=overflow_starts[dtype][-1]).squeeze(1)  # [escapes]
            overflow[dtype] = gaps.index_select(0, where).to(torch.int32)
            narrowed[dtype] = gaps.masked_fill(too_big, 0).to(dtype)
    if torch.int32 in gap_dtypes:
        narrowed[torch.int32] = gaps.to(torch.int32)
    no_overflow = torch.empty(0, dtype=torch.int32, device=device)
    packed: list[PackedIndices | None] = []
    for i, dtype in enumerate(gap_dtypes):
        if dtype is None:
            packed.append(None)
            continue
        escaped = no_overflow if dtype == torch.int32 else overflow[dtype][overflow_starts[dtype][i] : overflow_starts[dtype][i + 1]]
        packed.append(PackedIndices(gaps=narrowed[dtype][starts[i] : starts[i + 1]], overflow=escaped))
    return packed


def check_stream_dtypes(packed: Sequence[PackedIndices]) -> None:
    """Raise WeightUpdateError unless every stream's gaps and overflow have a codec dtype and rank 1."""
    for p in packed:
        if p.gaps.dtype not in GAP_DTYPES or p.gaps.dim() != 1:
            raise WeightUpdateError(f"gaps must be 1-D {GAP_DTYPES}, got {p.gaps.dtype} {tuple(p.gaps.shape)}")
        if p.overflow.dtype != torch.int32 or p.overflow.dim() != 1:
            raise WeightUpdateError(f"overflow must be 1-D int32, got {p.overflow.dtype}")


class SegmentBounds:
    """Where segments of ``lengths`` [k] (laid end to end from flat position ``base``: an int, or a [c, 1]
    tensor of row offsets) start and end, prepared once to read per-segment sums off any number of
    inclusive scans (``torch.cumsum`` of the values): two gathers per scan, no copy of it."""

    def __init__(self, lengths: torch.Tensor, base: torch.Tensor | int = 0) -> None:
        ends = base + torch.cumsum(lengths, 0)  # [k] or [c, k]
        bounds = torch.cat([ends, ends - lengths], -1)  # [..., 2k]: each segment's end, then its start
        self.index = (bounds - 1).clamp_(min=0)  # [..., 2k] the scan element holding the sum before the bound
        self.inside = bounds > 0  # [..., 2k] False where that sum is empty (a bound at position 0)
        self.k = lengths.shape[0]

    def totals(self, scan: torch.Tensor) -> torch.Tensor:
        """Per-segment sums [k] (or [c, k]) of the values whose inclusive scan is ``scan`` [m]."""
        if not scan.numel():  # every segment is empty
            return torch.zeros(self.inside.shape[:-1] + (self.k,), dtype=scan.dtype, device=scan.device)
        before = torch.where(self.inside, torch.take(scan, self.index), 0)
        return before[..., : self.k] - before[..., self.k :]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedStreams:
    """k index streams decoded together (``decode_streams``); all tensors on one device."""

    indices: torch.Tensor  # [n] int64, the streams' indices concatenated (garbage in a malformed stream)
    segment: torch.Tensor  # [n] int64, the stream of each element
    bounds: SegmentBounds  # the streams' bounds, for per-stream sums of [n] values
    sums: torch.Tensor  # [k, 2] int64 per stream: sum of its gaps (= last index + 1), escapes
    bad: torch.Tensor  # [n] bool: gap < 1 (an escaped gap's overflow value, or another gap): its stream is malformed
    escaped: torch.Tensor  # [n] bool: the gaps that were escapes

    def faults(self) -> torch.Tensor:
        """[k, 2] int64 per stream: its escaped gaps < 1, its other gaps < 1. ``bad.any()`` says whether any
        stream has one; this says which (two more scans, for naming a malformed stream)."""
        return torch.stack([self.bounds.totals(torch.cumsum(self.bad & self.escaped, 0)),
                            self.bounds.totals(torch.cumsum(self.bad & ~self.escaped, 0))], 1)


def segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive segments: ``values`` [n] or [c, n] (c rows of n) int64, ``lengths`` [k] int64 on
    the same device (summing to n) -> [k] or [k, c]. One cumsum and two gathers at the segment bounds: an
    ``index_add_`` of millions of elements into a few bins serializes on the device's atomics. Sums wrap
    modulo 2**64 as ``index_add_``'s do. The rows are scanned end to end as one 1-D tensor (differences
    within a row stay exact under wraparound): CUDA scans a 1-D tensor with a device-wide scan, but a 2-D
    one a column or row per thread block, which took seconds for n in the millions."""
    rows = (values[None] if values.dim() == 1 else values).contiguous()  # [c, n]
    num_rows, n = rows.shape
    if rows.numel() == 0:
        sums = torch.zeros(lengths.shape[0], num_rows, dtype=torch.int64, device=rows.device)
    else:
        base = torch.arange(num_rows, device=rows.device)[:, None] * n  # [c, 1]
        sums = SegmentBounds(lengths, base).totals(torch.cumsum(rows.view(-1), 0)).t()  # [k, c]
    return sums[:, 0] if values.dim() == 1 else sums


def segment_ids(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: which segment each element belongs to, for segments of ``lengths`` [k] (summing to
    ``total``) laid end to end; empty segments are skipped. A 1 added where each segment ends and one
    cumsum: CUDA's ``repeat_interleave`` fills each segment from one thread."""
    marks = torch.zeros(total + 1, dtype=torch.int64, device=lengths.device)
    marks.index_add_(0, torch.cumsum(lengths, 0), torch.ones_like(lengths))
    return torch.cumsum(marks[:total], 0)


def decode_streams(gaps: torch.Tensor, overflow: torch.Tensor, lengths: torch.Tensor) -> DecodedStreams:
    """Decode k streams in a fixed number of kernels whatever k is, without a host sync.

    ``gaps``: [n] int64, the streams' gaps one after another; ``overflow``: [e] int64, their overflow values
    likewise; ``lengths``: [k] int64, each stream's number of gaps; all on one device. Escapes take their
    overflow values by rank in one gather, and two 1-D scans (escapes, gaps) give every index and, read at the
    stream bounds (``SegmentBounds``), the per-stream sums. A stream is well formed when its escape count
    equals its overflow count and none of its gaps is ``bad`` (< 1); then its indices are strictly increasing
    and >= 0 (upper bounds are the caller's).
    """
    streams = SegmentBounds(lengths)
    if not gaps.numel():
        none = gaps.new_zeros(0, dtype=torch.bool)
        return DecodedStreams(indices=gaps, segment=gaps, bounds=streams, sums=gaps.new_zeros(lengths.shape[0], 2), bad=none, escaped=none)
    # By rank: the i-th escape takes ranked[i]; rank 0 (no escape yet) is a placeholder, and one spare value
    # keeps the gather in range when a malformed stream has more escapes than values.
    ranked = torch.nn.functional.pad(overflow, (1, 1), value=1)  # [e + 2]
    escaped = gaps == 0  # [n]
    escape_scan = torch.cumsum(escaped, 0)  # [n] escapes up to and including each element
    gaps = torch.where(escaped, ranked.index_select(0, escape_scan.clamp(max=ranked.numel() - 1)), gaps)
    segment = segment_ids(lengths, gaps.numel())  # [n]
    gap_scan = torch.cumsum(gaps, 0)  # [n]
    gap_sums = streams.totals(gap_scan)  # [k] = each stream's last index + 1
    first = torch.cumsum(gap_sums, 0) - gap_sums + 1  # [k] the gaps before each stream, plus 1
    indices = gap_scan.sub_(first.index_select(0, segment))  # [n]
    return DecodedStreams(indices=indices, segment=segment, bounds=streams, sums=torch.stack([gap_sums, streams.totals(escape_scan)], 1),
                          bad=gaps < 1, escaped=escaped)


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


def bit_differences(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[n] int64: new bits - old bits, as signed integers of the dtype's width."""
    int_dtype = SIGNED_VIEW[new.element_size()]
    return new.view(int_dtype).to(torch.int64) - old.view(int_dtype).to(torch.int64)


def delta_bytes(difference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 deltas [n], escaped [n] bool) of ``bit_differences`` [n]: the delta byte, 0 where it is escaped
    (the difference does not fit in a byte, or is 0)."""
    escaped = (difference < -128) | (difference > 127) | (difference == 0)
    return difference.masked_fill(escaped, 0).to(torch.int8), escaped


def apply_bit_deltas(old: torch.Tensor, delta: torch.Tensor, escapes: torch.Tensor, escaped: torch.Tensor,
                     escape_scan: torch.Tensor) -> torch.Tensor:
    """New values [n] (old's dtype) from old values [n], int8 deltas [n] and escapes (old's dtype), without a host sync.
    The caller checks that the number of escape bytes is the number of escapes (otherwise the values are
    wrong, never out of range). Concatenated patches decode together: escapes are consumed in order, by
    rank, in one gather. ``escaped``: [n] ``delta == 0``; ``escape_scan``: [n] its ``torch.cumsum``."""
    int_dtype = SIGNED_VIEW[old.element_size()]
    bits = old.view(int_dtype)
    if old.element_size() == 4:  # a 32-bit sum could overflow: add in int64, then wrap to 32 bits
        new = (bits.to(torch.int64) + delta).to(int_dtype)  # [n]
    else:  # int8 / int16 plus int8 adds in the wider of the two, which wraps modulo 2**bits
        new = bits + delta  # [n]
    if escapes.numel():
        ranked = torch.nn.functional.pad(escapes.view(int_dtype), (1, 0))  # [escapes + 1]: rank 0 is a placeholder
        new = torch.where(escaped, ranked.index_select(0, escape_scan.clamp(max=escapes.numel())), new)
    return new.view(old.dtype)
