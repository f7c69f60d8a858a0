"""Two processes on one host exchange updates through /dev/shm (and CUDA IPC when a GPU exists).

The rollout side runs in the test process; the trainer side is a spawned child that builds the same
weights from a seed. Children report back only through the JSON channel and their exit code.
"""

import multiprocessing as mp
import os
import time

import pytest
import torch

from test_weight_updates import FakeTarget, adamw_like_step, assert_bitwise_equal, new_trainer
from weight_updates import WeightDiffer, WeightReceiver, WeightUpdateError
from weight_updates.transports.channel import recv_json, send_json
from weight_updates.transports.ipc import SHM_DIR, IpcReceiver, IpcSender
from weight_updates.wire import plan_bucket, to_safetensors_prefix, write_bucket

NUM_PUSHES = 3


def trainer_pushes(conn, device: str, num_pushes: int, seed: int) -> None:
    """Child: push ``num_pushes`` versions of seeded AdamW-like steps, bf16 engine dtype."""
    target = FakeTarget(torch.bfloat16, seed=seed)  # only to share the initial weights and specs
    differ = WeightDiffer(target.checkpoint_specs(), device=device)
    master = new_trainer(target)
    differ.commit(differ.encode(target.checkpoint_state()))  # both sides start from one checkpoint
    sender = IpcSender(conn, device=device, bucket_bytes=2048, timeout_s=30)
    gen = torch.Generator().manual_seed(seed + 1)
    for version in range(1, num_pushes + 1):
        adamw_like_step(master, gen)
        pending = differ.encode(master)
        sender.send(version, pending.updates)
        differ.commit(pending)


def expected_weights(seed: int, num_pushes: int) -> dict[str, torch.Tensor]:
    master = new_trainer(FakeTarget(torch.bfloat16, seed=seed))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(num_pushes):
        adamw_like_step(master, gen)
    return {n: t.bfloat16() for n, t in master.items()}


def run_pair(device: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=trainer_pushes, args=(child, device, NUM_PUSHES, 3))
    proc.start()
    child.close()
    target = FakeTarget(torch.bfloat16, seed=3, device=device)
    receiver = WeightReceiver(target)
    ipc = IpcReceiver(parent, receiver, timeout_s=30)
    results = [ipc.serve_one(start_timeout_s=60) for _ in range(NUM_PUSHES)]
    proc.join(30)
    assert proc.exitcode == 0
    assert [r.version for r in results] == list(range(1, NUM_PUSHES + 1))
    assert all(r.num_patch > 0 for r in results)
    state = {n: t.cpu() for n, t in target.checkpoint_state().items()}
    assert_bitwise_equal(state, expected_weights(3, NUM_PUSHES))


def test_shared_memory_pushes_are_bitwise_exact():
    before = set(os.listdir(SHM_DIR))
    run_pair("cpu")
    assert set(os.listdir(SHM_DIR)) <= before  # every segment was unlinked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_pushes_are_bitwise_exact():
    run_pair("cuda")


def sender_then_silent(conn, die: bool) -> None:
    """Child: start a session, send one good chunk, then die (or hang) before 'finish'."""
    target = FakeTarget(torch.bfloat16, seed=5)
    differ = WeightDiffer(target.checkpoint_specs())
    pending = differ.encode({n: t + 1 for n, t in target.checkpoint_state().items()})
    send_json(conn, {"op": "start", "version": 1, "names": [u.name for u in pending.updates]})
    plan = plan_bucket(pending.updates[:2])
    path = os.path.join(SHM_DIR, f"weight-update-test-{os.getpid()}")
    prefix = to_safetensors_prefix(plan.header)
    buf = torch.from_file(path, shared=True, size=len(prefix) + plan.nbytes, dtype=torch.uint8)
    buf[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    write_bucket(plan, buf[len(prefix) :])
    send_json(conn, {"op": "chunk", "kind": "shm", "path": path})
    if die:
        os.kill(os.getpid(), 9)
    time.sleep(60)


@pytest.mark.parametrize("die", [True, False], ids=["killed", "silent"])
def test_sender_dying_mid_session_leaves_weights(die):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender_then_silent, args=(child, die))
    proc.start()
    child.close()
    target = FakeTarget(torch.bfloat16, seed=5)
    receiver = WeightReceiver(target)
    before = target.snapshot_runtime()
    try:
        with pytest.raises(WeightUpdateError, match="peer closed" if die else "timed out after 2 s"):
            IpcReceiver(parent, receiver, timeout_s=2).serve_one(start_timeout_s=60)
    finally:
        proc.kill()
        proc.join()
        for name in os.listdir(SHM_DIR):
            if name == f"weight-update-test-{proc.pid}":
                os.unlink(os.path.join(SHM_DIR, name))
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 0


def test_truncated_shm_bucket_is_rejected_and_reported_to_the_sender():
    target = FakeTarget(torch.bfloat16, seed=6)
    receiver = WeightReceiver(target)
    differ = WeightDiffer(target.checkpoint_specs())
    updates = differ.encode({n: t * 2 for n, t in target.checkpoint_state().items()}).updates
    plan = plan_bucket(updates)
    prefix = to_safetensors_prefix(plan.header)
    path = os.path.join(SHM_DIR, f"weight-update-test-trunc-{os.getpid()}")
    buf = torch.from_file(path, shared=True, size=len(prefix) + plan.nbytes - 10, dtype=torch.uint8)
    buf[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    trainer_end, rollout_end = mp.Pipe()
    try:
        send_json(trainer_end, {"op": "start", "version": 1, "names": [u.name for u in updates]})
        send_json(trainer_end, {"op": "chunk", "kind": "shm", "path": path})
        send_json(trainer_end, {"op": "finish"})
        before = target.snapshot_runtime()
        with pytest.raises(WeightUpdateError, match="truncated bucket"):
            IpcReceiver(rollout_end, receiver, timeout_s=5).serve_one()
    finally:
        os.unlink(path)
    reply = recv_json(trainer_end, timeout_s=1, waiting_for="result")
    assert reply["ok"] is False and "truncated bucket" in reply["error"]
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 0


def test_receiver_refuses_paths_outside_its_segments():
    trainer_end, rollout_end = mp.Pipe()
    receiver = WeightReceiver(FakeTarget(torch.bfloat16))
    send_json(trainer_end, {"op": "start", "version": 1, "names": ["model.norm.weight"]})
    send_json(trainer_end, {"op": "chunk", "kind": "shm", "path": "/etc/passwd"})
    send_json(trainer_end, {"op": "finish"})
    with pytest.raises(WeightUpdateError, match="refusing to map"):
        IpcReceiver(rollout_end, receiver, timeout_s=5).serve_one()
