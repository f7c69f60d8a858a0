"""Rank-local IPC: trainer rank r hands its records to rollout rank r on the same host.

::

    trainer rank r                                   rollout rank r
    IpcSender.send(version, updates)                 IpcReceiver.serve_one()
      {"op": "start", version, names}  ---JSON--->     session.start
      per bucket: write it into shared memory
      {"op": "chunk", kind, where}     ---JSON--->     map the memory (no copy), session.add(views)
      {"op": "finish"}                 ---JSON--->     session.finish (validate, write, verify)
      wait; then free the memory      <---JSON---      {"op": "result", ok, error | result}

Where a bucket lives:

- CPU (``kind="shm"``): a file in ``/dev/shm`` holding a complete safetensors file (length-prefixed
  JSON header + data), mapped with ``torch.from_file`` on both sides; the message carries its path.
- CUDA (``kind="cuda_ipc"``): a device buffer shared with ``torch.multiprocessing.reductions``;
  the message carries the safetensors header and the CUDA IPC handle fields as JSON (hex bytes).
  A handle is mapped in the process that made it too (rank 0 of a tensor-parallel engine maps the
  bucket its own process staged): CUDA cannot open it there, so that process uses the buffer itself.

Only JSON crosses the connection; tensor data crosses only through the shared memory. The receiver is
a message source of ``protocol.serve_session``: one that sees a bad chunk keeps reading until ``finish``
and then reports the first error, so the sender never blocks. A sender that dies or goes silent makes
``serve_one`` raise after ``timeout_s`` (or at once, if the connection closes). No gather through rank
0: each pair has its own connection.
"""

import functools
import os
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import torch

from weight_updates.encoding import Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult
from weight_updates.transports.channel import recv_json, recv_result, send_json, send_result
from weight_updates.transports.protocol import SendResult, Start, UpdateSink, serve_session
from weight_updates.wire import (
    BucketPlan,
    parse_safetensors_prefix,
    plan_bucket,
    read_bucket,
    split_buckets,
    to_safetensors_prefix,
    write_bucket,
)

SHM_DIR = "/dev/shm"
_SHM_PREFIX = "weight-update-"

# Tensors this process described with ``cuda_ipc_handle``, by (handle, storage offset), while they live.
# cudaIpcOpenMemHandle fails in the exporting process ("invalid device context"), and torch's rebuild does not
# find the exporter's own storage there, so ``open_cuda_ipc_handle`` looks the tensor up here instead.
_EXPORTED: "weakref.WeakValueDictionary[tuple[str, int], torch.Tensor]" = weakref.WeakValueDictionary()


def cuda_ipc_handle(t: torch.Tensor) -> dict:
    """JSON-ready description of a CUDA tensor for ``open_cuda_ipc_handle`` in another process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(t)
    assert rebuild is rebuild_cuda_tensor, "not a CUDA tensor"
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_nbytes, storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
    assert tensor_cls is torch.Tensor and storage_cls is torch.storage.TypedStorage and dtype == torch.uint8
    _EXPORTED[handle.hex(), storage_offset] = t
    return {
        "pid": os.getpid(),
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "device": device,
        "handle": handle.hex(),
        "storage_nbytes": storage_nbytes,
        "storage_offset": storage_offset,
        "ref_counter_handle": ref_handle.hex(),
        "ref_counter_offset": ref_offset,
        "event_handle": event_handle.hex() if event_handle else None,
        "event_sync_required": event_sync,
    }


def open_cuda_ipc_handle(h: dict) -> torch.Tensor:
    """The uint8 CUDA tensor described by ``cuda_ipc_handle``, mapped into this process (in the process that
    described it: a view of the tensor itself). WeightUpdateError if that process no longer holds it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if h.get("pid") == os.getpid():
        exported = _EXPORTED.get((h["handle"], int(h["storage_offset"])))
        if exported is None:
            raise WeightUpdateError("CUDA IPC handle made by this process for a tensor it no longer holds")
        # What torch's rebuild does when it finds the storage in its cache: give back the count the export
        # took for a consumer; no consumer would ever release it, and the producer's free would then keep
        # the buffer allocated (parked in torch's IPC limbo) for good.
        torch.storage.TypedStorage._release_ipc_counter(bytes.fromhex(h["ref_counter_handle"]), int(h["ref_counter_offset"]),
                                                        device=int(h["device"]))
        return exported.as_strided(tuple(h["size"]), tuple(h["stride"]), int(h["offset"]))
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(h["size"]),
        tuple(h["stride"]),
        int(h["offset"]),
        torch.storage.TypedStorage,
        torch.uint8,
        int(h["device"]),
        bytes.fromhex(h["handle"]),
        int(h["storage_nbytes"]),
        int(h["storage_offset"]),
        False,
        bytes.fromhex(h["ref_counter_handle"]),
        int(h["ref_counter_offset"]),
        bytes.fromhex(h["event_handle"]) if h["event_handle"] else None,
        bool(h["event_sync_required"]),
    )


