"""NIXL transport on CPU: a trainer process offers a different slice to each of two rollout ranks,
which READ them over UCX (tcp) and apply them. Skips when nixl is not installed."""

import multiprocessing as mp

import pytest
import torch

pytest.importorskip("nixl._api")

from test_weight_updates import FakeTarget, adamw_like_step, assert_bitwise_equal, new_trainer  # noqa: E402
from weight_updates import Patch, WeightDiffer, WeightReceiver, WeightUpdateError  # noqa: E402
from weight_updates.transports.nixl import NixlReceiver, NixlSender  # noqa: E402

SEED = 21


def layer_slice(updates, rank: int):
    """Rank r owns layer r's parameters (a stand-in for a shard); rank 0 also the rest."""
    own = [u for u in updates if f"layers.{rank}." in u.name]
    return own + ([u for u in updates if ".layers." not in u.name] if rank == 0 else [])


def trainer(conns) -> None:
    """v1: every rank's slice intact. v2: rank 1's slice carries a bad checksum."""
    target = FakeTarget(torch.bfloat16, seed=SEED)
    differ = WeightDiffer(target.checkpoint_specs())
    differ.commit(differ.encode(target.checkpoint_state()))
    master = new_trainer(target)
    sender = NixlSender(conns, timeout_s=60)
    adamw_like_step(master, torch.Generator().manual_seed(SEED))
    pending = differ.encode(master)
    slices = [layer_slice(pending.updates, r) for r in range(len(conns))]
    result = sender.send(1, slices)
    assert [r.version for r in result.received] == [1, 1] and result.num_receivers == 2
    assert [r.num_dense + r.num_patch for r in result.received] == [len(s) for s in slices]
    differ.commit(pending)

    adamw_like_step(master, torch.Generator().manual_seed(SEED + 1))
    slices = [layer_slice(differ.encode(master).updates, r) for r in range(len(conns))]
    slices[1][0] = Patch(name=slices[1][0].name, indices=slices[1][0].indices, values=slices[1][0].values, checksum=slices[1][0].checksum + 1, escapes=slices[1][0].escapes)
    with pytest.raises(WeightUpdateError, match="rollout ranks rejected version 2: {1: .checksum mismatch"):
        sender.send(2, slices)


def test_nixl_read_of_each_ranks_slice_is_bitwise_exact():
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    proc = ctx.Process(target=trainer, args=([p[1] for p in pipes],))
    proc.start()
    targets = [FakeTarget(torch.bfloat16, seed=SEED) for _ in range(2)]
    receivers = [NixlReceiver(p[0], WeightReceiver(t), timeout_s=60) for p, t in zip(pipes, targets)]
    try:
        assert [r.serve_one(start_timeout_s=120).version for r in receivers] == [1, 1]
        after_v1 = targets[1].snapshot_runtime()
        assert receivers[0].serve_one(start_timeout_s=60).version == 2
        with pytest.raises(WeightUpdateError, match="checksum mismatch"):
            receivers[1].serve_one(start_timeout_s=60)
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert_bitwise_equal(targets[1].snapshot_runtime(), after_v1)
    assert [r.sink.version for r in receivers] == [2, 1]
    master = new_trainer(FakeTarget(torch.bfloat16, seed=SEED))
    adamw_like_step(master, torch.Generator().manual_seed(SEED))
    v1 = {n: t.bfloat16() for n, t in master.items()}
    adamw_like_step(master, torch.Generator().manual_seed(SEED + 1))
    v2 = {n: t.bfloat16() for n, t in master.items()}
    initial = FakeTarget(torch.bfloat16, seed=SEED).checkpoint_state()
    for rank, (target, expected) in enumerate(zip(targets, (v2, v1))):
        state = target.checkpoint_state()
        owned = {n for n in state if f"layers.{rank}." in n or (rank == 0 and ".layers." not in n)}
        assert_bitwise_equal({n: state[n] for n in owned}, {n: expected[n] for n in owned})
        assert_bitwise_equal({n: state[n] for n in state if n not in owned}, {n: initial[n] for n in state if n not in owned})
