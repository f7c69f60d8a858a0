"""LoRA through a RolloutPool (2 CPU workers on Ray, a tiny random Llama, real PEFT adapters) against one local
engine given the same loads and pushes: loads on every worker, a batch mixing the base and an adapter, a swap under
one name, a load one worker refuses (undone on the other), adapter pushes through TrainerBridge(pool, lora=...)
(dense, then a patch), pushes refused by every worker or by one (nothing changes anywhere), and a worker killed
mid-rollout that comes back serving the pushed adapter and a never-pushed one. One combined test, because Ray
start-up and each actor dominate the cost.

The two-phase adapter push also runs without Ray over in-process workers, with a write failure injected into one
worker's commit, and the engine's staged adapter push is checked on its own.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_checkpoint, perturb_lora
from rollout import Engine, EngineConfig, SamplingParams
from rollout.pool import PoolConfig, _EngineWorker, _pack, load_pool_config
from test_lora_engine import peft_model, write_adapters
from trainer_bridge import TrainerBridge
from weight_updates import Dense, WeightUpdateError
from weight_updates.transports.protocol import commit_on_all

PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 3], list(range(3, 30)), [7, 7, 8]]
ENGINE = {"dtype": "float32", "max_loras": 2, "max_lora_rank": 8, "num_kv_blocks": 96, "max_num_seqs": 16}
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint(tmp_path_factory.mktemp("pool_lora_base"), "llama", seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    return write_adapters(base, tmp_path_factory.mktemp("pool_lora_adapters"))


def _mixed(loras, *, seed=100, max_tokens=8):
    """Prompts and SamplingParams of a batch with one request per entry of `loras` (seeded, so any worker gives the
    same tokens), every other one greedy."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=max_tokens, seed=seed + i, ignore_eos=True,
                             lora=lora) for i, lora in enumerate(loras)]
    return prompts, params


