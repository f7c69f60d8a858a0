"""Weight updates on stacked experts: dense and patch pushes in per-expert checkpoint names and in
transformers' fused names reach the right rows of the stacked tensors, bitwise; adopt_engine_weights;
a tensor-parallel MoE engine (2 gloo ranks) against one process, with a rank-local push."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_engine_holds, load_hf, rank_local_expert_patch, single_thread, tp_config  # noqa: F401 (fixture)
from rollout import Engine, EngineConfig, SamplingParams
from runner.testing import write_random_checkpoint
from trainer_bridge import TrainerBridge
from trainer_bridge.training_model import TrainingModel
from weight_updates.aliases import fused_expert_aliases

PROMPTS = [[5, 9, 13, 2, 7], list(range(40, 63)), [100, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=8, num_kv_blocks=64, **kw))


def _greedy(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _fresh_greedy(state: dict[str, torch.Tensor], src, dst) -> list[list[int]]:
    """Greedy tokens of a new engine on `state` written as a checkpoint next to src's config."""
    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    save_file({n: t.detach().contiguous() for n, t in state.items()}, str(dst / "model.safetensors"))
    engine = _engine(dst)
    try:
        return _greedy(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_dense_then_one_percent_patch_across_all_experts_is_bitwise(ckpt_factory, tmp_path, family):
    path = ckpt_factory(family)
    engine = _engine(path)
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    first = bridge.push_weights(model)
    assert first.num_dense > 0
    assert_engine_holds(engine, model.checkpoint_state())

    state = model.checkpoint_state()
    experts = [n for n in state if ".experts." in n]
    total = sum(state[n].numel() for n in experts)
    with torch.no_grad():
        for name in experts:  # about 1% of every expert's elements
            flat = state[name].view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
            flat[idx] += 0.25
    second = bridge.push_weights(model)
    assert second.num_dense == 0 and second.num_patch == len(state)  # unchanged tensors: empty patches
    assert second.nbytes < 0.1 * total * 4  # a patch, not a dense copy of the experts
    assert_engine_holds(engine, model.checkpoint_state())
    assert _greedy(engine) == _fresh_greedy(model.checkpoint_state(), path, tmp_path / "updated")
    engine.close()


def test_pushes_in_transformers_fused_names_reach_the_stacked_rows(ckpt_factory, tmp_path):
    """A transformers model's named_parameters() (experts fused: gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) pushed as is, dense then patch; greedy then equals transformers' own."""
    path = ckpt_factory("qwen3_moe")
    engine = _engine(path)
    bridge = TrainerBridge(engine)
    hf = load_hf(path)
    names = dict(hf.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    assert bridge.push_weights(hf).num_dense > 0
    with torch.no_grad():
        fused = names["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]
        fused[3, -1, :5] += 0.5  # expert 3's last up row
        names["model.layers.0.mlp.experts.down_proj"][7, 0, 0] -= 0.5
    second = bridge.push_weights(hf)
    assert second.num_dense == 0
    weights = engine.runner.weights
    i = fused.shape[1] // 2
    assert torch.equal(weights.view("model.layers.1.mlp.experts.3.up_proj.weight"), fused[3, i:])
    assert torch.equal(weights.view("model.layers.1.mlp.experts.3.gate_proj.weight"), fused[3, :i])
    assert torch.equal(weights.view("model.layers.0.mlp.experts.7.down_proj.weight"),
                       names["model.layers.0.mlp.experts.down_proj"][7])
    for prompt, tokens in zip(PROMPTS, _greedy(engine)):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref

    before = weights.view("model.layers.0.mlp.experts.0.gate_proj.weight").clone()
    with pytest.raises(ValueError, match=r"experts.gate_up_proj: shape \(8, 32, 64\) != expected \(8, 64, 64\)"):
        bridge.push_weights({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 32, 64),
                             "model.norm.weight": torch.zeros(64)})
    assert torch.equal(weights.view("model.layers.0.mlp.experts.0.gate_proj.weight"), before)
    assert engine.policy_version == 2
    engine.close()


def test_fused_aliases_need_a_complete_consistent_expert_family():
    from weight_updates.target import ParamSpec

    def specs(num, inter=4, hidden=6, skip=None):
        out = {}
        for e in range(num):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                if (e, proj) != skip:
                    out[f"m.layers.0.mlp.experts.{e}.{proj}.weight"] = ParamSpec(shape, torch.float32)
        return out

    aliases = fused_expert_aliases(specs(3))
    assert aliases["m.layers.0.mlp.experts.gate_up_proj"].shape == (3, 8, 6)
    assert aliases["m.layers.0.mlp.experts.down_proj"].shape == (3, 6, 4)
    assert fused_expert_aliases(specs(3, skip=(1, "up_proj"))) == {}
    assert fused_expert_aliases({k: v for k, v in specs(3).items() if ".experts.0." not in k}) == {}


def test_adopting_a_moe_engines_weights_makes_the_first_push_a_patch(ckpt_factory):
    path = ckpt_factory("qwen2_moe")
    engine = _engine(path)
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(path)
    assert bridge.adopt_engine_weights(model) == len(model.checkpoint_state())
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    with torch.no_grad():
        model.checkpoint_state()[name].view(-1)[:7] += 0.5
    result = bridge.push_weights(model)
    assert result.num_dense == 0 and result.nbytes < 1024
    assert_engine_holds(engine, model.checkpoint_state())
    engine.close()


MOE_TP = dict(family="qwen2_moe", vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, norm_topk_prob=False, max_position_embeddings=256)


def test_tensor_parallel_moe_equals_one_process_and_takes_rank_local_pushes(tmp_path, single_thread):  # noqa: F811
    """Experts sharded along their intermediate dimension over 2 ranks: logits and greedy tokens equal one
    process; a rank-local patch push on expert rows leaves every rank's part equal to the trainer's."""
    path = write_random_checkpoint(tmp_path / "moe", **MOE_TP)
    ids = [5, 9, 100, 127, 3, 3, 64, 200]
    one = Engine(tp_config(path))
    ref = one.collective_rpc("full_sequence_logits", ids)[0]
    ref_tokens = _greedy(one)
    with Engine(tp_config(path, tensor_parallel_size=2)) as engine:
        assert engine.runner.weights.view("model.layers.0.mlp.experts.2.gate_proj.weight").shape == (16, 64)
        assert (engine.collective_rpc("full_sequence_logits", ids)[0] - ref).abs().max().item() < 1e-5
        assert _greedy(engine) == ref_tokens
        rank_local_expert_patch(engine, one, TrainingModel.from_pretrained(path))
        assert _greedy(engine) == _greedy(one)
    one.close()
