"""Async scheduling (step t+1 scheduled and staged while step t runs) gives exactly the synchronous results."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model(ckpt_factory):
    return ckpt_factory("qwen3", seed=31)


def _run(model, async_scheduling, **kw):
    engine = Engine(EngineConfig(model=str(model), dtype="float32", deterministic=True,
                                 async_scheduling=async_scheduling, **kw))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (3, 21, 9, 40, 5, 16)]
    params = [
        SamplingParams(n=3, max_tokens=12, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=30, seed=2, stop_token_ids=[7, 11, 13, 17, 19, 23]),  # stops early, at random
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(n=2, max_tokens=25, seed=4, top_p=0.9, min_tokens=3, stop_token_ids=[5, 6]),
        SamplingParams(max_tokens=1, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=200, seed=6, ignore_eos=True),  # runs into max_model_len
    ]
    outs = engine.generate(prompts, params)
    return engine, [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_seqs=16, num_kv_blocks=64, max_model_len=64),
    dict(max_num_seqs=4, num_kv_blocks=10, block_size=8, max_num_batched_tokens=12, max_model_len=64),  # chunks, preemption
])
def test_async_equals_sync(model, engine_kw):
    sync_engine, expected = _run(model, False, **engine_kw)
    async_engine, got = _run(model, True, **engine_kw)
    assert got == expected
    assert any(reason == "stop" for out in got for _, _, reason in out)
    assert any(len(toks) == 64 - 16 for out in got for toks, _, _ in out)  # the request capped by max_model_len
    if engine_kw["max_num_seqs"] == 4:
        assert async_engine.scheduler.stats.num_preemptions > 0
    for engine in (sync_engine, async_engine):
        assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_used_blocks == 0
        engine.step()  # an empty step hands the last finished ids to the runner
        assert not engine.runner.input_batch.slot_of  # every slot was released


def test_async_weight_update_drains_the_step_in_flight(model):
    engine = Engine(EngineConfig(model=str(model), dtype="float32", async_scheduling=True, num_kv_blocks=64))
    rid = engine.add_request([3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True, seed=0))
    for _ in range(5):
        engine.step()
    assert engine._inflight is not None
    specs = engine.weight_specs()
    from weight_updates import Dense

    name = "model.norm.weight"
    engine.apply_weight_update(1, [Dense.of(name, engine.runner.weights.view(name).clone())])
    assert engine._inflight is None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out.outputs[0]
    versions = final.policy_versions
    assert len(versions) == 20 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    assert name in specs


def test_async_scheduling_default_and_errors():
    from rollout import SpeculativeConfig

    assert EngineConfig(model="m", device="cuda").async_scheduling is True  # on by default where supported
    assert EngineConfig(model="m").async_scheduling is False  # the CPU has nothing to overlap
    assert EngineConfig(model="m", device="cuda", speculative=SpeculativeConfig()).async_scheduling is False
    assert EngineConfig(model="m", device="cuda", tensor_parallel_size=2).async_scheduling is False  # opt-in there
    assert EngineConfig(model="m", device="cuda", tensor_parallel_size=2, async_scheduling=True).async_scheduling
    assert EngineConfig(model="m", async_scheduling=False).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="m", async_scheduling=True, speculative=SpeculativeConfig())


def test_step_reports_requests_finished_during_a_drain(model):
    from weight_updates import Dense

    engine = Engine(EngineConfig(model=str(model), dtype="float32", async_scheduling=True, num_kv_blocks=64))
    ids = [engine.add_request([3, 4, 5 + i], SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True, seed=i))
           for i in range(4)]
    name = "model.norm.weight"
    finished: dict[str, int] = {}
    version = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
        version += 1  # an update after every step: each one drains the step in flight
        engine.apply_weight_update(version, [Dense.of(name, engine.runner.weights.view(name).clone())])
    assert finished == {rid: 2 + 3 * i for i, rid in enumerate(ids)}