def _same(pool_outs, local_outs) -> None:
    assert len(pool_outs) == len(local_outs)
    for p, q in zip(pool_outs, local_outs):
        a, b = p.outputs[0], q.outputs[0]
        assert (a.token_ids, a.lora, a.lora_versions, a.policy_versions) == \
            (b.token_ids, b.lora, b.lora_versions, b.policy_versions)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_pool_serves_loads_swaps_and_pushes_adapters_like_one_engine(base, adapters, tmp_path):
    ray = pytest.importorskip("ray")
    from rollout.pool import RolloutPool

    yaml = tmp_path / "pool.yaml"  # the YAML path: the engine's LoRA fields pass through to every worker
    yaml.write_text("num_workers: 2\nresources: {num_cpus: 1}\nengine:\n"
                    + "".join(f"  {k}: {v}\n" for k, v in ENGINE.items()))
    cfg = load_pool_config(yaml, model=str(base))
    assert cfg.engine_config().max_loras == 2 and cfg.engine_config().max_lora_rank == 8
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    pool = None
    try:
        pool = RolloutPool(cfg)
        local = Engine(EngineConfig(model=str(base), **ENGINE))

        def on_workers(method, *args):
            return ray.get([getattr(w, method).remote(*args) for w in pool.workers])

        # a load reaches every worker
        info = pool.load_lora("a", str(adapters["a"]))
        local.load_lora("a", str(adapters["a"]))
        assert (info.name, info.rank, info.version) == ("a", 4, 0) and pool.list_loras() == [info]
        assert [[(i.name, i.rank, i.version) for i in got] for got in on_workers("list_loras")] == [[("a", 4, 0)]] * 2
        with pytest.raises(ValueError, match="loaded already"):
            pool.load_lora("a", str(adapters["b"]))

        # a batch mixing base and adapter requests, split over both workers, equals the local engine
        prompts, params = _mixed([None, "a", "a", None, "a", None, "a", "a"])
        first = pool.generate(prompts, params)
        _same(first, local.generate(prompts, params))
        assert [o.outputs[0].lora for o in first] == [p.lora for p in params]
        assert all(o.outputs[0].lora_versions == (None if o.outputs[0].lora is None else [0] * 8) for o in first)
        with pytest.raises(ValueError, match="SamplingParams.lora: no LoRA adapter named 'nope' is loaded in the pool"):
            pool.submit(prompts[:1], [dataclasses.replace(params[0], lora="nope")])

        # unload, then another adapter under the same name: the new one is served
        for engine in (pool, local):
            engine.unload_lora("a")
        assert pool.list_loras() == [] and on_workers("list_loras") == [[], []]
        with pytest.raises(ValueError, match="SamplingParams.lora: no LoRA adapter named 'a'"):
            pool.generate(prompts, params)
        for engine in (pool, local):
            engine.load_lora("a", str(adapters["c"]))
        swapped = pool.generate(prompts, params)
        _same(swapped, local.generate(prompts, params))
        adapter_rows = [i for i, p in enumerate(params) if p.lora]
        assert [_tokens(swapped)[i] for i in adapter_rows] != [_tokens(first)[i] for i in adapter_rows]

        # a load worker 1 refuses (its slots are full) is undone on worker 0: no worker serves it
        assert ray.get(pool.workers[1].load_lora.remote("filler", str(adapters["b"])))["ok"]
        with pytest.raises(ValueError, match=r"load_lora\('b', .*\) refused, loaded on no worker: worker 1: "
                                             r"ValueError: all EngineConfig.max_loras=2 adapter slots are in use") as err:
            pool.load_lora("b", str(adapters["b"]))
        assert "worker 0" not in str(err.value)
        assert [[i.name for i in got] for got in on_workers("list_loras")] == [["a"], ["a", "filler"]]
        assert [i.name for i in pool.list_loras()] == ["a"]
        assert ray.get(pool.workers[1].unload_lora.remote("filler"))["ok"]
        with pytest.raises(ValueError, match="no adapter_config.json"):  # refused everywhere: nothing to undo
            pool.load_lora("b", str(tmp_path / "nowhere"))

        # adapter pushes through TrainerBridge(pool, lora=...): a PEFT model, dense first, then a patch
        trainer = peft_model(base, adapters["c"])
        pool_bridge, local_bridge = TrainerBridge(pool, lora="a"), TrainerBridge(local, lora="a")
        assert pool_bridge.specs == local_bridge.specs == pool.lora_specs("a") and len(pool_bridge.specs) == 28
        perturb_lora(trainer, seed=0, fraction=1.0)
        dense = [bridge.push_weights(trainer) for bridge in (pool_bridge, local_bridge)]
        perturb_lora(trainer, seed=1, fraction=0.05)
        patch = [bridge.push_weights(trainer) for bridge in (pool_bridge, local_bridge)]
        for d, p in (dense, patch):
            assert (d.version, d.lora_version, d.num_dense, d.num_patch) == (p.version, p.lora_version, p.num_dense,
                                                                                 p.num_patch)
        assert dense[0].num_patch == 0 and patch[0].num_patch > 0 and patch[0].nbytes < dense[0].nbytes
        assert (patch[0].version, patch[0].lora_version) == (2, 2)
        assert (pool.policy_version, pool.list_loras()[0].version) == (2, 2)
        assert on_workers("policy_version") == [2, 2]
        pushed = pool.generate(prompts, params)
        _same(pushed, local.generate(prompts, params))
        assert all(pushed[i].outputs[0].lora_versions == [2] * 8 for i in adapter_rows)
        assert [_tokens(pushed)[i] for i in adapter_rows] != [_tokens(swapped)[i] for i in adapter_rows]
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="a")
        batch = pool_bridge.rollout(PROMPTS, dataclasses.replace(greedy, lora=None))  # the bridge's adapter
        assert [s.completion_ids for s in batch.samples] == _tokens(local.generate(PROMPTS, greedy))

        # refused pushes change nothing on any worker: a wrong rank, an unknown module (every worker refuses) ...
        held = on_workers("export_lora", "a")
        hidden = local.lora_specs("a")[Q_A].shape[1]
        refused = {"rank": ([Dense.of(Q_A, torch.randn(4, hidden))], "shape"),
                   "module": ([Dense.of(Q_A.replace("layers.0", "layers.7"), torch.randn(8, hidden))], "layers.7")}
        for what, (records, message) in refused.items():
            with pytest.raises(WeightUpdateError, match=f"LoRA adapter 'a': version 3 rejected, nothing written on any "
                                                        f"worker: worker 0: .*{message}.*; worker 1: "):
                pool.apply_lora_update("a", records)
        # ... and a good push that worker 1 alone refuses (a base update is staged on it): worker 0 drops it
        staged = ray.get(pool.workers[1].prepare_update.remote(3, _pack([])))
        assert staged["ok"]
        good = [Dense.of(Q_A, torch.randn(8, hidden))]
        with pytest.raises(WeightUpdateError, match="LoRA adapter 'a': version 3 rejected, nothing written on any "
                                                    "worker: worker 1: a LoRA update while a base weight update is "
                                                    "staged") as err:
            pool.apply_lora_update("a", good)
        assert "worker 0" not in str(err.value)
        assert ray.get(pool.workers[1].drop_update.remote())["ok"]
        for before, after in zip(held, on_workers("export_lora", "a")):
            assert before["header"] == after["header"] and (before["data"] == after["data"]).all()
        assert pool.policy_version == 2 and on_workers("policy_version") == [2, 2]
        assert pool.list_loras()[0].version == 2
        _same(pool.generate(prompts, params), local.generate(prompts, params))

        # a base push after the adapter pushes, and a second adapter never pushed, then worker 0 dies mid-rollout:
        # it comes back with the base weights, both adapters and every version, and serves them
        for engine in (pool, local):
            engine.load_lora("b", str(adapters["b"]))
        norm = next(u for u in local.export_weights() if u.name == "model.norm.weight")
        for engine in (pool, local):
            engine.apply_weight_update(3, [Dense.of(norm.name, norm.tensor + 0.5)])
        prompts, params = _mixed(["a", None, "b", "a", "b", None, "a", "b"], seed=7)
        want = local.generate(prompts, params)
        pending = pool.submit(prompts, params)
        ray.kill(pool.workers[0], no_restart=True)
        outs = pool.collect(pending)
        assert pool.num_restarts == [1, 0]
        _same(outs, want)
        assert [[(i.name, i.version) for i in got] for got in on_workers("list_loras")] == [[("a", 2), ("b", 0)]] * 2
        assert on_workers("policy_version") == [3, 3] == [pool.policy_version] * 2
        _same(pool.generate(prompts, params), want)  # both shards, the restarted worker's included
        assert all(o.outputs[0].policy_versions == [3] * 8 for o in want)
        assert [o.outputs[0].lora_versions for o in want[:3]] == [[2] * 8, None, [0] * 8]

        # a worker dead at a push takes no part in it and is restarted afterwards with the pushed adapter
        ray.kill(pool.workers[1], no_restart=True)
        perturb_lora(trainer, seed=2, fraction=0.05)
        for bridge in (pool_bridge, local_bridge):
            assert bridge.push_weights(trainer).lora_version == 3
        assert pool.num_restarts == [1, 1] and on_workers("policy_version") == [4, 4]
        assert [[(i.name, i.version) for i in got] for got in on_workers("list_loras")] == [[("a", 3), ("b", 0)]] * 2
        _same(pool.generate(prompts, params), local.generate(prompts, params))
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()


