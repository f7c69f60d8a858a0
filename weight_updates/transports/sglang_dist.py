"""SGLang's distributed weight push, receiving side: the process group a trainer (slime) creates for it, and a
`MessageSource` that takes one broadcast per tensor.

::

    trainer (rank 0)                                   server (rank_offset .. rank_offset + tp - 1)
    init_custom_process_group(tcp://addr:port, ...)    POST /init_weights_update_group -> the same call
    POST /update_weights_from_distributed {names, dtypes, shapes, weight_version}
    broadcast(tensor_i, src=0) for i in names order    BroadcastSource: a buffer of dtype_i / shape_i each,
                                                       Dense records into serve_session(engine.weight_sink())
    (or, "encoding": "patch", buckets: [{header, nbytes}]:
     broadcast(bucket_j as flat uint8, src=0)          read_bucket(header_j, buffer_j): Dense / Patch records)

`BroadcastSource` is one call as one session. slime sends a push as several calls (buckets) with one
weight_version between /pause_generation and /continue_generation; `SpanningSource` makes them one session whose
records arrive call by call, staged (checked, nothing written) until the stream ends, then validated, written and
published at once, or refused as a whole.

The group is made as SGLang's ``init_custom_process_group`` makes it: a TCP rendezvous store, a ``PrefixStore``
named after the group, and torch's process-group helper with the requested backend (gloo on CPU tensors, NCCL on
CUDA ones); its timeout bounds every broadcast, so a sender that dies mid-push ends the session with an error
(the session then keeps the old weights and version). The receiver always takes every broadcast the request
announced, even after a record was refused, so the trainer is never left blocked. Nothing is answered over the
group: the HTTP response carries the result. This module does not validate records (the session does) and does
not speak HTTP (rollout/server.py does).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch

from weight_updates.encoding import Dense, Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult
from weight_updates.transports.protocol import Start
from weight_updates.wire import read_bucket


def parse_dtype(name: str) -> torch.dtype:
    """A dtype as SGLang's API names it ("bfloat16", or "torch.bfloat16"); ValueError for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name (such as 'bfloat16')")
    return dtype


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta):
    """A process group of its own (not the default one), as SGLang's helper of the same name makes it; both the
    trainer (rank 0) and each server rank call it. Blocks until every rank has joined or `timeout` passed."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch renamed the helper's options argument (pg_options -> backend_options); SGLang compares version
    # strings to choose, which misreads "2.13" < "2.6": ask the signature instead
    options = "backend_options" if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                           timeout=timeout, **{options: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(group) -> None:
    """Tear down a group `init_custom_process_group` made (its peers' pending collectives then fail)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


def _dense(name: str, tensor: torch.Tensor) -> list[Update]:
    try:
        return [Dense.of(name, tensor)]
    except ValueError as e:  # a dtype no checksum takes (float64): the session never sees it
        raise WeightUpdateError(f"{name}: {e}") from None


class BroadcastSource:
    """One `/update_weights_from_distributed` session from rank 0 of `group` (a `MessageSource`).

    Dense (SGLang's): one broadcast per name into a buffer of its dtype and shape, each yielding one `Dense`
    record. Patch: one broadcast per bucket ``{"header", "nbytes"}`` into a flat uint8 buffer, each yielding the
    records its header lists.
    """

    def __init__(self, group, *, version: int, names: Sequence[str], device: torch.device | str = "cpu",
                 dtypes: Sequence[torch.dtype] | None = None, shapes: Sequence[Sequence[int]] | None = None,
                 buckets: Sequence[dict] | None = None) -> None:
        assert (buckets is None) == (dtypes is not None and shapes is not None), "dense or patch, not both"
        self.group, self.version, self.names, self.device = group, version, list(names), torch.device(device)
        self.dtypes, self.shapes, self.buckets = dtypes, shapes, buckets
        self.nbytes = 0  # bytes received so far
        self.broken = False  # a broadcast failed: the group is unusable from here on

    def start(self) -> Start:
        return Start(version=self.version, names=self.names)

    def chunks(self) -> Iterator[Callable[[], list[Update]]]:
        if self.buckets is None:
            for name, dtype, shape in zip(self.names, self.dtypes, self.shapes):
                buf = self._receive(torch.empty(tuple(shape), dtype=dtype, device=self.device))
                yield functools.partial(_dense, name, buf)
        else:
            for bucket in self.buckets:
                buf = self._receive(torch.empty(int(bucket["nbytes"]), dtype=torch.uint8, device=self.device))
                yield functools.partial(read_bucket, bucket["header"], buf)

    def _receive(self, buf: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        try:
            dist.broadcast(buf, src=0, group=self.group)
        except Exception as e:  # the sender went away or timed out: the stream is broken
            self.broken = True
            raise WeightUpdateError(f"the weight broadcast broke off after {self.nbytes} bytes: {e}") from None
        self.nbytes += buf.numel() * buf.element_size()
        return buf

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        """Nothing goes back over the group (the HTTP response answers)."""


class Call:
    """One `/update_weights_from_distributed` call of an update that spans calls: what it announces, and how its
    caller learns the outcome of its part (`answer(error)`, called once, from the receiving thread)."""

    def __init__(self, *, names: Sequence[str], dtypes: Sequence[torch.dtype] | None = None,
                 shapes: Sequence[Sequence[int]] | None = None, buckets: Sequence[dict] | None = None,
                 answer: Callable[[str | None], None]) -> None:
        self.names, self.dtypes, self.shapes, self.buckets, self.answer = list(names), dtypes, shapes, buckets, answer


class SpanningSource:
    """One session whose records arrive over several calls (a `MessageSource`): slime splits a push into buckets,
    each its own call with the same weight_version, between /pause_generation and /continue_generation.

    `submit(call)` hands a call to the receiving thread (the one running `serve_session`); its broadcasts are
    taken in order whatever happened before, each dense record checked against `specs` (name, shape, dtype, not
    twice) as it is read, and the call answered: None once its records are staged, or the error. `end()` closes
    the stream (the session then validates, writes and publishes, or rolls back). No call nor end within
    `timeout_s` breaks the stream.
    """

    _END = object()

    def __init__(self, group, *, version: int, specs: dict, device: torch.device | str, timeout_s: float) -> None:
        import queue

        self.group, self.version, self.specs, self.device, self.timeout_s = group, version, specs, device, timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._seen: set[str] = set()
        self.nbytes = 0
        self.broken = False
        self.error: str | None = None  # the first error of the session, once known here

    def submit(self, call: Call) -> None:
        self._calls.put(call)

    def end(self) -> None:
        self._calls.put(self._END)

    def start(self) -> Start:
        return Start(version=self.version, names=None)

    def chunks(self) -> Iterator[Callable[[], list[Update]]]:
        import queue

        while True:
            try:
                call = self._calls.get(timeout=self.timeout_s)
            except queue.Empty:
                raise WeightUpdateError(f"no further weight call within {self.timeout_s} s; update refused") from None
            if call is self._END:
                return
            source = BroadcastSource(self.group, version=self.version, names=call.names, device=self.device,
                                     dtypes=call.dtypes, shapes=call.shapes, buckets=call.buckets)
            read_all = True
            try:
                for read in source.chunks():
                    called = []
                    yield functools.partial(self._checked, read, called)
                    read_all = read_all and bool(called)
            except Exception as e:
                self.broken = source.broken
                self.error = self.error or str(e)
                call.answer(str(e))
                raise
            finally:
                self.nbytes += source.nbytes
            if not read_all and self.error is None:  # the session refused a record of this call
                self.error = "a record was refused by the update session (see /continue_generation's answer)"
            call.answer(None if self.error is None else f"update refused: {self.error}")

    def _checked(self, read: Callable[[], list[Update]], called: list) -> list[Update]:
        called.append(True)
        try:
            records = read()
            for r in records:
                spec = self.specs.get(r.name)
                if spec is None:
                    raise WeightUpdateError(f"{r.name}: not a weight of this model")
                if r.name in self._seen:
                    raise WeightUpdateError(f"{r.name}: sent twice in one update")
                if isinstance(r, Dense) and (tuple(r.tensor.shape) != tuple(spec.shape) or r.tensor.dtype != spec.dtype):
                    raise WeightUpdateError(f"{r.name}: got {r.tensor.dtype} {list(r.tensor.shape)}, the model holds "
                                            f"{spec.dtype} {list(spec.shape)}")
                self._seen.add(r.name)
        except Exception as e:
            self.error = self.error or str(e)
            raise
        return records

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        """Nothing goes over the group; the session's outcome is what `serve_session` returns or raises."""
