"""safetensors files at the byte level: the header, chunked reads straight into device tensors, streaming writes.

The format: an 8-byte little-endian header length N, N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end)}}`, plus an optional "__metadata__" of strings), then the tensors' bytes,
row-major, at `data_offsets` counted from the end of the header.

- `read_header(file)` parses and checks a header: every entry's byte count matches its dtype and shape, and
  every tensor lies inside the file (a truncated file is refused before anything is read).
- `ChunkStager.read_file(file, targets)` reads the byte ranges `targets` ask for in large chunks into the
  stager's reusable host buffers (pinned for a CUDA device) and copies each chunk to the device with
  non-blocking copies on a side stream while the next chunk is read into the other buffer (double
  buffering). A range may straddle chunks: its target gets it in pieces, straight into its destination
  (`DirectTarget`: a contiguous tensor of the file's dtype) or into a device staging tensor it finishes
  from once whole (`StagedTarget`: dtype conversion, a strided part of the tensor).
- `write_file(file, entries, tensor_of)` writes a file tensor by tensor, so no more than one tensor's bytes
  are on the host at a time.

Not here: which checkpoint tensor goes where (runner/loader.py), and the safetensors package, which the
loader's tensor-wise path and every other reader of checkpoints use.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}

_MAX_HEADER = 100 << 20  # the safetensors package's own limit on the header's length


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str  # the format's dtype code: "BF16", "F32", ...
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the tensor's first byte
    end: int  # absolute file offset past its last byte


def read_header(file: str | Path) -> list[TensorEntry]:
    """The tensors of `file` in file order. ValueError naming the file for a corrupt or truncated one."""
    file = Path(file)

    def bad(why: str) -> ValueError:
        return ValueError(f"cannot read safetensors file {file}: {why}")

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, _MAX_HEADER):
            raise bad(f"header length {length} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise bad(f"header entry of {name!r} is not {{dtype, shape, data_offsets: [begin, end]}}") from None
        if dtype not in DTYPES:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
        need = math.prod(shape) * DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != need:
            raise bad(f"tensor {name!r}: data_offsets [{begin}, {end}) do not hold {dtype} {list(shape)} "
                      f"({need} bytes)")
        if base + end > size:
            raise bad(f"truncated: tensor {name!r} ends at byte {base + end}, the file has {size}")
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    return sorted(entries, key=lambda e: e.begin)


def write_file(file: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
               tensor_of: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write `entries` (name, dtype, shape) to `file` in that order, the bytes of each from `tensor_of(name)` (any
    device; called once per name, in order, when its bytes are due). Returns the file's size in bytes."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, dtype, shape in entries:
            tensor = tensor_of(name)
            assert tensor.dtype == dtype and tuple(tensor.shape) == tuple(shape), (name, tensor.dtype, tensor.shape)
            f.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
    return 8 + len(text) + offset


class Target:
    """A byte range [begin, end) of one file and where its bytes go."""

    def __init__(self, begin: int, end: int) -> None:
        assert 0 <= begin <= end, (begin, end)
        self.begin, self.end = begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def receive(self, piece: torch.Tensor, offset: int) -> None:
        """Bytes [offset, offset + len(piece)) of the range, in a host buffer (uint8 [n]) that is reused once
        the copies enqueued now have run (on the stager's stream)."""
        raise NotImplementedError

    def complete(self) -> None:
        """All of the range has been received (called on the stager's stream, after the last `receive`)."""


class DirectTarget(Target):
    """The bytes are all of `dest`, a contiguous tensor of the file's dtype: copied straight into it."""

    def __init__(self, begin: int, end: int, dest: torch.Tensor) -> None:
        super().__init__(begin, end)
        assert dest.is_contiguous() and dest.dim() > 0, "a direct target is a contiguous tensor"
        self.dest = dest.reshape(-1).view(torch.uint8)  # [nbytes], a view of dest
        assert self.dest.numel() == self.nbytes, (self.dest.numel(), self.nbytes)

    def receive(self, piece: torch.Tensor, offset: int) -> None:
        self.dest[offset : offset + piece.numel()].copy_(piece, non_blocking=True)


class StagedTarget(Target):
    """The bytes gather in a staging tensor on `device`; once whole, `finish(staging)` (uint8 [nbytes]) writes
    wherever they go (a dtype conversion, a narrowed part, a strided destination)."""

    def __init__(self, begin: int, end: int, device: torch.device, finish: Callable[[torch.Tensor], None]) -> None:
        super().__init__(begin, end)
        self.device, self.finish = device, finish
        self.staging: torch.Tensor | None = None  # uint8 [nbytes] on device while the range is being received

    def receive(self, piece: torch.Tensor, offset: int) -> None:
        if self.staging is None:
            self.staging = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.staging[offset : offset + piece.numel()].copy_(piece, non_blocking=True)

    def complete(self) -> None:
        if self.staging is not None:  # None: an empty range
            self.finish(self.staging)
        self.staging = None


class ChunkStager:
    """Reusable host buffers of `chunk_bytes` (pinned for a CUDA device, plain otherwise), the side stream the
    copies to the device run on, and the `read_threads` threads that read each chunk (page-cache reads are a
    memory copy each thread does at a few GB/s).

    Use as a context manager: on exit every copy has run and the device's current stream is ordered after them.
    The pinned buffers go back to torch's pinned-memory cache (a later load reuses them).
    """

    def __init__(self, device: torch.device, chunk_bytes: int = 256 << 20, num_buffers: int = 2,
                 read_threads: int = 4, read_part_bytes: int = 16 << 20) -> None:
        if min(chunk_bytes, num_buffers, read_threads, read_part_bytes) < 1:
            raise ValueError(f"ChunkStager: chunk_bytes, num_buffers, read_threads and read_part_bytes must be >= 1, "
                             f"got {chunk_bytes}, {num_buffers}, {read_threads}, {read_part_bytes}")
        self.device, self.chunk_bytes = device, chunk_bytes
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(num_buffers)]
        self._views = [memoryview(b.numpy()) for b in self.buffers]  # the same memory, for os.preadv
        self._events: list = [None] * num_buffers  # torch.cuda.Event after each buffer's last copies (CUDA)
        self._next = 0
        self.stream = None
        if cuda:
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # after the parameters' allocation
        self._pool = ThreadPoolExecutor(read_threads) if read_threads > 1 else None
        self._read_threads = read_threads
        self._read_part = read_part_bytes  # a chunk's reads are split over the threads in parts of at least this
        self.read_seconds = 0.0
        """Time spent reading files into the host buffers (page cache or disk), over every `read_file`."""
        self.wait_seconds = 0.0
        """Time spent waiting for a buffer's copies to the device to finish before reading into it again."""

    def __enter__(self) -> "ChunkStager":
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()
        if self._pool is not None:
            self._pool.shutdown()

    def read_file(self, file: str | Path, targets: list[Target]) -> int:
        """Read each target's range of `file` into it; returns the bytes read. The ranges must not overlap; they
        are read in file order, packed into chunks, each chunk's contiguous runs in one read each."""
        file = Path(file)
        targets = sorted(targets, key=lambda t: t.begin)
        for a, b in zip(targets, targets[1:]):
            assert a.end <= b.begin, f"overlapping ranges in {file}: [{a.begin}, {a.end}) and [{b.begin}, {b.end})"
        fd = os.open(file, os.O_RDONLY)
        try:
            for chunk in _pack(targets, self.chunk_bytes):
                i, buffer = self._take_buffer()
                reads: list[list[int]] = []  # [file offset, buffer offset, length], contiguous runs merged
                for target, offset, at, n in chunk:
                    start = target.begin + offset
                    if reads and reads[-1][0] + reads[-1][2] == start:
                        reads[-1][2] += n
                    else:
                        reads.append([start, at, n])
                t = time.perf_counter()
                self._read(fd, file, self._views[i], [tuple(r) for r in reads])
                self.read_seconds += time.perf_counter() - t
                with self._copying():
                    for target, offset, at, n in chunk:
                        target.receive(buffer[at : at + n], offset)
                        if offset + n == target.nbytes:
                            target.complete()
                self._record(i)
        finally:
            os.close(fd)
        return sum(t.nbytes for t in targets)

    def _take_buffer(self) -> tuple[int, torch.Tensor]:
        """The next buffer in turn, once the copies out of it that were enqueued last time have run."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        if self._events[i] is not None:
            t = time.perf_counter()
            self._events[i].synchronize()
            self.wait_seconds += time.perf_counter() - t
        return i, self.buffers[i]

    def _read(self, fd: int, file: Path, view: memoryview, reads: list[tuple[int, int, int]]) -> None:
        """(file offset, buffer offset, length) of each read, split over the reader threads."""
        part = max(self._read_part, -(-sum(n for _, _, n in reads) // self._read_threads))
        jobs = [(off + s, boff + s, min(part, n - s)) for off, boff, n in reads for s in range(0, n, part)]
        if self._pool is None or len(jobs) == 1:
            for job in jobs:
                _pread_into(fd, file, view, *job)
            return
        for future in [self._pool.submit(_pread_into, fd, file, view, *job) for job in jobs]:
            future.result()

    def _copying(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _record(self, i: int) -> None:
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self._events[i] = event


def _pack(targets: list[Target], capacity: int) -> list[list[tuple[Target, int, int, int]]]:
    """The targets' ranges cut into chunks of at most `capacity` bytes: per chunk, (target, offset in its range,
    offset in the buffer, length) of each piece. Empty ranges are completed in the first chunk."""
    chunks: list[list[tuple[Target, int, int, int]]] = []
    chunk: list[tuple[Target, int, int, int]] = []
    fill = 0
    for target in targets:
        if target.nbytes == 0:
            target.complete()
        offset = 0
        while offset < target.nbytes:
            n = min(target.nbytes - offset, capacity - fill)
            chunk.append((target, offset, fill, n))
            offset, fill = offset + n, fill + n
            if fill == capacity:
                chunks.append(chunk)
                chunk, fill = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def _pread_into(fd: int, file: Path, view: memoryview, offset: int, at: int, n: int) -> None:
    """view[at : at + n] = bytes [offset, offset + n) of the file."""
    done = 0
    while done < n:
        got = os.preadv(fd, [view[at + done : at + n]], offset + done)
        if got == 0:
            raise ValueError(f"cannot read safetensors file {file}: truncated at byte {offset + done} "
                             f"(the file has {os.fstat(fd).st_size})")
        done += got
