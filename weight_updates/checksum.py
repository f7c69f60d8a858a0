"""Position-weighted checksums of a tensor's bit patterns, computable on its own device.

Definition (the same on every device; all integer arithmetic is int64 modulo 2**64)::

    checksum(t) = sum_i  s(i) * w(i)
    s(i) = the bits of flat element i read as a sign-extended integer
           (int8 / int16 / int32 for 1- / 2- / 4-byte dtypes; bf16 -0.0 and NaN payloads count)
    w(i) = T[i mod 2**22] + 2 * (i div 2**22)
    T[j] = (mix32(j) mod 2**15) | 1          (odd, fixed, see ``_weight_table``)

Every weight is odd and depends on the position, so a flipped bit, a swapped pair or a shifted row
changes the sum (up to the odds of a weight collision, about 2**-14 for a swap). It is a corruption
and base-version check, not a cryptographic hash. Because addition modulo 2**64 is associative,
the result does not depend on reduction order, so CPU and CUDA agree bitwise; and because it is
linear in ``s``, a sparse patch changes it by ``sum over patched i of (s_new(i) - s_old(i)) * w(i)``,
which lets both sides keep checksums current in O(changed) work (``patch_checksum_delta``).

On the CPU, tensors are processed in blocks through one reused int64 buffer; on CUDA, ``checksum_tensors``
runs one Triton launch per element size over any number of tensors (``kernels/checksum.py``, bitwise the
same result). Only the final int64 tensor leaves the device when a caller asks for it. 8-byte dtypes are
not supported.
"""

import itertools
import operator
from collections.abc import Sequence

import torch

from kernels.common import SIGNED_VIEW, device_index, upload

_CHUNK_BITS = 22
_CHUNK = 1 << _CHUNK_BITS
_tables: dict[torch.device, torch.Tensor] = {}  # device -> [2**22] int64
_tables16: dict[torch.device, torch.Tensor] = {}  # device -> [2**22] int16, the same values


def concat_to(parts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.cat`` of ``parts`` (1-D) as ``dtype`` on ``device`` in one cat and one conversion per run of parts
    of equal dtype (not one conversion per part). Parts that lie end to end in one storage (the records of a
    batched encode, or of a bucket, in order) are joined as one view, without a copy: the result may then
    share memory with them, so callers only read it. A run of host parts bound for CUDA is joined on the host
    and uploaded in one copy instead of one per part (and converted there)."""
    device = torch.device(device)
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    here = device_index(device)
    runs = [_join(list(run), here, device).to(dtype) for _, run in itertools.groupby(parts, key=operator.attrgetter("dtype"))]
    return runs[0] if len(runs) == 1 else torch.cat(runs)


def _join(parts: list[torch.Tensor], here: int, device: torch.device) -> torch.Tensor:
    """``parts`` (1-D, one dtype) as one tensor on ``device`` (``here``: its ``device_index``)."""
    joined = _joined_view(parts)  # one storage: one device, checked once
    if joined is None:
        where = {p.get_device() for p in parts}
        if where != {here} and not (here >= 0 and where == {-1}):  # mixed: move what is elsewhere, part by part
            parts = [p if p.get_device() == here else p.to(device, non_blocking=True) for p in parts]
        joined = torch.cat(parts)
    return joined if joined.get_device() == here else upload(joined, device)


def _joined_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``parts`` (1-D, one dtype) when they lie end to end in one storage, else None. Checked
    by addresses alone: parts that tile the range from the first to the last, both in one storage, all lie
    in it (live storages never overlap)."""
    first = last = None
    end, itemsize = 0, parts[0].element_size()
    for p in parts:
        n = p.numel()
        if not n:
            continue
        if first is None:
            first, end = p, p.data_ptr()
        if p.data_ptr() != end or not p.is_contiguous():
            return None
        end += n * itemsize
        last = p
    if first is None or first.untyped_storage().data_ptr() != last.untyped_storage().data_ptr():
        return None
    return first.as_strided(((end - first.data_ptr()) // itemsize,), (1,), first.storage_offset())


def check_dtype_supported(dtype: torch.dtype) -> None:
    """Raise ValueError for dtypes the checksum cannot read (8-byte and wider)."""
    if dtype.itemsize not in SIGNED_VIEW:
        raise ValueError(f"checksums support 1-, 2- and 4-byte dtypes, not {dtype}")


def _weight_table(device: torch.device) -> torch.Tensor:
    """[2**22] int64: T[j] on ``device``; built once per device."""
    table = _tables.get(device)
    if table is None:
        h = (torch.arange(_CHUNK, dtype=torch.int64, device=device) * 2654435761) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x45D9F3B) & 0xFFFFFFFF
        h ^= h >> 16
        table = (h & 0x7FFF) | 1
        _tables[device] = table
    return table


def _signed_bits(values: torch.Tensor) -> torch.Tensor:
    """[n] values -> [n] same-width signed integers holding their bits (a view, no copy)."""
    return values.view(SIGNED_VIEW[values.element_size()])


def checksum_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[k] int64 checksums of k tensors on one device (no host copy): on CUDA a Triton launch per element
    size, elsewhere ``checksum_tensor`` one by one."""
    assert tensors
    device = tensors[0].device
    for t in tensors:
        check_dtype_supported(t.dtype)
    if device.type != "cuda":
        return torch.stack([checksum_tensor(t) for t in tensors])
    from kernels.checksum import checksum_many

    out = torch.empty(len(tensors), dtype=torch.int64, device=device)
    by_size: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        by_size.setdefault(t.element_size(), []).append(i)
    for members in by_size.values():
        sums = checksum_many([tensors[i].contiguous() for i in members])
        out[upload(torch.tensor(members, dtype=torch.int64), device)] = sums
    return out


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 checksum of ``t``'s bits, on ``t.device`` (no host copy)."""
    check_dtype_supported(t.dtype)
    if t.is_cuda:
        return checksum_tensors([t])[0]
    flat = _signed_bits(t.reshape(-1))  # [numel]
    table = _weight_table(t.device)
    # Blocks divide 2**22. One reused int64 buffer: same-dtype in-place ops are the fast kernels.
    block = _CHUNK if t.is_cuda else 1 << 20
    buf = torch.empty(min(block, flat.numel()), dtype=torch.int64, device=t.device)  # [block]
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), block):
        bits = buf[: min(block, flat.numel() - start)].copy_(flat[start : start + block])  # [<= block]
        chunk_idx, offset = divmod(start, _CHUNK)
        if chunk_idx:
            total += 2 * chunk_idx * bits.sum()
        total += bits.mul_(table[offset : offset + bits.numel()]).sum()
    return total


