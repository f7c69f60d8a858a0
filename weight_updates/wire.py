"""Byte layout of update records in flat buffers: safetensors headers plus raw tensor bytes.

A *bucket* is one flat uint8 buffer holding the tensors of several records, described by a
safetensors header (``{key: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``). Keys are
the checkpoint name for a Dense tensor and ``name:gaps`` / ``name:overflow`` / ``name:values`` for a
Patch; ``__metadata__["records"]`` is a JSON list of ``{"name", "kind", "checksum"}`` in order.
Tensors are laid out by element size, widest first, so every tensor is naturally aligned and the
data region has no holes (what safetensors requires); within a width, by kind, so the same part of
consecutive patches lies end to end. ``to_safetensors_prefix`` gives the
8-byte-length-prefixed header that turns ``prefix + bucket`` into a valid .safetensors file.

This module never pickles and never copies on read: ``read_bucket`` returns views into the buffer.
It does not know which transport carries the buffer.
"""

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from weight_updates.encoding import Dense, PackedIndices, Patch, Update
from weight_updates.errors import WeightUpdateError

_DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint16: "U16",
    torch.uint8: "U8",
}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketPlan:
    """Where each tensor of some records goes in a bucket."""

    header: dict  # safetensors header, JSON-ready
    tensors: tuple[torch.Tensor, ...]  # in data order, each flattened
    offsets: tuple[int, ...]  # byte offset of each tensor in the bucket
    nbytes: int  # bucket size


def _record_tensors(update: Update) -> list[tuple[str, torch.Tensor]]:
    if isinstance(update, Dense):
        return [(update.name, update.tensor)]
    tensors = [
        (f"{update.name}:gaps", update.indices.gaps),
        (f"{update.name}:overflow", update.indices.overflow),
        (f"{update.name}:values", update.values),
    ]
    if update.escapes is not None:
        tensors.append((f"{update.name}:escapes", update.escapes))
    return tensors


_KINDS = ("", ":gaps", ":overflow", ":values", ":escapes")  # dense tensors, then each part of a patch


def _kind(key: str) -> int:
    return next((i for i, suffix in enumerate(_KINDS) if suffix and key.endswith(suffix)), 0)


def plan_bucket(updates: Sequence[Update]) -> BucketPlan:
    # Widest first (every tensor aligned, no holes), then by kind, records in order: the gaps (or values,
    # ...) of consecutive patches lie end to end, so the receiver joins them without a copy.
    entries = [kt for u in updates for kt in _record_tensors(u)]
    entries.sort(key=lambda kt: (-kt[1].element_size(), _kind(kt[0])))
    header: dict = {}
    tensors, offsets = [], []
    offset = 0
    for key, t in entries:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPE_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        tensors.append(t.reshape(-1))
        offsets.append(offset)
        offset += nbytes
    records = [{"name": u.name, "kind": "dense" if isinstance(u, Dense) else "patch", "checksum": u.checksum} for u in updates]
    header["__metadata__"] = {"records": json.dumps(records)}
    return BucketPlan(header=header, tensors=tuple(tensors), offsets=tuple(offsets), nbytes=offset)


def write_bucket(plan: BucketPlan, out: torch.Tensor) -> None:
    """Copy the planned tensors into ``out`` ([>= plan.nbytes] uint8, any device)."""
    assert out.dtype == torch.uint8 and out.dim() == 1 and out.numel() >= plan.nbytes
    for t, offset in zip(plan.tensors, plan.offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            out[offset : offset + nbytes].copy_(t.contiguous().view(torch.uint8), non_blocking=True)


def read_bucket(header: dict, data: torch.Tensor) -> list[Update]:
    """Records from a header and its bucket ([n] uint8); views into ``data``.

    Raises WeightUpdateError for a malformed header or a bucket too short for it (truncation).
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise WeightUpdateError(f"bucket must be 1-D uint8, got {data.dtype} {tuple(data.shape)}")
    try:
        records = json.loads(header["__metadata__"]["records"])
        return [_read_record(header, data, r) for r in records]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise WeightUpdateError(f"malformed bucket header: {type(e).__name__}: {e}") from None


def _tensor(header: dict, data: torch.Tensor, key: str) -> torch.Tensor:
    entry = header[key]
    dtype = _ST_TO_DTYPE.get(entry["dtype"])
    if dtype is None:
        raise WeightUpdateError(f"{key}: unknown dtype {entry['dtype']!r}")
    shape = [int(d) for d in entry["shape"]]
    start, end = (int(x) for x in entry["data_offsets"])
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= start <= end or end - start != nbytes:
        raise WeightUpdateError(f"{key}: data_offsets [{start}, {end}) do not hold {shape} {dtype}")
    if end > data.numel():
        raise WeightUpdateError(f"truncated bucket: {key} needs bytes [{start}, {end}) but the bucket has {data.numel()}")
    if start % dtype.itemsize:
        raise WeightUpdateError(f"{key}: offset {start} is not aligned to {dtype.itemsize} bytes")
    return data[start:end].view(dtype).view(shape)


def _read_record(header: dict, data: torch.Tensor, record: dict) -> Update:
    name, checksum = str(record["name"]), int(record["checksum"])
    if record["kind"] == "dense":
        return Dense(name=name, tensor=_tensor(header, data, name), checksum=checksum)
    if record["kind"] == "patch":
        indices = PackedIndices(gaps=_tensor(header, data, f"{name}:gaps"), overflow=_tensor(header, data, f"{name}:overflow"))
        escapes = _tensor(header, data, f"{name}:escapes") if f"{name}:escapes" in header else None
        return Patch(name=name, indices=indices, values=_tensor(header, data, f"{name}:values"), checksum=checksum,
                     escapes=escapes)
    raise WeightUpdateError(f"{name}: unknown record kind {record['kind']!r}")


def to_safetensors_prefix(header: dict) -> bytes:
    """8-byte little-endian length + JSON header, space-padded so the data starts 8-byte aligned."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def parse_safetensors_prefix(buf: torch.Tensor) -> tuple[dict, int]:
    """(header, data start) from a [n] uint8 CPU buffer that begins with a safetensors prefix."""
    if buf.numel() < 8:
        raise WeightUpdateError(f"buffer of {buf.numel()} bytes has no safetensors header")
    (length,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if 8 + length > buf.numel():
        raise WeightUpdateError(f"truncated buffer: header of {length} bytes, buffer of {buf.numel()}")
    try:
        header = json.loads(buf[8 : 8 + length].numpy().tobytes())
    except json.JSONDecodeError as e:
        raise WeightUpdateError(f"malformed safetensors header: {e}") from None
    return header, 8 + length


def split_buckets(updates: Iterable[Update], bucket_bytes: int) -> list[list[Update]]:
    """Group records in order into buckets of about ``bucket_bytes``; a larger record gets its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[Update]] = []
    size = 0
    for u in updates:
        if not buckets or (size and size + u.nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(u)
        size += u.nbytes
    return buckets
