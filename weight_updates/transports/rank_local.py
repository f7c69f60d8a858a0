"""Rank-local updates under tensor parallelism: trainer rank r hands rank r's shard to rollout rank r.

::

    trainer rank r (same host; on GPU the same device)     rollout rank r
    records of rank r's part: dense tensors of the
    shard's shape, patch indices in shard coordinates,
    checksums of the shard
    stage_bucket -> one bucket
      CPU: a /dev/shm segment (safetensors file)
      GPU: a CUDA allocation and its IPC handle
    handle (JSON) -> the caller, which passes every
    rank's handle to the engine           ---JSON--->     serve_rank_local(receiver, version, handles[r])
                                                            map the bucket (no copy), read records (views)
                                                            start, add, prepare (validate; nothing written)
                                                            vote 1: every rank's error or None, and
                                                              its tensor names (the same on every rank)
                                                            commit (write, read back, verify)
                                                            vote 2
                                                            publish, or rollback if any rank failed
    StagedBucket.close(): unlink / free

No rank sees another rank's tensor data and nothing is gathered through rank 0: the handles and the
votes are JSON, the data moves only through the mapping. Every rank takes part in both votes whatever
happened on it, so no rank waits on a collective the others skipped; a session any rank rejected leaves
every rank's weights and version as they were. A failure after writing (a target that did not hold the
written bits, a device error) makes every rank write its old values back; for dense records that needs
the receiver's rollback copy (``WeightReceiver(dense_rollback=True)``: the size of the rank's dense
records, held during the session), and the error lists what each rank restored.

``exchange`` is any all-gather of JSON values over the ranks, in rank order (``TPGroup.all_gather_json``);
the session loop and the votes are ``protocol.serve_session`` with ``protocol.ExchangeVotes``.
``shard_weights`` cuts a rank's part out of full checkpoint tensors for a trainer that holds them all.
This module does not create process groups or know the engine (runner/parallel/worker.py).
"""

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weight_updates.encoding import Update
from weight_updates.session import UpdateResult
from weight_updates.transports.ipc import map_chunk, shm_chunk, stage_cuda_bucket, write_shm_bucket
from weight_updates.transports.protocol import ExchangeVotes, Start, UpdateSink, serve_session
from weight_updates.wire import plan_bucket, read_bucket

Exchange = Callable[[object], list]  # every rank's JSON value, in rank order


@dataclass(kw_only=True, slots=True)
class StagedBucket:
    """One rank's records in memory the rollout rank can map, until ``close``."""

    handle: dict  # JSON: {"kind": "shm", "path"} or {"kind": "cuda_ipc", "header", "handle"}
    nbytes: int  # payload bytes
    _path: str | None = None  # the /dev/shm segment, unlinked by close
    _buffer: torch.Tensor | None = field(default=None, repr=False)  # the CUDA allocation, kept alive until close

    def close(self) -> None:
        """Free the bucket (call after the engine answered, whatever it answered); safe to call twice."""
        if self._path is not None and os.path.exists(self._path):
            os.unlink(self._path)
        self._path, self._buffer = None, None

    def __enter__(self) -> "StagedBucket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stage_bucket(updates: Sequence[Update], device: torch.device | str = "cpu") -> StagedBucket:
    """Write ``updates`` (one rank's records) into one bucket: /dev/shm for "cpu", CUDA IPC for a CUDA
    device (the rollout rank on that device maps it)."""
    device = torch.device(device)
    plan = plan_bucket(list(updates))
    if device.type == "cpu":
        path = write_shm_bucket(plan)
        return StagedBucket(handle=shm_chunk(path), nbytes=plan.nbytes, _path=path)
    if device.type == "cuda":
        buf, handle = stage_cuda_bucket(plan, device)
        return StagedBucket(handle=handle, nbytes=plan.nbytes, _buffer=buf)
    raise ValueError(f"rank-local buckets live on cpu or cuda, not {device}")


def shard_weights(weights: Mapping[str, torch.Tensor], layout: Mapping) -> dict[str, torch.Tensor]:
    """One rank's part of full checkpoint tensors: ``layout[name]`` says which (a ``CheckpointSlot``: rows
    or columns ``shard`` along ``dim``). Views, no copies. ValueError for a name the layout lacks."""
    parts = {}
    for name, tensor in weights.items():
        slot = layout.get(name)
        if slot is None:
            raise ValueError(f"unknown parameter {name!r} (not in the engine's checkpoint layout)")
        start, end = slot.shard
        parts[name] = tensor.narrow(slot.dim, start, end - start)
    return parts


class _MappedBucket:
    """The message source of one rank's part: its bucket, mapped at start (its names are the vote's)."""

    def __init__(self, version: int, handle: dict) -> None:
        self.version, self.handle = version, handle
        self.records: list[Update] = []

    def start(self) -> Start:
        header, data = map_chunk(self.handle)
        self.records = read_bucket(header, data)  # views into data, which they keep alive
        return Start(version=self.version, names=sorted(u.name for u in self.records))

    def chunks(self) -> Iterator:
        yield lambda: self.records

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        pass  # the votes told every rank; the engine's caller gets the error


def serve_rank_local(sink: UpdateSink, version: int, handle: dict, *, exchange: Exchange) -> UpdateResult:
    """Apply this rank's bucket as part of one update of every rank; call on every rank with its own
    ``handle``. Returns this rank's result once every rank has published ``version``; otherwise raises
    WeightUpdateError naming each failing rank and its error, with every rank's weights and version
    unchanged."""
    return serve_session(sink, _MappedBucket(version, handle), votes=ExchangeVotes(exchange, version))
