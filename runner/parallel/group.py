"""The tensor-parallel process group of one engine and the collectives the runner needs.

Ranks meet through a torch.distributed file store on the local host. The groups are standalone
process-group objects, not torch.distributed's default group, so one process can drive several TP
engines and a trainer can keep its own default group. Tensor collectives use NCCL on CUDA and gloo on
the CPU; plain-data messages from rank 0 to the workers (each step's scheduler output as JSON,
weight-update metadata and payloads) always travel over a separate gloo group as host tensors, so they
never wait behind device work. Not here: what the messages mean (see worker.py).
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist


CONTROL_HEAD_BYTES = 65536
"""Bytes of a control message's first broadcast: its length (8 bytes), then as much of its JSON as fits. A step's
message fits (a decode step of 256 requests is ~10 KB with the engine's ids, ~40 KB with the server's), so it
costs one broadcast; a longer one sends the rest in a second. Over gloo a broadcast's latency, not its bytes,
sets its cost at these sizes (`python bench/tp_control.py`)."""


def _gloo(store, rank: int, size: int, timeout: timedelta):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class TPGroup:
    """This process's rank in a tensor-parallel group of `size` ranks, and its collectives."""

    def __init__(self, rank: int, size: int, device: torch.device, store_path: str, timeout_s: float = 600.0,
                 expert_parallel: bool = False) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = dist.FileStore(store_path, size)
        self.rank, self.size, self.device = rank, size, device
        self.expert_parallel = expert_parallel  # MoE layers split their experts over the ranks (EngineConfig)
        self._control = _gloo(dist.PrefixStore("control", store), rank, size, timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            self._tensors = dist.ProcessGroupNCCL(dist.PrefixStore("tensors", store), rank, size, options)
        else:
            self._tensors = _gloo(dist.PrefixStore("tensors", store), rank, size, timeout)
        self._head = torch.empty(CONTROL_HEAD_BYTES, dtype=torch.uint8)  # a control message's first broadcast

    def close(self) -> None:
        """Release the NCCL communicators (gloo groups need nothing). Called when no collective is in flight,
        so `abort` (which waits for no peer) is safe, where a graceful destroy could wait on a rank that has
        already gone."""
        release = getattr(self._tensors, "abort", None) or getattr(self._tensors, "shutdown", None)
        if release is not None:
            release()

    # ---- tensor collectives (on the rank's device) ---------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `x`."""
        self._tensors.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [*S] on every rank -> [size, *S], rank order."""
        out = x.new_empty(self.size * x.numel())  # flat: the ranks' parts concatenated
        self._tensors._allgather_base(out, x.contiguous().view(-1)).wait()
        return out.view(self.size, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, *S]: row j goes to rank j; returns [size, *S] whose row i came from rank i."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._tensors.alltoall_base(out, x, [], []).wait()
        return out

    # ---- control channel (host, gloo) -----------------------------------------------------------------
    def broadcast_json(self, obj=None):
        """Rank 0 sends `obj` (JSON-able); every rank returns it. One broadcast of `CONTROL_HEAD_BYTES` (the
        length, then the start of the JSON), and a second of the rest only when it does not fit."""
        head, room = self._head, CONTROL_HEAD_BYTES - 8
        if self.rank == 0:
            data = json.dumps(obj).encode()
            head[:8].view(torch.int64)[0] = len(data)
            first = min(len(data), room)
            if first:
                head[8:8 + first].copy_(torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8))
        self._broadcast(head)
        length = int(head[:8].view(torch.int64)[0])
        if length > room:
            rest = (torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8) if self.rank == 0
                    else torch.empty(length - room, dtype=torch.uint8))
            self._broadcast(rest)
        if self.rank == 0:
            return obj
        payload = head[8:8 + min(length, room)].numpy().tobytes()
        if length > room:
            payload += rest.numpy().tobytes()
        return json.loads(payload)

    def broadcast_host_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Broadcast a contiguous CPU tensor from rank 0 in place (others pass an empty one of the same shape)."""
        assert x.device.type == "cpu" and x.is_contiguous()
        if x.numel():
            self._broadcast(x.reshape(-1).view(torch.uint8))  # any dtype, as bytes
        return x

    def all_gather_json(self, obj) -> list:
        """Every rank passes `obj` (JSON-able); every rank returns the list of all ranks' objects, in rank
        order. Two gloo all-gathers: the lengths, then the bytes padded to the longest."""
        data = json.dumps(obj).encode()
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._control.allgather([lengths], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        width = max(int(n[0]) for n in lengths)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self._control.allgather([parts], [mine]).wait()
        return [json.loads(p[: int(n[0])].numpy().tobytes()) for p, n in zip(parts, lengths)]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (host)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._control.allreduce([t], opts).wait()
        return int(t[0])

    def _broadcast(self, x: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._control.broadcast([x], opts).wait()
