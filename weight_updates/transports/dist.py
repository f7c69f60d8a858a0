"""torch.distributed transport: one source rank broadcasts bucketed records to every other rank.

::

    src rank (trainer)                               every other rank (rollout)
    broadcast JSON {"op": "start", version, names,
                    buckets: [{header, nbytes}, ...]}  session.start
    broadcast bucket 0 .. k-1 (flat uint8)             session.add(read_bucket(header, bucket))
    all_reduce(num failed ranks)                       session.finish(); contribute 1 if it failed

JSON goes as an int64 length then a uint8 tensor. Buckets pack many records into flat buffers of
about ``bucket_bytes``, so small tensors do not each pay a collective. Works with gloo (CPU tensors)
and NCCL (CUDA tensors: pass a CUDA ``device``). A rank that rejects a bucket keeps taking part in
the remaining collectives, so nobody hangs; timeouts are the process group's (``init_process_group``).
Every receiving rank gets every record; a target under tensor parallelism writes only its shard.
This module does not create or destroy process groups.
"""

import json
from collections.abc import Sequence

import torch

from weight_updates.encoding import Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult, WeightReceiver
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

    def send(self, version: int, updates: Sequence[Update]) -> dict:
        """Broadcast one session. Raises WeightUpdateError if any receiving rank rejected it."""
        import torch.distributed as dist

        updates = list(updates)
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
        return {"version": version, "num_ranks": dist.get_world_size(self.group) - 1}


class DistReceiver:
    """A receiving rank: serves sessions from ``src`` on ``receiver``."""

    def __init__(self, receiver: WeightReceiver, *, src: int, group=None, device: torch.device | str = "cpu") -> None:
        self.receiver, self.src, self.group, self.device = receiver, src, group, torch.device(device)

    def serve_one(self) -> UpdateResult:
        """Take part in one broadcast session; raises WeightUpdateError if it failed here."""
        import torch.distributed as dist

        session = self.receiver.session()
        error: WeightUpdateError | None = None
        start = _broadcast_json(None, src=self.src, group=self.group, device=self.device)
        try:
            session.start(start["version"], expected_names=start["names"])
        except (WeightUpdateError, KeyError, TypeError) as e:
            error = e if isinstance(e, WeightUpdateError) else WeightUpdateError(f"malformed start message: {e!r}")
        for bucket in start.get("buckets", []):
            buf = torch.empty(int(bucket["nbytes"]), dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, src=self.src, group=self.group)
            if error is None:
                try:
                    session.add(read_bucket(bucket["header"], buf))
                except WeightUpdateError as e:
                    error = e
        result = None
        if error is None:
            try:
                result = session.finish()
            except WeightUpdateError as e:
                error = e
        session.abort()
        _count_failures(error is not None, group=self.group, device=self.device)
        if error is not None:
            raise error
        assert result is not None
        return result
