"""RolloutPool on Ray (2 CPU workers): seeded parity with a local engine, weight pushes, sleep / wake_up,
a dead worker.

One combined test, because Ray start-up (~6 s) and each actor (~4 s) dominate the cost.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import EngineConfig, SamplingParams
from rollout.engine import Engine
from trainer_bridge import TrainerBridge, TrainingModel, toy_task

PROMPTS = [f"{a}+{b}=" for a, b in [(1, 2), (34, 5), (7, 80), (99, 99), (12, 21), (5, 5), (60, 7)]]


def _streams(batch):
    return [(s.token_ids, s.policy_versions) for s in batch.samples]


def test_pool_matches_local_engine_and_loses_no_sample_when_a_worker_dies(tmp_path):
    ray = pytest.importorskip("ray")
    from rollout.pool import PoolConfig, RolloutPool, WorkerResources

    torch.set_num_threads(1)
    model_dir = toy_task.write_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0)
    cfg = PoolConfig(model=str(model_dir), num_workers=2, resources=WorkerResources(num_cpus=1),
                     engine={"dtype": "float32", "max_num_seqs": 64, "num_kv_blocks": 128})
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    pool = None
    try:
        pool = RolloutPool(cfg)
        local = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=64, num_kv_blocks=128))
        local_bridge, pool_bridge = TrainerBridge(local), TrainerBridge(pool)
        assert pool_bridge.specs == local_bridge.specs
        params = SamplingParams(n=3, max_tokens=8, seed=7)

        a, b = local_bridge.rollout(PROMPTS, params), pool_bridge.rollout(PROMPTS, params)
        assert _streams(a) == _streams(b)
        for x, y in zip(a.samples, b.samples):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)

        # the same pushes reach both: a dense one, then a patch; versions and samples stay equal
        model = TrainingModel.from_pretrained(model_dir)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        for bridge in (local_bridge, pool_bridge):
            bridge.push_weights(model)
        with torch.no_grad():
            model.checkpoint_state()["lm_head.weight"].view(-1)[:50] += 0.5
        pushes = [bridge.push_weights(model) for bridge in (local_bridge, pool_bridge)]
        assert [p.version for p in pushes] == [2, 2] and pushes[1].num_patch >= 1
        a2, b2 = local_bridge.rollout(PROMPTS, params), pool_bridge.rollout(PROMPTS, params)
        assert _streams(a2) == _streams(b2) and _streams(a2) != _streams(a)
        assert all(v == 2 for s in b2.samples for v in s.policy_versions[s.num_prompt_tokens:])

        # sleeping between batches: every worker frees its KV cache, refuses work, and comes back exact
        pool.sleep(1)
        with pytest.raises(ValueError, match="while the engine sleeps"):
            pool.generate(PROMPTS[:1], params)
        pool.wake_up()
        assert _streams(pool_bridge.rollout(PROMPTS, params)) == _streams(a2)

        # kill worker 0 while its shard is in flight: the shard is re-run, the worker restarted
        per_prompt = [dataclasses.replace(params, seed=params.seed + i) for i in range(len(PROMPTS))]
        pending = pool.submit(PROMPTS, per_prompt)
        ray.kill(pool.workers[0], no_restart=True)
        outs = pool.collect(pending)
        assert pool.num_restarts == [1, 0]
        assert [c.token_ids for o in outs for c in o.outputs] == [s.completion_ids for s in a2.samples]
        # the restarted worker holds the pushed weights (version 2) and serves shard 0 again
        b3 = pool_bridge.rollout(PROMPTS, params)
        assert _streams(b3) == _streams(a2)
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