def write_shm_bucket(plan: BucketPlan) -> str:
    """A new /dev/shm segment holding ``plan``'s bucket as a complete safetensors file; returns its path.
    The caller unlinks it once the receiver is done."""
    prefix = to_safetensors_prefix(plan.header)
    path = os.path.join(SHM_DIR, f"{_SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        buf = torch.from_file(path, shared=True, size=len(prefix) + plan.nbytes, dtype=torch.uint8)  # [file bytes]
        buf[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        write_bucket(plan, buf[len(prefix) :])
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
    return path


def shm_chunk(path: str) -> dict:
    """The JSON description of a segment made by ``write_shm_bucket`` (its header is inside it)."""
    return {"kind": "shm", "path": path}


def stage_cuda_bucket(plan: BucketPlan, device: torch.device) -> tuple[torch.Tensor, dict]:
    """(buffer, JSON description): ``plan``'s bucket in a new CUDA allocation and its IPC handle. Keep the
    buffer alive until the receiver is done with it."""
    buf = torch.empty(max(plan.nbytes, 1), dtype=torch.uint8, device=device)  # [bucket bytes]
    write_bucket(plan, buf)
    torch.cuda.current_stream(device).synchronize()
    return buf, {"kind": "cuda_ipc", "header": plan.header, "handle": cuda_ipc_handle(buf)}


def map_chunk(msg: dict) -> tuple[dict, torch.Tensor]:
    """(safetensors header, [n] uint8 bucket) of a chunk described by ``shm_chunk`` or
    ``stage_cuda_bucket``, mapped without a copy. WeightUpdateError for a path outside /dev/shm's
    weight-update segments, an unreadable segment or an unknown kind; KeyError / TypeError for a
    message without the fields."""
    if msg["kind"] == "shm":
        path = str(msg["path"])
        if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(_SHM_PREFIX):
            raise WeightUpdateError(f"refusing to map {path!r}: not a weight-update segment in {SHM_DIR}")
        try:
            buf = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)  # [file bytes]
        except (OSError, RuntimeError) as e:
            raise WeightUpdateError(f"cannot map {path}: {e}") from None
        header, data_start = parse_safetensors_prefix(buf)
        return header, buf[data_start:]
    if msg["kind"] == "cuda_ipc":
        return msg["header"], open_cuda_ipc_handle(msg["handle"])
    raise WeightUpdateError(f"unknown chunk kind {msg['kind']!r}")


class IpcSender:
    """Trainer side of one rank-local pair. ``device`` is where buckets are staged: "cpu" uses
    /dev/shm, a CUDA device uses CUDA IPC."""

    def __init__(self, conn: Connection, *, device: torch.device | str = "cpu", bucket_bytes: int = 512 << 20, timeout_s: float = 120.0) -> None:
        self.conn = conn
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"IPC buckets live on cpu or cuda, not {self.device}")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s

    def send(self, version: int, updates: Sequence[Update]) -> SendResult:
        """Run one session; ``received`` holds the receiver's result.

        Raises WeightUpdateError if the receiver rejected the push or did not answer in time.
        """
        started, updates = time.perf_counter(), list(updates)
        shm_paths: list[str] = []
        cuda_buffers: list[torch.Tensor] = []  # kept alive until the receiver has answered
        try:
            send_json(self.conn, {"op": "start", "version": version, "names": [u.name for u in updates]})
            for bucket in split_buckets(updates, self.bucket_bytes):
                plan = plan_bucket(bucket)
                if self.device.type == "cpu":
                    shm_paths.append(write_shm_bucket(plan))
                    send_json(self.conn, {"op": "chunk", **shm_chunk(shm_paths[-1])})
                else:
                    buf, chunk = stage_cuda_bucket(plan, self.device)
                    cuda_buffers.append(buf)
                    send_json(self.conn, {"op": "chunk", **chunk})
            send_json(self.conn, {"op": "finish"})
            result, error = recv_result(self.conn, timeout_s=self.timeout_s, waiting_for=f"the receiver's result for version {version}")
        finally:
            for path in shm_paths:
                os.unlink(path)
        if error is not None:
            raise WeightUpdateError(f"receiver rejected version {version}: {error}")
        return SendResult.of(version, updates, started, received=(result,))


class _IpcSource:
    """The rollout side's messages of one session: start, chunks until finish; the answer goes back."""

    def __init__(self, conn: Connection, *, timeout_s: float, start_timeout_s: float | None) -> None:
        self.conn, self.timeout_s, self.start_timeout_s = conn, timeout_s, start_timeout_s
        self.version = None

    def start(self) -> Start:
        msg = recv_json(self.conn, timeout_s=self.start_timeout_s, waiting_for="a session start")
        if msg["op"] != "start":
            raise WeightUpdateError(f"expected 'start', got {msg['op']!r}")
        self.version = msg["version"]
        return Start(version=msg["version"], names=msg["names"])

    def chunks(self) -> Iterator:
        waiting = {"timeout_s": self.timeout_s, "waiting_for": f"the next chunk of version {self.version}"}
        while (msg := recv_json(self.conn, **waiting))["op"] != "finish":
            if msg["op"] != "chunk":
                raise WeightUpdateError(f"expected 'chunk' or 'finish', got {msg['op']!r}")
            yield functools.partial(_read_chunk, msg)

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        send_result(self.conn, result, error)


def _read_chunk(msg: dict) -> list[Update]:
    """The records of a chunk message: views into its mapped bucket, which they keep mapped."""
    header, data = map_chunk(msg)
    return read_bucket(header, data)


class IpcReceiver:
    """Rollout side of one rank-local pair: serves sessions on ``sink`` (a ``WeightReceiver``, or an engine's
    ``weight_sink()``)."""

    def __init__(self, conn: Connection, sink: UpdateSink, *, timeout_s: float = 120.0) -> None:
        self.conn = conn
        self.sink = sink
        self.timeout_s = timeout_s

    def serve_one(self, *, start_timeout_s: float | None = None) -> UpdateResult:
        """Wait (``start_timeout_s``, None = forever) for a session and run it.

        Raises WeightUpdateError, after telling the sender when it still can, if the session failed.
        """
        return serve_session(self.sink, _IpcSource(self.conn, timeout_s=self.timeout_s, start_timeout_s=start_timeout_s))
