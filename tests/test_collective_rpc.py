"""One collective RPC for every call that must run on every rank: results in rank order, one error naming
the failing ranks, and an engine that keeps working afterwards (gloo tensor parallelism on the CPU).

The functions below are what the tests send: `collective_rpc("test_collective_rpc:fn", ...)` runs
fn(runner, ...) on every rank, the worker ranks importing this module by name.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tp_config
from rollout import Engine, SamplingParams
from runner.parallel.rpc import decode, encode, rank_error
from weight_updates import Dense, PackedIndices, Patch, WeightUpdateError

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 4, 5], [9, 8]]


def rank_and_tensor(runner, scale: float):
    rank = 0 if runner.tp is None else runner.tp.rank
    return {"rank": rank, "values": torch.arange(3, dtype=torch.bfloat16) * scale * (rank + 1)}


def raise_on(runner, rank: int, kind: str):
    if (0 if runner.tp is None else runner.tp.rank) == rank:
        raise {"value": ValueError("bad value on purpose"), "update": WeightUpdateError("bad record on purpose"),
               "other": KeyError("missing on purpose")}[kind]
    return "fine"


def fail_next_kv_allocation(runner, rank: int):
    """On `rank`, the next KV-cache allocation runs out of memory (once)."""
    if runner.tp.rank != rank:
        return
    allocate = runner.allocate_kv_cache

    def out_of_memory(*args, **kwargs):
        runner.allocate_kv_cache = allocate
        raise torch.OutOfMemoryError("CUDA out of memory (on purpose)")

    runner.allocate_kv_cache = out_of_memory


def holds_kv_cache(runner) -> bool:
    return bool(runner.kv_caches)


@pytest.fixture(scope="module")
def engine_tp(tp_model_dir, single_thread):
    with Engine(tp_config(tp_model_dir, tensor_parallel_size=2)) as engine:
        yield engine


def _tokens(engine) -> list:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, PARAMS)]


def test_results_come_back_from_every_rank_in_rank_order(engine_tp):
    results = engine_tp.collective_rpc("test_collective_rpc:rank_and_tensor", 0.5)
    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert r["values"].dtype == torch.bfloat16
        assert torch.equal(r["values"], torch.arange(3, dtype=torch.bfloat16) * 0.5 * (rank + 1))
    assert engine_tp.collective_rpc("test_collective_rpc:holds_kv_cache") == [True, True]


@pytest.mark.parametrize("kind, error", [("value", ValueError), ("update", WeightUpdateError), ("other", KeyError)])
def test_failure_on_rank_1_names_the_rank_and_the_engine_goes_on(engine_tp, kind, error):
    before = _tokens(engine_tp)
    with pytest.raises(error) as info:
        engine_tp.collective_rpc("test_collective_rpc:raise_on", 1, kind)
    message = str(info.value)
    assert "rank 1" in message and "on purpose" in message and "rank 0:" not in message
    assert set(info.value.rank_errors) == {1}
    assert engine_tp.collective_rpc("test_collective_rpc:raise_on", 5, kind) == ["fine", "fine"]
    assert _tokens(engine_tp) == before  # every rank took the next calls and steps together


def test_out_of_memory_in_wake_up_on_one_rank_leaves_every_rank_asleep(engine_tp):
    before = _tokens(engine_tp)
    engine_tp.sleep(1)
    engine_tp.collective_rpc("test_collective_rpc:fail_next_kv_allocation", 1)
    with pytest.raises(ValueError, match="not enough device memory for the KV cache.*rank 1"):
        engine_tp.wake_up()
    assert engine_tp.is_sleeping
    assert engine_tp.collective_rpc("test_collective_rpc:holds_kv_cache") == [False, False]  # rank 0's freed again
    with pytest.raises(ValueError, match="sleeps"):
        engine_tp.generate(PROMPTS, PARAMS)
    engine_tp.wake_up()
    assert not engine_tp.is_sleeping
    assert _tokens(engine_tp) == before


def test_unknown_and_private_methods_are_refused_on_every_rank(engine_tp):
    with pytest.raises(RuntimeError, match="no_such_method") as info:  # an AttributeError, rebuilt as RuntimeError
        engine_tp.collective_rpc("no_such_method")
    assert set(info.value.rank_errors) == {0, 1}
    with pytest.raises(ValueError, match="private"):
        engine_tp.collective_rpc("_drop_kv_cache")
    assert engine_tp.collective_rpc("test_collective_rpc:raise_on", 5, "value") == ["fine", "fine"]


def test_single_process_raises_the_runner_error_itself(tp_model_dir):
    with Engine(tp_config(tp_model_dir)) as engine:
        assert engine.collective_rpc("test_collective_rpc:raise_on", 1, "value") == ["fine"]
        with pytest.raises(ValueError, match="^bad value on purpose$"):
            engine.collective_rpc("test_collective_rpc:raise_on", 0, "value")


def test_records_round_trip_through_the_codec():
    dense = Dense(name="a.weight", tensor=torch.randn(3, 4, dtype=torch.bfloat16), checksum=-7)
    patch = Patch(name="b.weight", indices=PackedIndices(gaps=torch.tensor([1, 3], dtype=torch.uint8),
                                                         overflow=torch.zeros(0, dtype=torch.int32)),
                  values=torch.tensor([5, -2], dtype=torch.int8), checksum=11, escapes=torch.zeros(0, dtype=torch.bfloat16))
    tensors: list[torch.Tensor] = []
    data = encode([7, [dense, patch], {"k": (1, 2)}], tensors)
    assert len(tensors) == 5 and all(t.device.type == "cpu" for t in tensors)
    version, (d, p), extra = decode(data, [t.clone() for t in tensors])
    assert version == 7 and extra == {"k": [1, 2]}
    assert d.name == dense.name and d.checksum == -7 and torch.equal(d.tensor, dense.tensor)
    assert torch.equal(p.indices.gaps, patch.indices.gaps) and torch.equal(p.values, patch.values) and p.escapes.numel() == 0
    # inline (results): tensors as values
    back = decode(encode({"t": torch.tensor([[1.5, 2.0]], dtype=torch.float16)}))
    assert back["t"].dtype == torch.float16 and back["t"].tolist() == [[1.5, 2.0]]


def test_codec_refuses_what_cannot_cross_ranks():
    import dataclasses

    @dataclasses.dataclass
    class Foreign:
        x: int

    with pytest.raises(AssertionError, match="cannot cross ranks"):
        encode(Foreign(1))
    with pytest.raises(TypeError, match="cannot hold"):
        encode(object())
    with pytest.raises(AssertionError):
        decode({"__dataclass__": "os:PathLike", "fields": {}})


def test_rank_error_keeps_the_first_failing_type_and_names_each_rank():
    e = rank_error("m", [None, {"type": "OutOfMemoryError", "message": "oom"}, {"type": "Weird", "message": "w"}])
    assert isinstance(e, torch.OutOfMemoryError)
    assert str(e) == "m failed on rank 1, 2 of 3 (rank 1: OutOfMemoryError: oom; rank 2: Weird: w)"
    same = rank_error("m", [{"type": "ValueError", "message": "v"}] * 2)
    assert type(same) is ValueError and str(same) == "v" and set(same.rank_errors) == {0, 1}


# ---- weight updates staged on every rank ------------------------------------------------------------------
def drop_dense_writes_on(runner, rank: int) -> None:
    """On `rank`, dense writes go nowhere (a faulty device): that rank fails verification after writing."""
    if runner.tp.rank == rank:
        runner.weights.write_dense_many = lambda pairs: None


def restore_dense_writes(runner) -> None:
    runner.weights.__dict__.pop("write_dense_many", None)


def _moved(engine, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [Dense.of(r.name, r.tensor + 0.01 * torch.randn(r.tensor.shape, generator=g).to(r.tensor.dtype))
            for r in engine.export_weights()]


def test_export_weights_gathers_full_tensors_from_every_rank(engine_tp, tp_model_dir):
    with Engine(tp_config(tp_model_dir)) as single:
        want = {r.name: r.tensor.clone() for r in single.export_weights()}
    got = {r.name: r.tensor for r in engine_tp.export_weights()}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_staged_update_is_dropped_and_restored_on_every_rank(engine_tp):
    sums, version, before = engine_tp.rank_local_checksums(), engine_tp.policy_version, _tokens(engine_tp)
    engine_tp.prepare_weight_update(version + 1, _moved(engine_tp, 1))
    engine_tp.commit_weight_update()
    assert engine_tp.rank_local_checksums() != sums  # written on every rank
    assert "restored" in engine_tp.drop_weight_update()
    assert engine_tp.rank_local_checksums() == sums and engine_tp.policy_version == version
    assert _tokens(engine_tp) == before


def test_a_commit_whose_writes_fail_on_rank_1_alone_rolls_back_every_rank(engine_tp):
    """Rank 1's dense writes go nowhere. Verification reads full tensors (every rank's shards, gathered), so
    each rank sees the tensors rank 1 left unwritten and restores its own part."""
    sums, version, before = engine_tp.rank_local_checksums(), engine_tp.policy_version, _tokens(engine_tp)
    engine_tp.collective_rpc("test_collective_rpc:drop_dense_writes_on", 1)
    try:
        engine_tp.prepare_weight_update(version + 1, _moved(engine_tp, 2))
        with pytest.raises(WeightUpdateError, match="rank 1") as info:
            engine_tp.commit_weight_update()
        assert all("did not hold the sent bits" in e for e in info.value.rank_errors.values())
    finally:
        engine_tp.collective_rpc("test_collective_rpc:restore_dense_writes")
    assert engine_tp.rank_local_checksums() == sums and engine_tp.policy_version == version
    assert _tokens(engine_tp) == before
    result = engine_tp.apply_weight_update(version + 1, _moved(engine_tp, 3))  # the next update goes through
    assert result.version == engine_tp.policy_version == version + 1