def test_merged_mode_is_refused_by_the_pool_config():
    with pytest.raises(ValueError, match="engine.lora_merged is not offered by RolloutPool"):
        PoolConfig(model="m", engine={"max_loras": 1, "lora_merged": True})


# ---- the two-phase adapter push over in-process workers (no Ray) --------------------------------------------------
def _workers(base, adapters, n: int = 2) -> list[_EngineWorker]:
    workers = [_EngineWorker({"model": str(base), **ENGINE}, 1) for _ in range(n)]
    for w in workers:
        assert w.load_lora("a", str(adapters["a"]))["ok"]
    return workers


def _push(workers, name: str, version: int, records: list) -> list:
    """The pool's adapter push (RolloutPool.apply_lora_update) with its Ray calls made in process."""
    message = _pack(records)

    def run(step: str) -> list:
        args = (name, version, message) if step == "prepare" else ()
        return [getattr(w, f"{step}_lora_update")(*args) for w in workers]

    return commit_on_all(version, run)


def _held(worker, name: str = "a") -> dict[str, torch.Tensor]:
    return {u.name: u.tensor for u in worker.engine.export_lora(name)}


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def test_an_adapter_push_one_worker_fails_after_writing_is_rolled_back_on_every_worker(base, adapters, monkeypatch):
    workers = _workers(base, adapters)
    before = _held(workers[0])
    assert _bitwise_equal(before, _held(workers[1]))
    moved = {n: t + 0.25 for n, t in before.items()}
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True, lora="a")
    tokens = _tokens(workers[0].generate(PROMPTS[:2], [params] * 2))
    # worker 1's slot silently drops dense writes: its read-back fails after worker 0 wrote and verified
    target = workers[1].engine._loras._receiver(workers[1].engine._loras.get("a")).target
    monkeypatch.setattr(target, "write_dense", lambda name, tensor: None)
    with pytest.raises(WeightUpdateError, match="version 1 failed after writing: worker 1: verification after write "
                                                "failed .*; rolled back: worker 0: weights restored; worker 1: see its "
                                                "error"):
        _push(workers, "a", 1, [Dense.of(n, t) for n, t in moved.items()])
    for w in workers:
        assert w.engine.policy_version == 0 and w.engine.list_loras()[0].version == 0
        assert _bitwise_equal(_held(w), before)
        assert _tokens(w.generate(PROMPTS[:2], [params] * 2)) == tokens
    monkeypatch.undo()
    published = _push(workers, "a", 1, [Dense.of(n, t) for n, t in moved.items()])
    assert [r["result"]["version"] for r in published] == [1, 1]
    for w in workers:
        assert w.engine.policy_version == 1 and w.engine.list_loras()[0].version == 1
        assert _bitwise_equal(_held(w), moved)
    moved_tokens = [_tokens(w.generate(PROMPTS[:2], [params] * 2)) for w in workers]
    assert moved_tokens[0] == moved_tokens[1] != tokens


