"""Same-process transport: hand records straight to a sink (a ``WeightReceiver``, an engine's
``weight_sink()``) through the one session loop (``protocol.serve_session``). No copies, no threads."""

import time
from collections.abc import Iterator, Sequence

from weight_updates.encoding import Update
from weight_updates.session import UpdateResult
from weight_updates.transports.protocol import SendResult, Start, UpdateSink, serve_session


class _Records:
    """The message source of an in-process push: the records as one chunk; no one to answer."""

    def __init__(self, version: int, updates: list[Update]) -> None:
        self.version, self.updates = version, updates

    def start(self) -> Start:
        return Start(version=self.version, names=[u.name for u in self.updates])

    def chunks(self) -> Iterator:
        yield lambda: self.updates

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        pass  # the sender is the caller: it gets the result or the exception


class InProcessSender:
    """Sends each push as one session on ``sink``; raises WeightUpdateError if it is rejected."""

    def __init__(self, sink: UpdateSink) -> None:
        self.sink = sink

    def send(self, version: int, updates: Sequence[Update]) -> SendResult:
        started, updates = time.perf_counter(), list(updates)
        result = serve_session(self.sink, _Records(version, updates))
        return SendResult.of(version, updates, started, received=(result,))
