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
    """A push while a step is in flight lands between steps: the tokens up to and including the one in flight
    are the old weights' and carry version 0, every later one is the new weights' and carries version 1. The
    push replaces the final norm and the LM head only, so the KV cache of the earlier tokens is the same under
    both weights and a fresh engine holding the new ones, given the prompt and the old tokens, must continue
    with exactly the pushed engine's tokens and logprobs."""
    from weight_updates import Dense

    kw = dict(model=str(model), dtype="float32", num_kv_blocks=64)
    prompt, n = [3, 4, 5], 20
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine = Engine(EngineConfig(async_scheduling=True, **kw))
    specs = engine.weight_specs()
    g = torch.Generator().manual_seed(0)
    update = [Dense.of("model.norm.weight", 1 + 0.5 * torch.randn(specs["model.norm.weight"].shape, generator=g)),
              Dense.of("lm_head.weight", 0.2 * torch.randn(specs["lm_head.weight"].shape, generator=g))]
    rid = engine.add_request(prompt, greedy)
    for _ in range(5):
        engine.step()
    assert engine._inflight is not None
    engine.apply_weight_update(1, update)
    assert engine._inflight is None and engine.policy_version == 1
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out.outputs[0]
    m = final.policy_versions.count(0)  # tokens sampled before the push, the one in flight included
    assert 0 < m < n and final.policy_versions == [0] * m + [1] * (n - m)

    old = Engine(EngineConfig(**kw)).generate([prompt], greedy)[0].outputs[0]
    fresh = Engine(EngineConfig(**kw))
    fresh.apply_weight_update(1, update)  # before any request: an engine holding the new weights
    cont = fresh.generate([prompt + final.token_ids[:m]],
                          SamplingParams(temperature=0, max_tokens=n - m, ignore_eos=True))[0].outputs[0]
    assert final.token_ids[:m] == old.token_ids[:m] and final.token_ids[m:] == cont.token_ids
    assert torch.allclose(torch.tensor(final.logprobs), torch.tensor(old.logprobs[:m] + cont.logprobs), atol=1e-4)
    # the push changed the distribution of every later token (an update that had not landed would not)
    assert all(abs(a - b) > 1e-3 for a, b in zip(final.logprobs[m:], old.logprobs[m:]))


def test_async_scheduling_default_and_errors():
    from rollout import SpeculativeConfig

    assert EngineConfig(model="m", device="cuda").async_scheduling is True  # on by default where supported
    assert EngineConfig(model="m").async_scheduling is False  # the CPU has nothing to overlap
    assert EngineConfig(model="m", device="cuda", speculative=SpeculativeConfig()).async_scheduling is False
    assert EngineConfig(model="m", device="cuda", tensor_parallel_size=2).async_scheduling is True  # every rank too
    assert not EngineConfig(model="m", device="cuda", tensor_parallel_size=2, async_scheduling=False).async_scheduling
    assert EngineConfig(model="m", tensor_parallel_size=2).async_scheduling is False  # gloo ranks on the CPU
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
