"""The tensor-parallel control channel (runner/parallel/group.py) between two spawned gloo ranks: every message
size around the first broadcast's capacity (`CONTROL_HEAD_BYTES`) arrives whole and in order, and a message that
fits takes one broadcast."""

import json
import os

import torch
from conftest import run_ranks

from runner.parallel.group import CONTROL_HEAD_BYTES

ROOM = CONTROL_HEAD_BYTES - 8  # JSON bytes that fit beside the length


def _messages() -> list:
    """Messages whose JSON is 2 bytes, exactly ROOM, ROOM + 1, several times ROOM, with non-ASCII text; the
    same list on both ranks."""
    def of_length(n: int) -> dict:
        m = {"s": ""}
        m["s"] = "x" * (n - len(json.dumps(m)))
        assert len(json.dumps(m).encode()) == n
        return m

    return [{}, of_length(ROOM), of_length(ROOM + 1), of_length(5 * ROOM + 3),
            {"kind": "step", "text": "héllo 鸟 🙂" * 2000, "ids": list(range(3000))}, [1, 2.5, None, True]]


def _rank(rank: int, store: str, out: str) -> None:
    from runner.parallel.group import TPGroup

    tp = TPGroup(rank, 2, torch.device("cpu"), store, timeout_s=60)
    broadcasts = []
    send = tp._broadcast
    tp._broadcast = lambda x: (broadcasts.append(x.numel()), send(x))
    got = []
    for message in _messages():
        before = len(broadcasts)
        got.append([tp.broadcast_json(message if rank == 0 else None), len(broadcasts) - before])
    with open(out, "w") as f:
        json.dump(got, f)
    os._exit(0)  # as a released engine rank leaves (runner/parallel/worker.py)


def test_every_message_size_arrives_whole_in_one_broadcast_when_it_fits(tmp_path):
    want = _messages()
    sizes = [len(json.dumps(m).encode()) for m in want]
    for r, got in enumerate(run_ranks(_rank, tmp_path)):
        assert [g[0] for g in got] == want, r
        assert [g[1] for g in got] == [1 if n <= ROOM else 2 for n in sizes], r
