"""Rank-local weight updates: the session's prepare / commit / publish / rollback split, the two-vote
protocol between ranks, and an engine with 2 gloo ranks on the CPU taking each rank's part from its own
/dev/shm segment; and a full-checkpoint IPC push into such an engine's weight sink. Each TP engine spawns
one worker process; the protocol test spawns two ranks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_ranks, tp_config, update_records
from rollout import Engine, SamplingParams
from runner.parallel.rpc import decode
from trainer_bridge import TrainerBridge
from weight_updates import Dense, PackedIndices, Patch, TensorDictTarget, WeightReceiver, WeightUpdateError, checksum
from weight_updates.transports.ipc import SHM_DIR, IpcReceiver, IpcSender
from weight_updates.transports.rank_local import serve_rank_local, shard_weights, stage_bucket

# kv heads (1) < ranks (2): k/v replicated; tied embeddings: the embedding is vocab-sharded
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IDS = [3, 5, 7, 11, 13, 2, 9, 200, 255, 128]
ROW_SHARDED, COL_SHARDED = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"


# ---- the session split (one process) ---------------------------------------------------------------------
def _target():
    g = torch.Generator().manual_seed(0)
    return TensorDictTarget({"a": torch.randn(4, 6, generator=g).to(torch.bfloat16), "b": torch.randn(10, generator=g)})


def _records(target: TensorDictTarget) -> list:
    """A dense record of "a" and a patch of "b" (indices 1, 7)."""
    b = target.tensors["b"].clone()
    b[[1, 7]] += 1.0
    return [Dense.of("a", target.tensors["a"].float().add(0.5).to(torch.bfloat16)),
            Patch(name="b", indices=PackedIndices.encode(torch.tensor([1, 7])), values=b[[1, 7]].clone(), checksum=checksum(b))]


def _state(target: TensorDictTarget) -> dict:
    return {n: t.clone() for n, t in target.tensors.items()}


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_prepare_writes_nothing_and_commit_keeps_the_version():
    target = _target()
    before = _state(target)
    receiver = WeightReceiver(target)
    session = receiver.session()
    session.start(1)
    session.add(_records(target))
    session.prepare()
    assert session.state == "prepared" and _bitwise_equal(_state(target), before)
    session.commit()
    assert session.state == "committed" and receiver.version == 0
    assert not _bitwise_equal(_state(target), before)
    assert session.publish().version == 1 and receiver.version == 1
    assert int(receiver.current_checksum("b")) == checksum(target.tensors["b"])


@pytest.mark.parametrize("dense_rollback", [True, False])
def test_rollback_after_commit_restores_the_weights(dense_rollback):
    target = _target()
    before = _state(target)
    receiver = WeightReceiver(target, dense_rollback=dense_rollback)
    receiver.current_checksum("b")  # cached: must still describe the weights after the rollback
    session = receiver.session()
    session.start(1)
    session.add(_records(target))
    session.prepare()
    session.commit()
    what = session.rollback()
    assert session.state == "failed" and receiver.version == 0
    assert torch.equal(target.tensors["b"], before["b"])  # patches always come back
    if dense_rollback:
        assert what == "weights restored" and _bitwise_equal(_state(target), before)
    else:
        assert "without a rollback copy" in what and not receiver.has_checksum("a")
    assert int(receiver.current_checksum("b")) == checksum(before["b"])
    receiver.apply(1, _records(target))  # the receiver is free again


def test_rollback_before_commit_and_misuse():
    target = _target()
    before = _state(target)
    receiver = WeightReceiver(target)
    session = receiver.session()
    with pytest.raises(WeightUpdateError, match="commit\\(\\) on a session that is new"):
        session.commit()
    session.start(1)
    session.add(_records(target))
    with pytest.raises(WeightUpdateError, match="publish\\(\\) on a session that is started"):
        session.publish()
    session.prepare()
    assert session.rollback() == "nothing written"
    assert _bitwise_equal(_state(target), before) and receiver.version == 0
    with pytest.raises(WeightUpdateError, match="commit\\(\\) on a session that is failed"):
        session.commit()


# ---- the two votes between ranks (two spawned ranks, no engine) ------------------------------------------
class DroppingTarget(TensorDictTarget):
    """Accepts dense writes and keeps the old values: only the read-back can notice."""

    def write_dense(self, name, tensor):
        pass

    def write_dense_many(self, pairs):
        pass


def _protocol_rank(rank: int, store: str, out: str) -> None:
    from runner.parallel.group import TPGroup

    tp = TPGroup(rank, 2, torch.device("cpu"), store, timeout_s=60)
    target = (DroppingTarget if rank == 1 else TensorDictTarget)(_target().tensors)
    before = _state(target)
    receiver = WeightReceiver(target, dense_rollback=True)
    with stage_bucket(_records(target)) as bucket:
        try:
            serve_rank_local(receiver, 1, bucket.handle, exchange=tp.all_gather_json)
            error = None
        except WeightUpdateError as e:
            error = str(e)
    with open(out, "w") as f:
        json.dump({"error": error, "unchanged": _bitwise_equal(_state(target), before), "version": receiver.version}, f)
    # leave at once, as a released engine rank does (runner/parallel/worker.py): tearing the interpreter down
    # while the peer's last gloo exchange is still closing its sockets can abort the process
    os._exit(0)


def test_a_peer_failing_after_writing_rolls_back_every_rank(tmp_path):
    """Rank 1's target drops its dense write, so rank 1 fails verification after rank 0 wrote and verified
    its dense and patch records: rank 0 must write both back."""
    results = run_ranks(_protocol_rank, tmp_path)
    for r in results:
        assert r["unchanged"] and r["version"] == 0
        assert "failed after writing: rank 1: verification after write failed for ['a']" in r["error"]
        assert "rank 0: weights restored" in r["error"]


# ---- an engine with 2 ranks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_tp(tp_model_dir, single_thread):
    engine = Engine(tp_config(tp_model_dir, tensor_parallel_size=2))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer(tp_model_dir, engine_tp):
    """The trainer's full weights (checkpoint names, float32) and a rank-local bridge that has pushed them."""
    weights = {n: t for n, t in load_file(os.path.join(tp_model_dir, "model.safetensors")).items() if n in engine_tp.weight_specs()}
    bridge = TrainerBridge(engine_tp, rank_local=True)
    assert bridge.adopt_engine_weights(weights) == len(weights)  # every rank's part checked by checksum
    return weights, bridge


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _held(engine) -> tuple[list[dict], dict]:
    """Every rank's checksums of its parts, and rank 0's parts themselves."""
    rank0 = engine.runner.weights
    return engine.rank_local_checksums(), {n: rank0.view(n).clone() for n in rank0.layout}


