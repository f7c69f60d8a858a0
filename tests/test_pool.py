"""RolloutPool on Ray (2 CPU workers): seeded parity with a local engine, weight pushes, sleep / wake_up,
a dead worker, a push that one worker alone refuses. One combined test, because Ray start-up (~6 s) and
each actor (~4 s) dominate the cost.

The pool's two-phase push (`commit_on_all` over the workers' prepare / commit / publish / drop) also runs
here without Ray, over in-process workers, with a failure injected into one worker's prepare or commit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import EngineConfig, SamplingParams
from rollout.engine import Engine
from rollout.pool import _EngineWorker, _pack
from trainer_bridge import TrainerBridge, TrainingModel, toy_task
from weight_updates import Dense, WeightDiffer, WeightUpdateError
from weight_updates.transports.protocol import commit_on_all

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
        assert pool.routed_experts_shape is None and not pool_bridge.routed_experts  # a dense model: no replay
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

        # a push that worker 1 alone refuses (asleep at level 2: its weights are in host memory) changes no worker
        ray.get(pool.workers[1].sleep.remote(2))
        with torch.no_grad():
            model.checkpoint_state()["model.norm.weight"].add_(0.25)
        refused = "nothing written on any worker: worker 1: weight update while the engine sleeps"
        with pytest.raises(ValueError, match=refused) as err:
            pool_bridge.push_weights(model)
        assert "worker 0" not in str(err.value) and pool.policy_version == 2
        ray.get(pool.workers[1].wake_up.remote(None))
        assert _streams(pool_bridge.rollout(PROMPTS, params)) == _streams(a2)  # both shards: old weights, version 2
        assert pool_bridge.push_weights(model).version == local_bridge.push_weights(model).version == 3
        a4, b4 = local_bridge.rollout(PROMPTS, params), pool_bridge.rollout(PROMPTS, params)
        assert _streams(a4) == _streams(b4) != _streams(a2)
        sent = pool.apply_weight_update(4, local.export_weights())  # every weight, dense, as one Ray object
        assert (sent.version, sent.num_receivers, sent.num_dense, sent.num_patch) == (4, 2, len(local.weight_specs()), 0)
        assert [r.version for r in sent.received] == [4, 4] and all(r.nbytes == sent.nbytes for r in sent.received)
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()


# ---- the two-phase push over in-process workers (no Ray) ---------------------------------------------------
@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return toy_task.write_model(tmp_path_factory.mktemp("toy"), hidden_size=32, num_layers=2, seed=0)


def _workers(toy_dir, n: int = 2) -> list[_EngineWorker]:
    return [_EngineWorker({"model": str(toy_dir), "dtype": "float32", "max_num_seqs": 16, "num_kv_blocks": 64}, 1)
            for _ in range(n)]


def _push(workers, version: int, records: list) -> list:
    """The pool's push (RolloutPool.apply_weight_update) with its Ray calls made in process."""
    message = _pack(records)

    def run(step: str) -> list:
        args = (version, message) if step == "prepare" else ()
        return [getattr(w, f"{step}_update")(*args) for w in workers]

    return commit_on_all(version, run)


def _held(worker) -> dict[str, torch.Tensor]:
    return {u.name: u.tensor.clone() for u in worker.engine.export_weights()}


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def _moved(held: dict, seed: int, frac: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.where(torch.rand(t.shape, generator=g) < frac, t + 0.05 * torch.randn(t.shape, generator=g), t)
            for n, t in held.items()}


def test_a_push_one_worker_refuses_at_prepare_leaves_every_worker_on_the_old_weights(toy_dir):
    workers = _workers(toy_dir)
    workers[1].sleep(2)  # its weights are in host memory: it refuses updates
    before = _held(workers[0])
    records = [Dense.of(n, t) for n, t in _moved(before, seed=1, frac=1.0).items()]
    with pytest.raises(WeightUpdateError, match="version 1 rejected, nothing written on any worker: worker 1: weight update "
                                                "while the engine sleeps") as err:
        _push(workers, 1, records)
    assert "worker 0" not in str(err.value)
    workers[1].wake_up(None)
    for w in workers:
        assert w.engine.policy_version == 0 and _bitwise_equal(_held(w), before)
    published = _push(workers, 1, records)  # worker 0 dropped its staged update: it takes the next one
    assert [r["result"]["version"] for r in published] == [1, 1]
    for w in workers:
        assert w.engine.policy_version == 1 and _bitwise_equal(_held(w), {u.name: u.tensor for u in records})


def test_a_push_one_worker_fails_after_writing_is_rolled_back_on_every_worker(toy_dir, monkeypatch):
    workers = _workers(toy_dir)
    start = _held(workers[0])
    differ = WeightDiffer(workers[0].engine.weight_specs())
    differ.commit(differ.encode(start))  # the trainer holds what the workers loaded
    v1 = _moved(start, seed=2, frac=0.05)
    push = differ.encode(v1)
    assert push.stats.num_patch > 0 and push.stats.num_dense == 0
    _push(workers, 1, push.updates)
    differ.commit(push)
    v2 = _moved(v1, seed=3, frac=0.05)
    differ.reset(["model.norm.weight", "lm_head.weight"])  # two dense records among the patches
    push = differ.encode(v2)
    assert push.stats.num_patch > 0 and push.stats.num_dense == 2
    # worker 1's weights silently drop dense writes: its read-back fails after worker 0 wrote and verified
    monkeypatch.setattr(workers[1].engine.runner.weights, "write_dense_many", lambda pairs: None)
    params = SamplingParams(n=2, max_tokens=6, seed=5, ignore_eos=True)
    tokens = [[c.token_ids for c in o.outputs] for o in workers[0].generate(["1+2="], [params])]
    with pytest.raises(WeightUpdateError, match="version 2 failed after writing: worker 1: verification after write failed "
                                                ".*; rolled back: worker 0: weights restored; worker 1: see its error"):
        _push(workers, 2, push.updates)
    for w in workers:
        assert w.engine.policy_version == 1 and _bitwise_equal(_held(w), v1)
        assert [[c.token_ids for c in o.outputs] for o in w.generate(["1+2="], [params])] == tokens
    monkeypatch.undo()
    _push(workers, 2, push.updates)
    for w in workers:
        assert w.engine.policy_version == 2 and _bitwise_equal(_held(w), v2)


def test_a_staged_update_is_committed_published_or_dropped_once(toy_dir):
    (worker,) = _workers(toy_dir, 1)
    engine = worker.engine
    before = _held(worker)
    records = [Dense.of(n, t) for n, t in _moved(before, seed=4, frac=1.0).items()]
    with pytest.raises(WeightUpdateError, match="commit_weight_update\\(\\) needs a staged update that is prepared; "
                                                "nothing is staged"):
        engine.commit_weight_update()
    engine.prepare_weight_update(1, records)
    with pytest.raises(WeightUpdateError, match="an update is staged already"):
        engine.prepare_weight_update(2, records)
    with pytest.raises(ValueError, match="another session is open"):
        engine.apply_weight_update(2, records)
    with pytest.raises(ValueError, match="sleep\\(\\) with a staged weight update"):
        engine.sleep(1)
    with pytest.raises(WeightUpdateError, match="publish_weight_update\\(\\) needs a staged update that is committed"):
        engine.publish_weight_update()
    engine.commit_weight_update()
    assert engine.policy_version == 0 and _bitwise_equal(_held(worker), {u.name: u.tensor for u in records})
    assert engine.drop_weight_update() == "weights restored"
    assert engine.drop_weight_update() == "nothing staged"
    assert engine.policy_version == 0 and _bitwise_equal(_held(worker), before)
    engine.prepare_weight_update(1, records)
    engine.commit_weight_update()
    assert engine.publish_weight_update().version == 1 == engine.policy_version
