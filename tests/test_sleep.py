"""Engine.sleep / wake_up: the KV cache (level 1) and the weights (level 2) are freed between rollout batches
and come back so that generation continues exactly as before; requests and weight updates are refused
with a clear error while what they need is freed. CPU; the GPU memory figures are in test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from conftest import tp_config, update_records
from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22], [5, 6]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5, logprobs=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tp_model_dir):
    return tp_model_dir  # Qwen2 (attention biases): the names update_records moves


def make_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=8, num_kv_blocks=64, block_size=16, **kw))


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def weights_of(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: engine.runner.weights.view(n).clone() for n in engine.weight_specs()}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_cache_and_wake_up_continues_exactly(model_dir, level):
    engine = make_engine(model_dir)
    before = engine.generate(PROMPTS, SAMPLED)
    weights = weights_of(engine)
    engine.sleep(level)
    assert engine.is_sleeping and engine.runner.kv_caches == []
    assert all(layer.self_attn.k_cache is None for layer in engine.runner.model.model.layers)
    engine.wake_up()
    assert not engine.is_sleeping and len(engine.runner.kv_caches) == engine.model_config.num_layers
    assert all(torch.equal(w, engine.runner.weights.view(n)) for n, w in weights.items())
    after = engine.generate(PROMPTS, SAMPLED)
    assert tokens(after) == tokens(before)
    assert [c.logprobs for o in after for c in o.outputs] == [c.logprobs for o in before for c in o.outputs]
    # the prefix cache was emptied with the KV cache: nothing computed before sleeping is reused
    assert [o.num_cached_prompt_tokens for o in after] == [o.num_cached_prompt_tokens for o in before]


def test_level_2_moves_the_weights_off_their_storage_and_back(model_dir):
    engine = make_engine(model_dir)
    name = next(iter(engine.weight_specs()))
    param = engine.runner.weights._params[engine.runner.weights.layout[name].param]
    storage = param.data.data_ptr()
    engine.sleep(2)
    assert param.data.data_ptr() != storage  # the parameter now holds the host copy
    engine.wake_up(["weights"])
    assert engine.is_sleeping  # the KV cache is still freed
    with pytest.raises(ValueError, match="sleeps"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping


def test_requests_are_refused_while_asleep_and_sleep_needs_an_idle_engine(model_dir):
    engine = make_engine(model_dir)
    engine.add_request(PROMPTS[0], GREEDY, request_id="busy")
    with pytest.raises(ValueError, match="unfinished requests"):
        engine.sleep()
    engine.abort_request("busy")
    engine.step()  # the abort is applied by the next step
    engine.sleep()
    for call in (lambda: engine.generate(PROMPTS, GREEDY), lambda: engine.add_request(PROMPTS[0], GREEDY), engine.step):
        with pytest.raises(ValueError, match="while the engine sleeps"):
            call()
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="already asleep at level 1"):
        engine.sleep(2)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        engine.wake_up(["cache"])
    engine.wake_up()
    assert len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)


def test_weight_updates_while_asleep(model_dir):
    """Level 1 keeps the weights on the device: an update applies while asleep and generation after
    wake_up equals that of an engine that took the same update awake. Level 2 refuses updates until the
    weights are woken; then the update applies before the KV cache comes back."""
    awake = make_engine(model_dir)
    records = update_records(awake.runner.weights)
    awake.apply_weight_update(1, records)
    expected = tokens(awake.generate(PROMPTS, SAMPLED))

    light = make_engine(model_dir)
    light.sleep(1)
    light.apply_weight_update(1, records)
    light.wake_up()
    assert light.policy_version == 1 and tokens(light.generate(PROMPTS, SAMPLED)) == expected

    deep = make_engine(model_dir)
    deep.sleep(2)
    with pytest.raises(ValueError, match="weights are freed"):
        deep.apply_weight_update(1, records)
    assert deep.policy_version == 0
    with pytest.raises(ValueError, match="wake 'weights' first"):
        deep.wake_up(["kv_cache"])
    deep.wake_up(["weights"])
    deep.apply_weight_update(1, records)
    deep.wake_up(["kv_cache"])
    assert tokens(deep.generate(PROMPTS, SAMPLED)) == expected


def test_speculative_engine_sleeps_with_its_drafter(model_dir):
    engine = make_engine(model_dir, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    before = engine.generate(PROMPTS, GREEDY)
    drafter = {n: p.clone() for n, p in engine.runner.spec.drafter.named_parameters()}
    engine.sleep(2)
    assert engine.runner.spec.kv_cache == (None, None)
    engine.wake_up()
    assert all(torch.equal(p, drafter[n]) for n, p in engine.runner.spec.drafter.named_parameters())
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(before)


def rank_holds(runner) -> dict:
    """What this rank holds: whether it has its KV cache, and where its parameters' data lives."""
    return {"kv_cache": bool(runner.kv_caches), "data_ptrs": [p.data.data_ptr() for p in runner.model.parameters()]}


