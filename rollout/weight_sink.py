"""The one thing an engine's weight updates are received into: a sink whose sessions wait for the engine
and tell it.

::

    sink = engine.weight_sink()                 # one per engine
    IpcReceiver(conn, sink).serve_one()         # or NixlReceiver, DistReceiver, InProcessSender, serve_rank_local
      session.start(version)    the step in flight is finished first; refused while the weights sleep
      session.add(records)*     checked as they come; nothing written
      session.prepare()         validated in full; nothing written
      session.commit()          written and verified (a step launched since start is finished first)
      session.publish()         the scheduler's policy version moves, once

The receiver behind the sink validates and writes: the engine's `WeightReceiver` in one process, or, under
tensor parallelism, a `StagingReceiver` that checks the records on rank 0 and hands them to every rank at
commit. This module does not validate records and does not know transports.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch

from weight_updates import UpdateResult, WeightUpdateError


class EngineSink:
    """An `UpdateSink` (weight_updates.transports.protocol) over an engine.

    `begin()` readies the engine for a write (finishes the step in flight, checks that the weights are on
    the device; raises WeightUpdateError otherwise) and returns its policy version; `publish(version)` tells
    the scheduler the new version.
    """

    def __init__(self, receiver, *, begin: Callable[[], int], publish: Callable[[int], None], device: torch.device) -> None:
        self.receiver = receiver  # a WeightReceiver or a StagingReceiver
        self._begin, self._publish, self._device = begin, publish, device

    @property
    def version(self) -> int:
        return self.receiver.version

    @property
    def device(self) -> torch.device:
        return self._device

    def session(self, *, dense_rollback: bool | None = None) -> "EngineSession":
        """A new session; `dense_rollback` as for `WeightReceiver.session`."""
        return EngineSession(self, self.receiver.session(dense_rollback=dense_rollback))


class EngineSession:
    """One update of the engine: the calls and states of an `UpdateSession`."""

    def __init__(self, sink: EngineSink, inner) -> None:
        self._sink, self._inner = sink, inner

    @property
    def state(self) -> str:
        return self._inner.state

    def start(self, version: int, *, expected_names: Collection[str] | None = None) -> None:
        if self._inner.state == "new":  # otherwise the inner session names the misuse
            self._sink.receiver.version = self._sink._begin()  # the engine's version, whatever path moved it last
        self._inner.start(version, expected_names=expected_names)

    def add(self, updates: Iterable) -> None:
        self._inner.add(updates)

    def finish(self) -> UpdateResult:
        if self.state != "started":
            raise WeightUpdateError(f"finish() on a session that is {self.state}")
        self.prepare()
        self.commit()
        return self.publish()

    def prepare(self) -> None:
        self._inner.prepare()

    def commit(self) -> None:
        if self._inner.state == "prepared":
            try:
                self._sink._begin()
            except BaseException:
                self._inner.rollback()  # nothing written yet: ends the session
                raise
        self._inner.commit()

    def publish(self) -> UpdateResult:
        result = self._inner.publish()
        self._sink._publish(result.version)
        return result

    def abort(self) -> None:
        self._inner.abort()

    def rollback(self) -> str:
        return self._inner.rollback()