def test_a_staged_adapter_push_holds_the_engine_until_published_or_dropped(base, adapters):
    (worker,) = _workers(base, adapters, 1)
    engine = worker.engine
    before = _held(worker)
    records = [Dense.of(n, t - 0.5) for n, t in before.items()]
    with pytest.raises(WeightUpdateError, match=r"commit_lora_update\(\) needs a staged LoRA push that is prepared; "
                                                "nothing is staged"):
        engine.commit_lora_update()
    engine.prepare_lora_update("a", records)
    with pytest.raises(WeightUpdateError, match="a push of LoRA adapter 'a' is staged already"):
        engine.prepare_lora_update("a", records)
    with pytest.raises(WeightUpdateError, match="a base weight update while a push of LoRA adapter 'a' is staged"):
        engine.prepare_weight_update(1, [])
    with pytest.raises(ValueError, match="lora_name: a push of adapter 'a' is staged"):
        engine.unload_lora("a")
    with pytest.raises(ValueError, match=r"sleep\(\) with a staged weight update"):
        engine.sleep(1)
    with pytest.raises(WeightUpdateError, match=r"publish_lora_update\(\) needs a staged LoRA push that is committed"):
        engine.publish_lora_update()
    engine.commit_lora_update()
    assert _bitwise_equal(_held(worker), {u.name: u.tensor for u in records}) and engine.policy_version == 0
    assert engine.drop_lora_update() == "weights restored"
    assert engine.drop_lora_update() == "nothing staged"
    assert _bitwise_equal(_held(worker), before) and engine.list_loras()[0].version == 0
    engine.prepare_lora_update("a", records)
    engine.commit_lora_update()
    assert engine.publish_lora_update().version == 1 == engine.list_loras()[0].version
    assert engine.policy_version == 1
    assert engine.apply_weight_update(2, []).version == 2  # nothing staged any more: a base update goes through