def test_tensor_parallel_engine_sleeps_on_every_rank(tp_model_dir, single_thread):
    with Engine(tp_config(tp_model_dir, tensor_parallel_size=2)) as engine:
        before = engine.generate(PROMPTS, SAMPLED)
        awake = engine.collective_rpc("test_sleep:rank_holds")
        engine.sleep(2)
        asleep = engine.collective_rpc("test_sleep:rank_holds")
        assert [a["kv_cache"] for a in awake] == [True, True] and [a["kv_cache"] for a in asleep] == [False, False]
        for a, s in zip(awake, asleep):  # every rank moved every parameter (a new host copy)
            assert all(x != y for x, y in zip(a["data_ptrs"], s["data_ptrs"]))
        engine.wake_up()
        assert [a["kv_cache"] for a in engine.collective_rpc("test_sleep:rank_holds")] == [True, True]
        assert tokens(engine.generate(PROMPTS, SAMPLED)) == tokens(before)


def test_wake_up_out_of_memory_leaves_the_engine_asleep_and_retry_works(model_dir, monkeypatch):
    from runner.model_runner import ModelRunner

    engine = make_engine(model_dir)
    before = tokens(engine.generate(PROMPTS, SAMPLED))
    engine.sleep(2)
    allocate = ModelRunner.allocate_kv_cache

    def no_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", no_memory)
    with pytest.raises(ValueError, match="not enough device memory for the KV cache"):
        engine.wake_up()
    assert engine.is_sleeping and engine.runner.kv_caches == []  # the weights woke; the cache did not
    with pytest.raises(ValueError, match="while the engine sleeps"):
        engine.generate(PROMPTS, SAMPLED)
    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", allocate)
    engine.wake_up()
    assert tokens(engine.generate(PROMPTS, SAMPLED)) == before


def test_close_frees_weights_caches_and_drafter_at_once(model_dir):
    """close() leaves nothing alive that holds device memory: not the KV caches, not the drafter (its weights
    and cache), not the weights, even after a weight update made the engine's sink (whose receiver reaches
    the weights) — so a trainer can take the memory right away, without waiting for a garbage collection."""
    import gc
    import weakref

    from weight_updates import Dense

    engine = make_engine(model_dir, speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=2))
    engine.generate(PROMPTS, GREEDY)
    engine.apply_weight_update(1, [Dense.of(r.name, r.tensor.clone()) for r in engine.export_weights()])
    runner = engine.runner  # a caller may still hold the runner: what it held must go anyway
    held = [weakref.ref(x) for x in (next(runner.model.parameters()), runner.kv_caches[0][0],
                                     next(runner.spec.drafter.parameters()), runner.spec.kv_cache[0])]
    gc.disable()  # what close() frees must not wait for an automatic collection
    try:
        engine.close()
        assert [h() is None for h in held] == [True] * len(held)
    finally:
        gc.enable()
