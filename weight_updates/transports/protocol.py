"""The one protocol every transport speaks: what a sender returns, what a receiver writes into, and the one
loop that runs a session from a stream of messages.

::

    sender                                    receiver: serve_session(sink, source)
    send(version, records) -> SendResult        source.start()   -> session.start(version, names)
                                                source.chunks()  -> session.add(records), chunk by chunk;
                                                                    read to the end even after an error
                                                prepare -> [vote] -> commit -> [vote] -> publish, or rollback
                                                source.reply(result or error)

A transport is a sender and a ``MessageSource``: the source reads the transport's messages (IPC maps shared
memory, NIXL pulls, torch.distributed takes part in broadcasts) and answers the sender; what to do when a
chunk is bad, when the stream breaks and when to answer is decided here, once. A sink (``UpdateSink``) is
anything whose ``session()`` gives an ``UpdateSession``'s calls: a ``WeightReceiver``, a ``StagingReceiver``, or
an engine's ``weight_sink()`` (which also drains the engine and publishes the version to its scheduler).

Receivers that must agree, each running its own session (tensor-parallel ranks, each with its part), pass
``ExchangeVotes``: after ``prepare`` and after ``commit`` every receiver learns whether every receiver
succeeded, and all publish or all roll back. ``commit_on_all`` runs the same three steps from a coordinator
that calls its participants (a pool's workers), and ``answer`` is what a participant replies.

This module moves no bytes and imports no backend.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from weight_updates.encoding import Dense, Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult, UpdateSession


@dataclass(frozen=True, kw_only=True, slots=True)
class SendResult:
    """What one push did, as every sender reports it."""

    version: int
    """The version the receiving sides now hold."""
    num_receivers: int
    """How many receiving sides applied it (rollout ranks, pool workers)."""
    num_dense: int
    num_patch: int
    """Records sent (over every receiver's slice where they differ, as with NIXL)."""
    nbytes: int
    """Payload bytes of those records: dense tensors, patch indices and values."""
    seconds: float
    """The sender's wall time: staging, transfer, and waiting for every answer."""
    received: tuple[UpdateResult, ...] = ()
    """Each receiving side's result where the transport brings it back (in-process, IPC, NIXL, a pool);
    empty for torch.distributed, whose receivers answer with a failure count only."""

    @classmethod
    def of(cls, version: int, records: Sequence[Update], started: float, *, num_receivers: int = 1,
           received: Sequence[UpdateResult] = ()) -> "SendResult":
        """The result of sending ``records``; ``started``: ``time.perf_counter()`` when the send began."""
        num_dense = sum(isinstance(u, Dense) for u in records)
        return cls(version=version, num_receivers=num_receivers, num_dense=num_dense, num_patch=len(records) - num_dense,
                   nbytes=sum(u.nbytes for u in records), seconds=time.perf_counter() - started, received=tuple(received))

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["received"] = [r.to_json() for r in self.received]
        return out


class UpdateSink(Protocol):
    """What a transport's receiver writes into."""

    def session(self) -> UpdateSession:
        """A new session (or an object with the same calls and states)."""
        ...

    @property
    def version(self) -> int:
        """The version it holds."""
        ...

    @property
    def device(self) -> torch.device:
        """Where received buffers should land (the weights' device)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Start:
    """A session's opening message."""

    version: int
    names: list[str] | None  # every parameter the sender will send, or None when it does not say


class MessageSource(Protocol):
    """One transport's receiving end, for one session."""

    def start(self) -> Start:
        """Wait for the session's start; raise (WeightUpdateError) when none comes or it is malformed."""
        ...

    def chunks(self) -> Iterator[Callable[[], list[Update]]]:
        """Read the session's messages to its end. Each item reads one chunk's records when called; after an
        error it is not called, but the stream is still read to its end, so the sender is never left blocked.
        Raise for a broken stream (a timeout, a closed peer, an unexpected message)."""
        ...

    def reply(self, result: UpdateResult | None, error: str | None) -> None:
        """Tell the sender how the session ended (the result, or the error's text)."""
        ...


def serve_session(sink: UpdateSink, source: MessageSource, *, votes: "ExchangeVotes | None" = None) -> UpdateResult:
    """Run one session from ``source`` on ``sink``: the receiving side of every transport.

    Returns the result once the session published. Otherwise the sink's weights and version are as they were
    (with ``votes``: on every receiver), the sender is told the error, and it is raised: a WeightUpdateError
    (a KeyError or TypeError while reading the stream is a malformed message), or any other exception as it
    came, after replying. With ``votes`` the error raised names every receiver that failed.
    """
    session = sink.session()
    start: Start | None = None
    error: BaseException | None = None
    try:
        start = source.start()
        error = _attempt(session.start, start.version, expected_names=start.names)
        for read in source.chunks():
            if error is None:
                try:
                    records = read()
                except Exception as e:  # a bad chunk: the rest of the stream is still read
                    error = _malformed(e)
                else:
                    error = _attempt(session.add, records)
    except Exception as e:  # the stream broke: nothing more will come
        error = _malformed(e)
    if error is None:
        error = _attempt(session.prepare)
    if votes is not None:
        error = votes.after_prepare(None if start is None else start.names, error)
    if error is None:
        error = _attempt(session.commit)
        if votes is not None:
            error = votes.after_commit(error, session)
    if error is None:
        result = session.publish()
        source.reply(result, None)
        return result
    session.rollback()  # writes back what this session's commit wrote, if it wrote; ends it
    source.reply(None, describe(error))
    raise error


def _malformed(error: Exception) -> Exception:
    """A KeyError or TypeError while reading messages is a message without the fields it needs."""
    return WeightUpdateError(f"malformed message: {error!r}") if isinstance(error, (KeyError, TypeError)) else error


def _attempt(call: Callable, *args, **kwargs) -> Exception | None:
    try:
        call(*args, **kwargs)
    except Exception as e:
        return e
    return None


def describe(error: BaseException | None) -> str | None:
    """An error as the text a peer is told (None for none)."""
    if error is None:
        return None
    return str(error) if isinstance(error, WeightUpdateError) else f"{type(error).__name__}: {error}"


class ExchangeVotes:
    """Votes among receivers that each run one session of the same update in step (tensor-parallel ranks).

    ``exchange`` is an all-gather of JSON values, in rank order (``TPGroup.all_gather_json``). Every receiver
    takes part in both votes whatever happened on it, so none waits on a collective the others skipped. The
    first vote also checks that every receiver got records of the same tensors (each holds a part of every
    tensor, so all update the same ones).
    """

    def __init__(self, exchange: Callable[[object], list], version: int) -> None:
        """``version``: the update's, for the error messages."""
        self.exchange = exchange
        self.version = version

    def after_prepare(self, names: list[str] | None, error: BaseException | None) -> BaseException | None:
        """None if every receiver validated the same tensors; else the error every receiver raises."""
        votes = self.exchange({"error": describe(error), "names": names})
        errors = [v["error"] for v in votes]
        if not any(errors):
            errors = [None if v["names"] == votes[0]["names"] else _names_differ(v["names"], votes[0]["names"]) for v in votes]
        if any(errors):
            return WeightUpdateError(f"version {self.version} rejected, nothing written on any rank: {_by(errors, 'rank')}")
        return None

    def after_commit(self, error: BaseException | None, session: UpdateSession) -> BaseException | None:
        """None if every receiver wrote and verified; else every receiver rolls back (one that failed has
        already restored itself) and the error names what failed and what each restored."""
        errors = self.exchange(describe(error))
        if not any(errors):
            return None
        outcomes = self.exchange(session.rollback() if error is None else "see its error")
        return WeightUpdateError(f"version {self.version} failed after writing: {_by(errors, 'rank')}; rolled back: "
                                 + "; ".join(f"rank {rank}: {o}" for rank, o in enumerate(outcomes)))


def answer(call: Callable, *args) -> dict:
    """What a participant of ``commit_on_all`` replies: ``{"ok": True, "result": call(*args)}``, or ``{"ok": False,
    "error": text}`` if it raised."""
    try:
        return {"ok": True, "result": call(*args)}
    except Exception as e:
        return {"ok": False, "error": describe(e)}


def commit_on_all(version: int, run: Callable[[str], list[dict | None]], *, who: str = "worker") -> list[dict | None]:
    """One update on every participant, all or none: the votes of ``ExchangeVotes``, driven from one place.

    Each participant stages the update in a session of its own. ``run(step)`` calls ``step`` ("prepare",
    "commit", "publish" or "drop") on every participant and returns, per participant, its ``answer``, or None
    for one that is gone (it takes no part in the votes; its owner restores it afterwards)::

        prepare on all (validate, stage)   any failed -> drop on all; raise: nothing written anywhere
        commit on all (write, verify)      any failed -> drop on all (undoes the writes); raise
        publish on all                     every participant now holds ``version``

    Returns the replies to "publish". Raises WeightUpdateError naming each failing participant (and, after a
    failed commit, what each restored), or RuntimeError when no participant is left.
    """

    def call(step: str) -> list[dict | None]:
        replies = run(step)
        if all(r is None for r in replies):
            raise RuntimeError(f"every {who} is gone (at {step} of version {version})")
        return replies

    def errors(replies: list[dict | None]) -> list[str | None]:
        return [None if r is None or r.get("ok") else str(r.get("error")) for r in replies]

    failed = errors(call("prepare"))
    if any(failed):
        run("drop")
        raise WeightUpdateError(f"version {version} rejected, nothing written on any {who}: {_by(failed, who)}")
    failed = errors(call("commit"))
    if any(failed):
        dropped = run("drop")
        outcomes = ["see its error" if e else "gone" if r is None else str(r.get("result") if r.get("ok") else r.get("error"))
                    for e, r in zip(failed, dropped)]
        raise WeightUpdateError(f"version {version} failed after writing: {_by(failed, who)}; rolled back: "
                                + "; ".join(f"{who} {i}: {o}" for i, o in enumerate(outcomes)))
    published = call("publish")
    failed = errors(published)
    if any(failed):  # publishing a committed session only moves versions: a failure here is a bug
        raise WeightUpdateError(f"version {version} committed everywhere but not published on: {_by(failed, who)}")
    return published


def _names_differ(mine: list[str] | None, first: list[str] | None) -> str:
    extra, missing = sorted(set(mine or ()) - set(first or ())), sorted(set(first or ()) - set(mine or ()))
    return f"its records name other tensors than rank 0's (not on rank 0: {extra[:3]}, only on rank 0: {missing[:3]})"


def _by(errors: list, who: str) -> str:
    return "; ".join(f"{who} {i}: {e}" for i, e in enumerate(errors) if e)
