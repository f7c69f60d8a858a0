"""Expert parallelism on the CPU with 2 gloo ranks (EngineConfig.expert_parallel): each MoE layer's experts
split over the ranks, attention tensor-parallel. Layouts and config checks need no processes; each engine
test spawns one worker process.

Tolerance: fp32 logits within 1e-5 of one process, as tests/test_tensor_parallel.py (the ranks' partial
sums are added in another order than one process adds the k terms). Deterministic mode: EP=2 equals one
process to the same tolerance, not bitwise (one process sums the k terms in float32 and rounds once; EP
rounds each rank's partial sum, then adds them), and is batch-invariant bitwise (the all-reduce of two
ranks adds two numbers per element, whatever the batch).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import rank_local_expert_patch, single_thread, tp_config  # noqa: F401 (fixture)
from rollout import Engine, EngineConfig, SamplingParams
from runner.loader import load_model
from runner.model_config import ModelConfig
from runner.models.qwen_moe import Qwen2MoeForCausalLM
from runner.testing import write_random_checkpoint
from trainer_bridge import TrainerBridge
from trainer_bridge.training_model import TrainingModel

MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
           num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=256)
QWEN2_MOE = dict(family="qwen2_moe", shared_expert_intermediate_size=48, norm_topk_prob=False, **MOE)
QWEN3_MOE = dict(family="qwen3_moe", norm_topk_prob=True, **MOE)
IDS = [5, 9, 100, 127, 3, 3, 64, 200]
PROMPTS = [[5, 9, 13, 2, 7], list(range(40, 63)), [100, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ROUTED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_routed_experts=True)


def _greedy(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _model_config(**overrides) -> ModelConfig:
    raw = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 2, **QWEN2_MOE, **overrides}
    raw.pop("family")
    return ModelConfig.from_dict(raw)


# ---- layouts and config checks (no processes) ------------------------------------------------------------
def test_each_expert_lives_whole_on_one_rank_and_every_rank_has_a_slot_for_it():
    cfg = _model_config()
    ranks = [SimpleNamespace(rank=r, size=2, expert_parallel=True) for r in range(2)]
    with torch.device("meta"):
        models = [Qwen2MoeForCausalLM(cfg, None, tp) for tp in ranks]
    params = [dict(m.named_parameters()) for m in models]
    assert params[0]["model.layers.0.mlp.experts.w13"].shape == (3, 64, 64)  # 3 experts of 6, whole
    assert params[0]["model.layers.0.mlp.shared_expert.gate_up_proj.weight"].shape == (48, 64)  # TP-sharded
    layouts = [models[0].checkpoint_layout(r, 2) for r in range(2)]
    assert layouts == [m.checkpoint_layout() for m in models]  # any rank computes every rank's layout
    for e in range(6):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            slots = [layout[name] for layout in layouts]
            owner = e // 3
            assert slots[owner].is_whole and slots[1 - owner].is_empty, name
            for slot, p in zip(slots, params):
                assert tuple(slot.view(p[slot.param]).shape) == slot.shard_shape
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        with torch.device("meta"):
            Qwen2MoeForCausalLM(cfg, None, SimpleNamespace(rank=0, size=4, expert_parallel=True))


def test_expert_parallel_is_refused_without_tensor_parallelism_or_for_a_dense_model(tmp_path):
    with pytest.raises(ValueError, match="expert_parallel needs tensor_parallel_size > 1"):
        EngineConfig(model="m", expert_parallel=True)
    cfg = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="expert_parallel needs a Mixture-of-Experts model"):
        load_model(tmp_path, cfg, torch.float32, torch.device("cpu"), None, 64,
                   tp=SimpleNamespace(rank=0, size=2, expert_parallel=True))


# ---- engines (2 gloo ranks) ------------------------------------------------------------------------------
def test_qwen3_moe_ep2_deterministic_equals_one_process_with_the_same_routing(tmp_path, single_thread):  # noqa: F811
    """Deterministic mode on both sides: logits, greedy tokens and routed experts equal one process; a
    prompt's logprobs are bitwise the same alone and inside a batch."""
    path = write_random_checkpoint(tmp_path / "moe", **QWEN3_MOE)
    one = Engine(tp_config(path, deterministic=True))
    ref, ref_tokens = one.collective_rpc("full_sequence_logits", IDS)[0], _greedy(one)
    ref_routed = one.generate(PROMPTS, ROUTED)
    one.close()
    with Engine(tp_config(path, tensor_parallel_size=2, expert_parallel=True, deterministic=True)) as engine:
        assert engine.runner.model.sparse_blocks[0].experts.w13.shape[0] == 3
        assert (engine.collective_rpc("full_sequence_logits", IDS)[0] - ref).abs().max().item() < 1e-5
        assert _greedy(engine) == ref_tokens
        outs = engine.generate(PROMPTS, ROUTED)
        for ours, theirs in zip(outs, ref_routed):
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
            assert ours.outputs[0].routed_experts is not None
            assert (ours.outputs[0].routed_experts == theirs.outputs[0].routed_experts).all()
        alone = engine.generate([PROMPTS[1]], ROUTED)[0].outputs[0].logprobs
        assert alone == outs[1].outputs[0].logprobs


def test_qwen2_moe_ep2_equals_one_process_and_takes_dense_and_rank_local_pushes(tmp_path, single_thread):  # noqa: F811
    """Shared expert tensor-parallel, routed experts split: logits and greedy equal one process; a dense push
    and a patch push (broadcast), then a rank-local patch push, on rows of both ranks' experts, leave the
    exported weights equal to the trainer's and greedy equal to one process holding them."""
    path = write_random_checkpoint(tmp_path / "moe", **QWEN2_MOE)
    one = Engine(tp_config(path))
    ref = one.collective_rpc("full_sequence_logits", IDS)[0]
    ref_tokens = _greedy(one)
    with Engine(tp_config(path, tensor_parallel_size=2, expert_parallel=True)) as engine:
        assert engine.runner.weights.view("model.layers.0.mlp.experts.4.gate_proj.weight").shape == (0, 64)
        assert engine.runner.weights.view("model.layers.0.mlp.experts.2.gate_proj.weight").shape == (32, 64)
        assert (engine.collective_rpc("full_sequence_logits", IDS)[0] - ref).abs().max().item() < 1e-5
        assert _greedy(engine) == ref_tokens
        model = TrainingModel.from_pretrained(path)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, t in model.checkpoint_state().items():
                if ".experts." in name:
                    t.add_(0.05 * torch.randn(t.shape, generator=g))
        broadcast = TrainerBridge(engine)  # records broadcast from rank 0; each rank writes its own part
        assert broadcast.push_weights(model).num_dense > 0
        with torch.no_grad():
            model.checkpoint_state()["model.layers.0.mlp.experts.5.gate_proj.weight"][2, :8] += 0.25  # rank 1's
            model.checkpoint_state()["model.layers.1.mlp.experts.0.down_proj.weight"][7, 3] -= 0.25  # rank 0's
        assert broadcast.push_weights(model).num_dense == 0
        exported = {r.name: r.tensor for r in engine.export_weights()}
        for name, t in model.checkpoint_state().items():
            assert torch.equal(exported[name], t), name
        rank_local_expert_patch(engine, one, model)
        tokens = _greedy(one)
        assert tokens != ref_tokens  # the pushes changed the model's output
        assert _greedy(engine) == tokens
    one.close()
