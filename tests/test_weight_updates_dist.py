"""torch.distributed (gloo) broadcast of bucketed updates: one trainer rank, two rollout ranks.

Each rank is a spawned process; a rank's assertions become its exit code.
"""

import multiprocessing as mp

import torch

from test_weight_updates import FakeTarget, adamw_like_step, assert_bitwise_equal, new_trainer
from weight_updates import Patch, WeightDiffer, WeightReceiver, WeightUpdateError
from weight_updates.transports.dist import DistReceiver, DistSender

WORLD_SIZE, SEED = 3, 11


def rank_main(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        if rank == 0:
            trainer()
        else:
            rollout()
    finally:
        dist.destroy_process_group()


def trainer() -> None:
    target = FakeTarget(torch.bfloat16, seed=SEED)
    differ = WeightDiffer(target.checkpoint_specs())
    master = new_trainer(target)
    differ.commit(differ.encode(target.checkpoint_state()))
    sender = DistSender(src=0, bucket_bytes=1024)  # small buckets: many broadcasts per push
    gen = torch.Generator().manual_seed(SEED + 1)
    adamw_like_step(master, gen)
    pending = differ.encode(master)
    result = sender.send(1, pending.updates)
    assert (result.version, result.num_receivers, result.received) == (1, 2, ())
    assert (result.num_dense, result.num_patch, result.nbytes) == (pending.stats.num_dense, pending.stats.num_patch, pending.stats.nbytes)
    differ.commit(pending)

    adamw_like_step(master, gen)
    pending = differ.encode(master)
    bad = [Patch(name=u.name, indices=u.indices, values=u.values, checksum=u.checksum + 1, escapes=u.escapes) if isinstance(u, Patch) and u.indices.num_indices else u for u in pending.updates]
    try:
        sender.send(2, bad)
    except WeightUpdateError as e:
        assert "2 receiving ranks rejected version 2" in str(e)
    else:
        raise AssertionError("a corrupt push was accepted")
    sender.send(2, pending.updates)  # the same version again, intact: collectives are still in step
    differ.commit(pending)


def rollout() -> None:
    target = FakeTarget(torch.bfloat16, seed=SEED)
    receiver = WeightReceiver(target)
    dist_receiver = DistReceiver(receiver, src=0)
    assert dist_receiver.serve_one().version == 1
    after_first = target.snapshot_runtime()
    try:
        dist_receiver.serve_one()
    except WeightUpdateError as e:
        assert "checksum mismatch" in str(e)
    else:
        raise AssertionError("a corrupt push was accepted")
    assert_bitwise_equal(target.snapshot_runtime(), after_first)
    assert receiver.version == 1
    assert dist_receiver.serve_one().version == 2

    master = new_trainer(FakeTarget(torch.bfloat16, seed=SEED))
    gen = torch.Generator().manual_seed(SEED + 1)
    adamw_like_step(master, gen)
    adamw_like_step(master, gen)
    assert_bitwise_equal(target.checkpoint_state(), {n: t.bfloat16() for n, t in master.items()})


def test_gloo_broadcast_pushes_are_bitwise_exact(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, str(tmp_path / "pg"))) for rank in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE
