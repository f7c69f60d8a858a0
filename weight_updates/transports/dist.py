"""torch.distributed transport: one source rank broadcasts bucketed records to every other rank.

::

    src rank (trainer)                               every other rank (rollout)
    broadcast JSON {"op": "start", version, names,
                    buckets: [{header, nbytes}, ...]}  session.start
    broadcast bucket 0 .. k-1 (flat uint8)             session.add(read_bucket(header, bucket))
    all_reduce(num failed ranks)                       session.finish(); contribute 1 if it failed
                                                       (the session loop: protocol.serve_session)

JSON goes as an int64 length then a uint8 tensor. Buckets pack many records into flat buffers of
about ``bucket_bytes``, so small tensors do not each pay a collective. Works with gloo (CPU tensors)
and NCCL (CUDA tensors: pass a CUDA ``device``). A rank that rejects a bucket keeps taking part in
the remaining collectives, so nobody hangs; timeouts are the process group's (``init_process_group``).
Every receiving rank gets every record; a target under tensor parallelism writes only its shard.
This module does not create or destroy process groups.
"""

import functools
import json
import time
from collections.abc import Iterator, Sequence

import torch

from weight_updates.encoding import Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult
from weight_updates.transports.protocol import SendResult, Start, UpdateSink, serve_session
from weight_updates.wire import plan_bucket, read_bucket, split_buckets, write_bucket


def _broadcast_json(message: dict | None, *, src: int, group, device: torch.device) -> dict:
    import torch.distributed as dist

    payload = json.dumps(message).encode() if message is not None else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if message is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    if message is not None:
        return message
    try:
        return json.loads(data.cpu().numpy().tobytes())
    except json.JSONDecodeError as e:
        raise WeightUpdateError(f"malformed broadcast metadata: {e}") from None


def _count_failures(failed: bool, *, group, device: torch.device) -> int:
    import torch.distributed as dist

    count = torch.tensor([int(failed)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())


class DistSender:
    """The source rank. ``device``: where buckets are staged (cpu for gloo, cuda for NCCL)."""

    def __init__(self, *, src: int, group=None, device: torch.device | str = "cpu", bucket_bytes: int = 64 << 20) -> None:
        self.src, self.group, self.device, self.bucket_bytes = src, group, torch.device(device), bucket_bytes

    def send(self, version: int, updates: Sequence[Update]) -> SendResult:
        """Broadcast one session. Raises WeightUpdateError if any receiving rank rejected it. The receivers
        answer with a failure count only, so ``received`` is empty."""
        import torch.distributed as dist

        started, updates = time.perf_counter(), list(updates)
        plans = [plan_bucket(b) for b in split_buckets(updates, self.bucket_bytes)]
        start = {"op": "start", "version": version, "names": [u.name for u in updates], "buckets": [{"header": p.header, "nbytes": p.nbytes} for p in plans]}
        _broadcast_json(start, src=self.src, group=self.group, device=self.device)
        for plan in plans:
            buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
            write_bucket(plan, buf)
            dist.broadcast(buf, src=self.src, group=self.group)
        num_failed = _count_failures(False, group=self.group, device=self.device)
        if num_failed:
            raise WeightUpdateError(f"{num_failed} receiving ranks rejected version {version} (see their logs)")
        return SendResult.of(version, updates, started, num_receivers=dist.get_world_size(self.group) - 1)


class _DistSource:
    """A receiving rank's part of one broadcast session: it takes part in every broadcast whatever happened
    here, and answers with its vote in the failure count."""

    def __init__(self, owner: "DistReceiver") -> None:
        self.owner = owner
        self.start_message: dict = {}

    def start(self) -> Start:
        o = self.owner
        self.start_message = _broadcast_json(None, src=o.src, group=o.group, device=o.device)
        # a start without version or names is rejected by the session, and the buckets are still taken
        return Start(version=self.start_message.get("version"), names=self.start_message.get("names"))

    def chunks(self) -> Iterator:
        import torch.distributed as dist

        o = self.owner
        for bucket in self.start_message.get("buckets", []):
            buf = torch.empty(int(bucket["nbytes"]), dtype=torch.uint8, device=o.device)
            dist.broadcast(buf, src=o.src, group=o.group)
            yield functools.partial(read_bucket, bucket["header"], buf)

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        o = self.owner
        _count_failures(error is not None, group=o.group, device=o.device)


class DistReceiver:
    """A receiving rank: serves sessions from ``src`` on ``sink`` (a ``WeightReceiver``, or an engine's
    ``weight_sink()``)."""

    def __init__(self, sink: UpdateSink, *, src: int, group=None, device: torch.device | str = "cpu") -> None:
        self.sink, self.src, self.group, self.device = sink, src, group, torch.device(device)

    def serve_one(self) -> UpdateResult:
        """Take part in one broadcast session; raises WeightUpdateError if it failed here."""
        return serve_session(self.sink, _DistSource(self))
