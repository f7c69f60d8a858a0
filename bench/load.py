"""Checkpoint load throughput: the tensor-wise reader vs the chunked reader (runner/loader.py), same checkpoint,
same run. JSON lines.

    python bench/load.py --quick                    # CPU, tiny model, 64 KiB chunks (the chunked reader, plain buffers)
    python bench/load.py --shape qwen3-8b           # GPU: a random bf16 checkpoint drawn on the device, two shards
    python bench/load.py --shape qwen3-8b --cold --chunk-mib 64,256 --read-threads 2,4,8

Rows: `checkpoint` (bytes, seconds to draw and write it), then per reader `load` with the page cache warm (the
checkpoint was just written or read; best of --repeats) and, with --cold, once more after asking the kernel to
drop the files' pages (fsync + POSIX_FADV_DONTNEED: a read from the disk where the file system honours it);
seconds and GB/s of `load_model`, the model built and filled on the device, weights in place. Last, whether
the readers filled the same parameters bitwise (`readers_identical`; exit status 1 if not).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.generate import SHAPES as SMALL_SHAPES, emit, release_memory, sync  # noqa: E402
from runner.testing import MODEL_SHAPES, write_random_checkpoint  # noqa: E402

SHAPES = {**MODEL_SHAPES, "tiny": SMALL_SHAPES["tiny"]}


def checkpoint_files(path) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def checkpoint_bytes(path) -> int:
    return sum(os.path.getsize(f) for f in checkpoint_files(path))


def write_shape(path, shape: str, device: str, dtype: str, shards: int = 2) -> dict:
    """A random checkpoint of `shape` at `path`, drawn on `device` and streamed to `shards` files; its row."""
    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    sync(device)
    t = time.perf_counter()
    write_random_checkpoint(path, family=family, dtype=dtype, std=0.02, device=device, shards=shards, **spec)
    sync(device)
    return dict(kind="checkpoint", shape=shape, dtype=dtype, shards=shards, bytes=checkpoint_bytes(path),
                seconds=round(time.perf_counter() - t, 2), drawn_on=device)


def checkpoint_fits(path, nbytes: int) -> bool:
    """Whether the disk under `path` has room for `nbytes` of checkpoint and 2 GiB to spare."""
    return shutil.disk_usage(path).free >= nbytes + (2 << 30)


def drop_page_cache(path) -> None:
    """Ask the kernel to evict the checkpoint files' pages (written back first), so the next read is from disk."""
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load(path, device: str, dtype: str, reader: str, chunk_bytes: int, read_threads: int):
    from runner.loader import load_model
    from runner.model_config import ModelConfig

    cfg = ModelConfig.from_dir(path)
    sync(device)
    t = time.perf_counter()
    model = load_model(path, cfg, getattr(torch, dtype), torch.device(device), None, 4096, reader=reader,
                       chunk_bytes=chunk_bytes, read_threads=read_threads)
    sync(device)
    return model, time.perf_counter() - t


def bench_load(path, device: str, dtype: str, repeats: int = 2, cold: bool = False,
               chunked: tuple[tuple[int, int], ...] = ((256 << 20, 4),)) -> list[dict]:
    """The `load` rows of the tensor-wise reader and of the chunked one at each (chunk bytes, read threads) of
    `chunked`, and a last `load_check` row: whether they all filled the same parameters."""
    import runner.models  # noqa: F401  (imports, torch's lazy ones and the CUDA context stay out of the timing)

    torch.nn.Linear(2, 2, device="meta").to_empty(device=device)
    nbytes = checkpoint_bytes(path)
    rows, first, identical = [], None, True
    readers = [("tensorwise", 256 << 20, 1)] + [("chunked", c, t) for c, t in chunked]
    for reader, chunk_bytes, threads in readers:
        runs = [("warm", repeats)] + ([("dropped", 1)] if cold else [])
        for page_cache, count in runs:
            best = float("inf")
            for _ in range(count):
                if page_cache == "dropped":
                    drop_page_cache(path)
                model, seconds = _load(path, device, dtype, reader, chunk_bytes, threads)
                best = min(best, seconds)
                if first is None:
                    first = {k: v.detach() for k, v in model.named_parameters()}
                else:
                    identical &= all(torch.equal(first[k].view(torch.uint8), v.detach().view(torch.uint8))
                                     for k, v in model.named_parameters())
                del model
                gc.collect()
                release_memory()
            rows.append(dict(kind="load", reader=reader, page_cache=page_cache, bytes=nbytes, seconds=round(best, 3),
                             gb_per_s=round(nbytes / best / 1e9, 2), runs=count,
                             **({"chunk_bytes": chunk_bytes, "read_threads": threads} if reader == "chunked" else {})))
    del first
    release_memory()
    rows.append(dict(kind="load_check", readers=len(readers), readers_identical=bool(identical)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, 64 KiB chunks")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="also load once with the files' pages dropped")
    ap.add_argument("--chunk-mib", default=None, help="chunked reader's chunk sizes, comma-separated (default 256)")
    ap.add_argument("--read-threads", default="4", help="chunked reader's thread counts, comma-separated")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: the temp dir)")
    args = ap.parse_args()
    device = "cpu" if args.quick else args.device
    shape = args.shape or ("tiny" if args.quick or device == "cpu" else "qwen3-8b")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    chunks = [int(float(c) * 2**20) for c in (args.chunk_mib or ("0.0625" if args.quick else "256")).split(",")]
    chunked = tuple((c, int(t)) for c in chunks for t in args.read_threads.split(","))
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        emit(device=device, **write_shape(d, shape, device, dtype))
        rows = bench_load(d, device, dtype, repeats=args.repeats, cold=args.cold, chunked=chunked)
        for row in rows:
            emit(device=device, shape=shape, dtype=dtype, **row)
    if not rows[-1]["readers_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
