"""LoRA adapters under tensor parallelism on gloo (two processes): each rank serves its shard of every adapter
(column-parallel B rows, row-parallel A columns) and the outputs equal one process's; pushes in full PEFT
coordinates reach every rank's shard, and a refused push changes no rank (tolerances: float32, one rounding
order of the row-parallel sums apart)."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine, SamplingParams
from conftest import perturb_lora, tp_config
from test_lora_engine import peft_model, write_adapter

pytest.importorskip("peft")

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8, 1]]


@pytest.fixture(scope="module")
def adapters(tp_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_adapters")
    return {"a": write_adapter(tp_model_dir, root / "a", seed=1, r=4, lora_alpha=8),
            "b": write_adapter(tp_model_dir, root / "b", seed=2, r=2, lora_alpha=4, use_rslora=True)}


@pytest.fixture(scope="module")
def engines(tp_model_dir, adapters, single_thread):
    made = {tp: Engine(tp_config(tp_model_dir, tensor_parallel_size=tp, max_loras=2, max_lora_rank=4))
            for tp in (1, 2)}
    for engine in made.values():
        for name, path in adapters.items():
            engine.load_lora(name, str(path))
    yield made
    for engine in made.values():
        engine.close()


def run(engine, lora):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, lora=lora)
    return [c.outputs[0] for c in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("lora", [None, "a", "b"])
def test_adapters_under_tp_equal_one_process(engines, lora):
    one, two = run(engines[1], lora), run(engines[2], lora)
    assert [c.token_ids for c in one] == [c.token_ids for c in two]
    for c1, c2 in zip(one, two):
        torch.testing.assert_close(torch.tensor(c2.logprobs), torch.tensor(c1.logprobs), atol=1e-4, rtol=0)
    if lora is not None:  # the adapter changes the outputs: the shards are really used
        base = run(engines[1], None)
        assert any(c.token_ids != b.token_ids or c.logprobs != b.logprobs for c, b in zip(one, base))


def test_exports_assemble_the_full_adapter(engines):
    one = {r.name: r.tensor for r in engines[1].export_lora("a")}
    two = {r.name: r.tensor for r in engines[2].export_lora("a")}
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_pushes_reach_every_shard_and_a_refused_push_changes_nothing(engines, tp_model_dir, adapters):
    from trainer_bridge import TrainerBridge
    from weight_updates import Dense

    trainer = peft_model(tp_model_dir, adapters["a"])
    bridges = {tp: TrainerBridge(engine, lora="a") for tp, engine in engines.items()}
    perturb_lora(trainer, seed=0, fraction=1.0)
    for bridge in bridges.values():
        assert bridge.push_weights(trainer).num_dense > 0
    perturb_lora(trainer, seed=1, fraction=0.05)
    for bridge in bridges.values():
        assert bridge.push_weights(trainer).num_patch > 0
    test_exports_assemble_the_full_adapter(engines)
    test_adapters_under_tp_equal_one_process(engines, "a")
    before = {r.name: r.tensor for r in engines[2].export_lora("a")}
    name, spec = next(iter(engines[2].lora_specs("a").items()))
    wrong = Dense.of(name, torch.zeros(tuple(n + 1 for n in spec.shape)))
    with pytest.raises(Exception, match="shape"):
        engines[2].apply_lora_update("a", [wrong])
    after = {r.name: r.tensor for r in engines[2].export_lora("a")}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert [lora.version for lora in engines[2].list_loras() if lora.name == "a"] == [2]
