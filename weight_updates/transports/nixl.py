"""NIXL transport: every rollout rank READs only its own slice of the trainer's registered memory.

::

    trainer (one NIXL agent)                          rollout rank r (its own agent)
    pack slice r of every rank into one buffer;
    register it
    {"op": "start", version, names, agent metadata,
     header, remote: {addr, nbytes, dev}}  --JSON-->   add_remote_agent; register a local buffer
                                                       READ [addr, addr + nbytes) -> local buffer
                                                       session.start/add/finish on the views
    wait for every rank; deregister       <--JSON--    {"op": "result", ok, error | result}

The control messages travel on a ``multiprocessing.connection.Connection`` per rollout rank (a
``Listener``/``Client`` pair works across hosts); agent metadata is base64 inside the JSON. Data moves
only through NIXL (UCX; on CPU UCX needs its tcp transport). ``nixl`` is imported on first use.
The rollout side is a message source of ``protocol.serve_session``. This module does not pick slices: the caller passes one list of records per rollout rank (the same
list for every rank when there is no sharding).
"""

import base64
import time
import uuid
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import torch

from weight_updates.encoding import Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult
from weight_updates.transports.channel import recv_json, recv_result, send_json, send_result
from weight_updates.transports.protocol import SendResult, Start, UpdateSink, serve_session
from weight_updates.wire import plan_bucket, read_bucket, write_bucket


def _new_agent(prefix: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"{prefix}-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=["UCX"]))


def _mem_type(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


class NixlSender:
    """Trainer side. One connection per rollout rank; ``device`` is where slices are staged."""

    def __init__(self, conns: Sequence[Connection], *, device: torch.device | str = "cpu", timeout_s: float = 120.0) -> None:
        self.conns = list(conns)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._agent = None

    def send(self, version: int, slices: Sequence[Sequence[Update]]) -> SendResult:
        """Offer ``slices[r]`` to rollout rank r and wait until all have pulled and applied it.

        ``received`` holds each rank's result; raises WeightUpdateError naming the ranks that rejected the
        push or did not answer.
        """
        if len(slices) != len(self.conns):
            raise ValueError(f"{len(slices)} slices for {len(self.conns)} rollout ranks")
        started = time.perf_counter()
        if self._agent is None:
            self._agent = _new_agent("weight-source")
        agent = self._agent
        plans = [plan_bucket(s) for s in slices]
        offsets = [sum(p.nbytes for p in plans[:r]) for r in range(len(plans))]
        buf = torch.empty(max(1, sum(p.nbytes for p in plans)), dtype=torch.uint8, device=self.device)  # [total bytes]
        for plan, offset in zip(plans, offsets):
            write_bucket(plan, buf[offset : offset + plan.nbytes])
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        mem_type, dev_id = _mem_type(buf)
        registered = agent.register_memory(buf)
        try:
            metadata = base64.b64encode(agent.get_agent_metadata()).decode()
            for conn, slice_, plan, offset in zip(self.conns, slices, plans, offsets):
                remote = {"addr": buf.data_ptr() + offset, "nbytes": plan.nbytes, "dev": dev_id, "mem_type": mem_type}
                send_json(conn, {"op": "start", "version": version, "names": [u.name for u in slice_], "agent": metadata, "header": plan.header, "remote": remote})
            replies = []  # per rank: (result, error)
            for rank, conn in enumerate(self.conns):
                try:
                    replies.append(recv_result(conn, timeout_s=self.timeout_s, waiting_for=f"rollout rank {rank}'s result"))
                except WeightUpdateError as e:
                    replies.append((None, str(e)))
        finally:
            agent.deregister_memory(registered)
        failed = {rank: error for rank, (_, error) in enumerate(replies) if error is not None}
        if failed:
            raise WeightUpdateError(f"rollout ranks rejected version {version}: {failed}")
        return SendResult.of(version, [u for s in slices for u in s], started, num_receivers=len(self.conns),
                             received=[result for result, _ in replies])


class _NixlSource:
    """A rollout rank's messages of one session: the offer (start), one chunk pulled with a NIXL READ."""

    def __init__(self, owner: "NixlReceiver", start_timeout_s: float | None) -> None:
        self.owner, self.start_timeout_s = owner, start_timeout_s
        self.offer: dict | None = None

    def start(self) -> Start:
        offer = recv_json(self.owner.conn, timeout_s=self.start_timeout_s, waiting_for="a session start")
        if offer["op"] != "start":
            raise WeightUpdateError(f"expected 'start', got {offer['op']!r}")
        self.offer = offer
        return Start(version=offer["version"], names=offer["names"])

    def chunks(self) -> Iterator:
        yield lambda: read_bucket(self.offer["header"], self.owner._pull(self.offer))

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        send_result(self.owner.conn, result, error)


class NixlReceiver:
    """A rollout rank: pulls its slice with a NIXL READ and applies it on ``sink`` (a ``WeightReceiver``, or an
    engine's ``weight_sink()``)."""

    def __init__(self, conn: Connection, sink: UpdateSink, *, timeout_s: float = 120.0) -> None:
        self.conn = conn
        self.sink = sink
        self.timeout_s = timeout_s
        self._agent = None

    def serve_one(self, *, start_timeout_s: float | None = None) -> UpdateResult:
        """Wait for an offer, pull, apply; raises WeightUpdateError (after replying) on failure."""
        return serve_session(self.sink, _NixlSource(self, start_timeout_s))

    def _pull(self, start: dict) -> torch.Tensor:
        """[nbytes] uint8 on the target's device: the slice READ from the trainer's memory."""
        if self._agent is None:
            self._agent = _new_agent("weight-sink")
        agent = self._agent
        remote = start["remote"]
        nbytes = int(remote["nbytes"])
        local = torch.empty(max(1, nbytes), dtype=torch.uint8, device=self.sink.device)
        if nbytes == 0:
            return local[:0]
        peer = agent.add_remote_agent(base64.b64decode(start["agent"]))
        registered = agent.register_memory(local)
        handle = None
        try:
            local_descs = agent.get_xfer_descs([(local.data_ptr(), nbytes, _mem_type(local)[1])], _mem_type(local)[0])
            remote_descs = agent.get_xfer_descs([(int(remote["addr"]), nbytes, int(remote["dev"]))], str(remote["mem_type"]))
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer)
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise WeightUpdateError(f"NIXL READ of {nbytes} bytes from {peer} ended in state {state}")
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            agent.deregister_memory(registered)
            agent.remove_remote_agent(peer)
        return local