def _weight_table16(device: torch.device) -> torch.Tensor:
    """[2**22] int16: T[j] on ``device`` (T fits in int16; a 2-byte gather is much cheaper than an 8-byte one)."""
    table16 = _tables16.get(device)
    if table16 is None:
        table16 = _tables16[device] = _weight_table(device).to(torch.int16)
    return table16


def position_weights(positions: torch.Tensor) -> torch.Tensor:
    """[n] int64 ``w(positions)`` of [n] int64 flat indices, on their device."""
    weights = _weight_table16(positions.device).index_select(0, positions & (_CHUNK - 1)).to(torch.int64)  # [n]
    return weights.add_(positions >> _CHUNK_BITS, alpha=2)


def delta_terms(old: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, bound: int | None = None) -> torch.Tensor:
    """[n] int64 ``(s(new) - s(old)) * w(positions)``. ``bound``: an int above every position, where the
    caller knows one: up to 2**22 the weights are table entries alone."""
    check_dtype_supported(new.dtype)
    assert old.dtype == new.dtype and old.shape == new.shape == positions.shape and positions.dtype == torch.int64
    diff = _signed_bits(new).to(torch.int64).sub_(_signed_bits(old))  # [n]
    if bound is not None and bound <= _CHUNK:
        return diff.mul_(_weight_table16(positions.device).index_select(0, positions))
    return diff.mul_(position_weights(positions))


def patch_checksum_delta(old: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """0-dim int64 ``sum_k (s(new[k]) - s(old[k])) * w(positions[k])``.

    old, new: [n] one supported dtype; positions: [n] int64 flat indices; all on one device.
    ``checksum(after) = checksum(before) + patch_checksum_delta(old, new, idx)`` for a patch at ``idx``.
    """
    return delta_terms(old, new, positions).sum()


def checksum(t: torch.Tensor) -> int:
    """``checksum_tensor`` as a Python int (one device-to-host copy)."""
    return int(checksum_tensor(t).item())