def _assert_holds(engine, weights: dict) -> None:
    """Every rank's parts are the trainer's: rank 0 bitwise, every rank by checksum."""
    sums, rank0 = _held(engine)
    for rank, layout in enumerate(engine.rank_local_layouts()):
        parts = shard_weights(weights, layout)
        assert sums[rank] == {n: checksum(p) for n, p in parts.items()}, rank
        if rank == 0:
            assert _bitwise_equal(rank0, {n: p.contiguous() for n, p in parts.items()})


def _step(weights: dict, seed: int, frac: float) -> dict:
    """New trainer weights: a random `frac` of each tensor's elements moved by 0.05 * N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        moved = torch.rand(t.shape, generator=g) < frac
        out[name] = torch.where(moved, t + 0.05 * torch.randn(t.shape, generator=g), t)
    return out


def test_rank_local_dense_and_patch_pushes_are_exact(engine_tp, trainer, tp_model_dir, tmp_path, monkeypatch):
    weights, bridge = trainer
    before_shm = set(os.listdir(SHM_DIR))
    messages = []
    tp = engine_tp.runner.tp  # rank 0's group: every control message of the push passes here

    def recording(method):
        def call(obj=None):
            messages.append(obj)
            return method(obj)
        return call

    monkeypatch.setattr(tp, "broadcast_json", recording(tp.broadcast_json))
    monkeypatch.setattr(tp, "all_gather_json", recording(tp.all_gather_json))
    monkeypatch.setattr(tp, "broadcast_host_tensor", lambda x: pytest.fail("tensor data broadcast from rank 0"))

    version = engine_tp.policy_version
    weights = _step(weights, seed=1, frac=1.0)  # every element: dense everywhere
    dense = bridge.push_weights(weights)
    assert dense.num_patch == 0 and dense.num_dense > 0 and dense.version == version + 1
    _assert_holds(engine_tp, weights)
    weights = _step(weights, seed=2, frac=0.03)  # a few elements: patches
    patch = bridge.push_weights(weights)
    assert patch.num_dense == 0 and patch.num_patch == dense.num_dense and patch.version == version + 2
    _assert_holds(engine_tp, weights)
    assert set(os.listdir(SHM_DIR)) <= before_shm  # every segment was unlinked

    pushes = [m for m in messages if isinstance(m, dict) and m.get("method") == "weight_sync.apply_rank_local"]
    assert len(pushes) == 2
    for m in messages:  # plain JSON, no tensor data: a path per rank, and the votes
        assert json.loads(json.dumps(m)) == m
    for m in pushes:
        handles = decode(m["args"])[1]
        assert not m["tensors"] and [set(h) for h in handles] == [{"kind", "path"}] * 2 and len(json.dumps(m)) < 1000
    assert patch.nbytes > 1000 and dense.nbytes > 100 * max(len(json.dumps(m)) for m in messages)
    monkeypatch.undo()

    # a fresh engine loaded from the updated checkpoint computes the same
    updated = tmp_path / "updated"
    shutil.copytree(tp_model_dir, updated)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(updated / "model.safetensors"))
    with Engine(tp_config(updated, tensor_parallel_size=2)) as fresh:
        assert _tokens(fresh.generate(PROMPTS, GREEDY)) == _tokens(engine_tp.generate(PROMPTS, GREEDY))
        fresh.step(), engine_tp.step()  # an empty step frees the finished requests' runner slots
        assert torch.equal(fresh.collective_rpc("full_sequence_logits", IDS)[0], engine_tp.collective_rpc("full_sequence_logits", IDS)[0])


def _corrupt(kind: str, part: torch.Tensor, full: torch.Tensor, name: str):
    if kind == "checksum":
        return Dense(name=name, tensor=part, checksum=checksum(part) + 1)
    if kind == "bounds":
        idx = torch.tensor([0, part.numel()])  # one past the end of the part (inside the full tensor)
        return Patch(name=name, indices=PackedIndices.encode(idx), values=part.reshape(-1)[:2].clone(), checksum=0)
    assert kind == "shape"
    return Dense.of(name, full.contiguous())  # the full tensor instead of the rank's part


@pytest.mark.parametrize("kind,message", [("checksum", "checksum mismatch"), ("bounds", "out of bounds"),
                                          ("shape", "!= checkpoint shape")])
@pytest.mark.parametrize("name", [ROW_SHARDED, COL_SHARDED])
def test_a_corrupt_part_on_rank_1_changes_no_rank(engine_tp, trainer, kind, message, name):
    weights, _ = trainer
    layouts = engine_tp.rank_local_layouts()
    new = _step({name: weights[name]}, seed=3, frac=1.0)
    parts = [shard_weights(new, layout)[name] for layout in layouts]
    records = [[Dense.of(name, parts[0].contiguous())], [_corrupt(kind, parts[1].contiguous(), new[name], name)]]
    version = engine_tp.policy_version
    held = _held(engine_tp)
    tokens = _tokens(engine_tp.generate(PROMPTS, GREEDY))
    buckets = [stage_bucket(r) for r in records]
    try:
        with pytest.raises(WeightUpdateError, match=f"nothing written on any rank: rank 1: .*{message}") as err:
            engine_tp.update_weights_rank_local(version + 1, [b.handle for b in buckets])
    finally:
        for b in buckets:
            b.close()
    assert "rank 0:" not in str(err.value) and name in str(err.value)
    assert engine_tp.policy_version == version
    sums, rank0 = _held(engine_tp)
    assert sums == held[0] and _bitwise_equal(rank0, held[1])
    assert _tokens(engine_tp.generate(PROMPTS, GREEDY)) == tokens  # still serving, the same weights


def test_bad_handles_are_refused(engine_tp):
    version = engine_tp.policy_version
    with pytest.raises(ValueError, match="1 handles for tensor_parallel_size=2"):
        engine_tp.update_weights_rank_local(version + 1, [{"kind": "shm", "path": "/dev/shm/x"}])
    with pytest.raises(WeightUpdateError, match="rank 0: refusing to map '/etc/passwd'.*rank 1: cannot map"):
        engine_tp.update_weights_rank_local(version + 1, [{"kind": "shm", "path": "/etc/passwd"},
                                                          {"kind": "shm", "path": os.path.join(SHM_DIR, "weight-update-missing")}])
    assert engine_tp.policy_version == version


def test_every_rank_must_update_the_same_tensors(engine_tp, trainer):
    weights, _ = trainer
    layouts = engine_tp.rank_local_layouts()
    version = engine_tp.policy_version
    records = [[Dense.of(name, shard_weights({name: weights[name] + 1}, layout)[name].contiguous())]
               for name, layout in zip((ROW_SHARDED, COL_SHARDED), layouts)]
    held = _held(engine_tp)
    buckets = [stage_bucket(r) for r in records]
    try:
        with pytest.raises(WeightUpdateError, match="rank 1: its records name other tensors than rank 0's"):
            engine_tp.update_weights_rank_local(version + 1, [b.handle for b in buckets])
    finally:
        for b in buckets:
            b.close()
    sums, rank0 = _held(engine_tp)
    assert engine_tp.policy_version == version and sums == held[0] and _bitwise_equal(rank0, held[1])


def test_single_rank_engine_takes_the_same_path(tp_model_dir, single_thread):
    with Engine(tp_config(tp_model_dir)) as engine:
        weights = {n: t for n, t in load_file(os.path.join(tp_model_dir, "model.safetensors")).items() if n in engine.weight_specs()}
        bridge = TrainerBridge(engine, rank_local=True)
        for seed, frac in ((1, 1.0), (2, 0.03)):
            weights = _step(weights, seed, frac)
            bridge.push_weights(weights)
            _assert_holds_single(engine, weights)
        assert engine.policy_version == 2


def _assert_holds_single(engine, weights: dict) -> None:
    held = engine.runner.weights
    assert _bitwise_equal({n: held.view(n).clone() for n in weights}, weights)


# ---- an IPC push of full checkpoint tensors into a TP engine ---------------------------------------------
def _ipc_push(sink, version: int, records: list):
    """One IPC session from a sender thread into ``sink``: (the receiver's result or its error, what the sender
    got: its SendResult or its error's text)."""
    trainer_end, rollout_end = mp.Pipe()
    sent = []

    def send():
        try:
            sent.append(IpcSender(trainer_end, bucket_bytes=4096, timeout_s=60).send(version, records))
        except WeightUpdateError as e:
            sent.append(str(e))

    thread = threading.Thread(target=send)
    thread.start()
    try:
        received = IpcReceiver(rollout_end, sink, timeout_s=60).serve_one(start_timeout_s=60)
    except WeightUpdateError as e:
        received = e
    thread.join(60)
    return received, sent[0]


def test_an_ipc_push_into_a_tp_engine_applies_on_every_rank_and_publishes_once(tp_model_dir, single_thread, monkeypatch):
    """The receiver writes into `engine.weight_sink()` and nothing else is called: rank 0 checks the records,
    every rank validates and writes its shard, and the version moves once. A corrupt push changes no rank."""
    with Engine(tp_config(tp_model_dir)) as single:
        records = update_records(single.runner.weights)  # dense records and patches, full checkpoint coordinates
        single.apply_weight_update(1, records)
        expected = _tokens(single.generate(PROMPTS, GREEDY))
    last = records[-1]
    assert isinstance(last, Patch)
    corrupt = records[:-1] + [Patch(name=last.name, indices=last.indices, values=last.values, checksum=last.checksum + 1)]
    with Engine(tp_config(tp_model_dir, tensor_parallel_size=2)) as engine:
        published = []
        plain = engine.scheduler.on_weights_updated
        monkeypatch.setattr(engine.scheduler, "on_weights_updated", lambda version: (published.append(version), plain(version)))
        before, held = _tokens(engine.generate(PROMPTS, GREEDY)), _held(engine)
        assert before != expected

        received, sent = _ipc_push(engine.weight_sink(), 1, corrupt)
        assert isinstance(received, WeightUpdateError) and "checksum mismatch" in str(received)
        assert sent.startswith("receiver rejected version 1:") and "checksum mismatch" in sent
        sums, rank0 = _held(engine)
        assert engine.policy_version == 0 and published == [] and sums == held[0] and _bitwise_equal(rank0, held[1])

        received, sent = _ipc_push(engine.weight_sink(), 1, records)
        assert received.version == 1 == engine.policy_version and published == [1]
        assert sent.received == (received,) and (sent.num_dense, sent.num_patch) == (received.num_dense, received.num_patch)
        assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected
        received, _ = _ipc_push(engine.weight_sink(), 1, records)  # the same version again is refused
        assert "version must be an int > the current version 1" in str(received) and published == [1]
