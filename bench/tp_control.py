"""The tensor-parallel control channel: microseconds per control message (each step's scheduler output travels
as one) between two spawned gloo ranks on this host, `TPGroup.broadcast_json` against the exchange it replaced
(a broadcast of the length, then one of the bytes) in the same run, rounds alternating. Prints one JSON line per
message size. CPU only (the channel is host-side on every device).

    python bench/tp_control.py
    python bench/tp_control.py --sizes 200,10000 --messages 1000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def two_broadcasts(tp, obj):
    """The previous `broadcast_json`: the length, then the JSON bytes."""
    if tp.rank == 0:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    tp._broadcast(length)
    if tp.rank != 0:
        data = torch.empty(int(length[0]), dtype=torch.uint8)
    tp._broadcast(data)
    return obj if tp.rank == 0 else json.loads(data.numpy().tobytes())


def _rank(rank: int, store: str, args, out: str) -> None:
    from runner.parallel.group import TPGroup

    torch.set_num_threads(1)
    tp = TPGroup(rank, 2, torch.device("cpu"), store)
    timings = {}
    for n in args.sizes:
        obj = {"kind": "step", "payload": "x" * n} if rank == 0 else None
        for name, send in (("two_broadcasts", lambda o: two_broadcasts(tp, o)), ("broadcast_json",
                                                                                 tp.broadcast_json)) * args.rounds:
            for _ in range(20):
                send(obj)
            start = time.perf_counter()
            for _ in range(args.messages):
                send(obj)
            timings.setdefault((n, name), []).append((time.perf_counter() - start) / args.messages * 1e6)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({f"{n}:{name}": min(v) for (n, name), v in timings.items()}, f)
    os._exit(0)  # as a released engine rank leaves (runner/parallel/worker.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200,10000,40000,100000", help="JSON payload characters per message")
    ap.add_argument("--messages", type=int, default=300, help="messages per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per exchange (best is reported)")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    from bench.generate import emit
    from runner.parallel.group import CONTROL_HEAD_BYTES

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timings.json")
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, os.path.join(tmp, "store"), args, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if [p.exitcode for p in procs] != [0, 0]:
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        with open(out) as f:
            timings = json.load(f)
    for n in args.sizes:
        old, new = timings[f"{n}:two_broadcasts"], timings[f"{n}:broadcast_json"]
        emit(kind="tp_control", payload_chars=n, head_bytes=CONTROL_HEAD_BYTES, two_broadcasts_us=round(old, 1),
             broadcast_json_us=round(new, 1), ratio=round(new / old, 3), ranks=2, backend="gloo",
             cpus=os.cpu_count())


if __name__ == "__main__":
    main()
