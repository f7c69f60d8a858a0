"""The model registry and layer-owned checkpoint layouts.

A Llama variant defined here, with its own MLP (unfused w1 / w3 / w2 parameters under Mixtral's names,
declared once in its `checkpoint_layout`), is registered with one `ModelRegistry.register_model` call and
served by the engine from a checkpoint written by transformers: greedy tokens and logits match
transformers', and dense and patch updates land bitwise. Also: unknown architectures, the supported list,
the random-checkpoint writer, stacked / column slots, deterministic mode and every rank's TP layout.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from conftest import assert_engine_holds, load_hf, make_checkpoint
from kernels.activation_ref import silu_and_mul_ref
from rollout import Engine, EngineConfig, SamplingParams
from runner.layers import Linear
from runner.loader import CheckpointWeights
from runner.model_config import ModelConfig
from runner.models import CheckpointSlot, ModelRegistry
from runner.models.layout import module_layout, part
from runner.models.llama import DecoderForCausalLM
from runner.models.registry import _ModelRegistry
from runner.parallel.layers import RowParallelLinear, even_partition, rank_and_size
from runner.testing import write_random_checkpoint
from weight_updates import Dense, PackedIndices, Patch, WeightDiffer, WeightReceiver, checksum

ARCH = "UnfusedLlamaForCausalLM"


class UnfusedMLP(nn.Module):
    """Llama's MLP with gate / up / down as three parameters named w1 / w3 / w2 (none a checkpoint name)."""

    def __init__(self, cfg: ModelConfig, tp=None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = cfg.hidden_size, cfg.intermediate_size
        start, end = even_partition(cfg.intermediate_size, *rank_and_size(tp), "intermediate_size")
        self.w1 = Linear(cfg.hidden_size, end - start)  # gate, the rank's rows
        self.w3 = Linear(cfg.hidden_size, end - start)  # up
        self.w2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, "intermediate_size")  # down
        self.deterministic = False

    def set_deterministic(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu_and_mul_ref(torch.cat([self.w1(x), self.w3(x)], dim=-1)))

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        rows = even_partition(self.intermediate_size, tp_rank, tp_size, "intermediate_size")
        h, i = self.hidden_size, self.intermediate_size
        return {"gate_proj.weight": part("w1.weight", (i, h), shard=rows),
                "up_proj.weight": part("w3.weight", (i, h), shard=rows),
                "down_proj.weight": part("w2.weight", (h, i), dim=1, shard=rows)}


class UnfusedLlama(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, backend=None, tp=None) -> None:
        super().__init__(cfg, backend, tp)
        for layer in self.model.layers:
            layer.mlp = UnfusedMLP(cfg, tp)


ModelRegistry.register_model(ARCH, UnfusedLlama)

PROMPTS = [[5, 9, 13, 2, 7], list(range(40, 63)), [100], list(range(3, 60))]


@pytest.fixture(scope="module")
def custom_ckpt(tmp_path_factory):
    """(path, transformers model): a transformers Llama checkpoint whose config.json names ARCH."""
    path = make_checkpoint(tmp_path_factory.mktemp("unfused"), "llama", seed=3)
    hf = load_hf(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [ARCH]
    (path / "config.json").write_text(json.dumps(config))
    return path, hf


def _engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=8, num_kv_blocks=64))


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def test_registered_model_is_served_and_matches_transformers(custom_ckpt):
    path, hf = custom_ckpt
    engine = _engine(path)
    model = engine.runner.model
    assert type(model) is UnfusedLlama and all(isinstance(layer.mlp, UnfusedMLP) for layer in model.model.layers)
    assert "model.layers.0.mlp.w1.weight" in dict(model.named_parameters())
    tokens = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(hf, tokens)
    assert ref.std() > 0.5, "logits too flat for a meaningful comparison"
    torch.testing.assert_close(engine.collective_rpc("full_sequence_logits", tokens)[0], ref, atol=1e-4, rtol=1e-4)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == want[0, len(prompt):].tolist(), prompt


def test_registered_model_serves_every_tensor_parallel_rank(custom_ckpt, single_thread):
    """The worker ranks are spawned processes: they get rank 0's registrations as import paths, so the class
    defined in this file is every rank's model, and two ranks compute what one does."""
    path, _ = custom_ckpt
    tokens = list(range(7, 40))
    want = _engine(path).collective_rpc("full_sequence_logits", tokens)[0]
    with Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=8, num_kv_blocks=64,
                             tensor_parallel_size=2)) as engine:
        kinds = engine.collective_rpc("test_model_registry:model_kind")
        assert kinds == ["UnfusedLlama/UnfusedMLP"] * 2
        torch.testing.assert_close(engine.collective_rpc("full_sequence_logits", tokens)[0], want, atol=1e-5, rtol=1e-5)


def model_kind(runner) -> str:
    return f"{type(runner.model).__name__}/{type(runner.model.model.layers[0].mlp).__name__}"


def test_registered_model_takes_dense_then_patch_updates_bitwise(custom_ckpt):
    path, hf = custom_ckpt
    engine, hf = _engine(path), copy.deepcopy(hf)
    weights = engine.runner.weights
    specs = engine.weight_specs()
    assert set(specs) == set(hf.state_dict())  # every checkpoint name, no more
    differ = WeightDiffer(specs)
    g = torch.Generator().manual_seed(0)
    master = {n: (weights.view(n) + 0.01 * torch.randn(spec.shape, generator=g)).contiguous() for n, spec in specs.items()}
    first = differ.encode(master)
    assert all(isinstance(u, Dense) for u in first.updates) and len(first.updates) == len(specs)
    engine.apply_weight_update(engine.policy_version + 1, first.updates)
    differ.commit(first)
    assert_engine_holds(engine, master)
    for t in master.values():  # about 1% of each tensor moves
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
        flat[idx] += 0.05 * torch.randn(idx.numel(), generator=g)
    second = differ.encode(master)
    assert all(isinstance(u, Patch) for u in second.updates) and len(second.updates) == len(specs)
    engine.apply_weight_update(engine.policy_version + 1, second.updates)
    differ.commit(second)
    assert_engine_holds(engine, master)
    assert engine.policy_version == 2
    # the pushed tensors landed where the model computes with them: transformers with the same weights agrees
    hf.load_state_dict(master)
    tokens = list(range(3, 40))
    torch.testing.assert_close(engine.collective_rpc("full_sequence_logits", tokens)[0], _hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_unknown_architecture_is_refused_naming_the_supported_list(tmp_path):
    raw = {"architectures": ["NoSuchForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"unknown architecture \['NoSuchForCausalLM'\]; supported: \[.*'LlamaForCausalLM'") as e:
        ModelConfig.from_dict(raw)
    assert repr(ARCH) in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8))


def test_supported_archs_list_the_registered_ones():
    archs = ModelRegistry.get_supported_archs()
    assert archs == sorted(archs)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", ARCH} <= set(archs)
    registry = _ModelRegistry()  # a fresh one, so the engine's registry keeps only what this file registers
    registry.register_model("BForCausalLM", UnfusedLlama)
    registry.register_model("AForCausalLM", "runner.models.llama:DecoderForCausalLM")  # imported when first used
    assert registry.get_supported_archs() == ["AForCausalLM", "BForCausalLM"]
    assert registry.resolve(["Other", "AForCausalLM", "BForCausalLM"]) == ("AForCausalLM", DecoderForCausalLM)
    with pytest.raises(ValueError, match=r"unknown architecture \['Other'\]; supported: \['AForCausalLM', 'BForCausalLM'\]"):
        registry.resolve(["Other"])


def test_registering_a_class_without_the_interface_is_refused():
    class Incomplete(nn.Module):
        def forward(self, x):
            return x

    registry = _ModelRegistry()
    with pytest.raises(ValueError, match=r"lacks \['init_rotary', 'bind_kv_cache'.*'set_deterministic'\]"):
        registry.register_model("IncompleteForCausalLM", Incomplete)
    with pytest.raises(ValueError, match="module.path:ClassName"):
        registry.register_model("IncompleteForCausalLM", "no_colon_here")
    assert registry.get_supported_archs() == []


@pytest.mark.parametrize("family,arch,overrides", [
    ("llama", ARCH, {}),
    ("qwen2", None, {"tie_word_embeddings": True}),
    ("qwen3", None, {}),
])
def test_random_checkpoint_writer_covers_every_declared_name(tmp_path, family, arch, overrides):
    from safetensors.torch import load_file

    path = write_random_checkpoint(tmp_path, family=family, architecture=arch, seed=4, hidden_size=64,
                                   intermediate_size=96, num_attention_heads=4, **overrides)
    sd = load_file(str(path / "model.safetensors"))
    cfg = ModelConfig.from_dir(path)
    _, cls = ModelRegistry.resolve([cfg.architecture])
    with torch.device("meta"):
        layout = cls(cfg, None, None).checkpoint_layout()
    assert list(sd) and set(sd) == set(layout)
    for name, slot in layout.items():
        assert tuple(sd[name].shape) == slot.shape, name
        if slot.init == "ones":  # norms: 1 + 0.1 N(0, 1)
            assert 0.5 < sd[name].mean().item() < 1.5 and sd[name].std().item() > 0.01, name
        else:
            assert abs(sd[name].mean().item()) < 0.1, name
    assert sum(s.init == "ones" for s in layout.values()) == (2 * 2 + 1) + (4 if family == "qwen3" else 0)
    if arch is None:  # the built-in declarations name exactly what transformers saves
        import transformers

        hf_cfg = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        names = set(hf.state_dict())
        if cfg.tie_word_embeddings:
            names.discard("lm_head.weight")  # a view of the embedding, not saved apart
        assert names == set(sd)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16))  # loads: complete and in shape
    assert type(engine.runner.model).__name__ == ("UnfusedLlama" if arch else "DecoderForCausalLM")


class _Experts(nn.Module):
    """E experts' gate|up stacked as w13 [E, 2I, H] and down as w2 [E, H, I], plus a column-fused pair."""

    E, I, H = 3, 4, 5

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w13 = nn.Parameter(torch.randn(self.E, 2 * self.I, self.H, generator=g))
        self.w2 = nn.Parameter(torch.randn(self.E, self.H, self.I, generator=g))
        self.ab = nn.Parameter(torch.randn(self.H, 2 * self.I, generator=g))  # a | b along columns

    def checkpoint_layout(self, tp_rank: int = 0, tp_size: int = 1) -> dict[str, CheckpointSlot]:
        e, i, h = self.E, self.I, self.H
        layout = {}
        for x in range(e):
            layout[f"experts.{x}.gate_proj.weight"] = part("w13", (i, h), index=(x,))
            layout[f"experts.{x}.up_proj.weight"] = part("w13", (i, h), index=(x,), at=i)
            layout[f"experts.{x}.down_proj.weight"] = CheckpointSlot(param="w2", shape=(h, i), index=(x,))
        layout["a.weight"] = part("ab", (h, i), dim=1)
        layout["b.weight"] = part("ab", (h, i), dim=1, at=i)
        return layout


def test_stacked_and_column_slots_read_and_write_the_right_elements():
    module = _Experts()
    weights = CheckpointWeights(module)
    i, h = module.I, module.H
    where = {  # checkpoint name -> the parameter elements it must be, written by hand
        "experts.1.gate_proj.weight": lambda: module.w13.data[1, :i],
        "experts.1.up_proj.weight": lambda: module.w13.data[1, i:],
        "experts.2.down_proj.weight": lambda: module.w2.data[2],
        "b.weight": lambda: module.ab.data[:, i:],
    }
    for name, elements in where.items():
        assert torch.equal(weights.view(name), elements())
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    g = torch.Generator().manual_seed(1)
    new = {n: torch.randn(weights.layout[n].shape, generator=g) for n in where}
    weights.write_dense("experts.1.gate_proj.weight", new["experts.1.gate_proj.weight"])
    flat = torch.tensor([0, 3, i * h - 1])  # first, middle, last element of the checkpoint tensor
    for name in ("experts.1.up_proj.weight", "experts.2.down_proj.weight", "b.weight"):
        weights.write_patch(name, flat, new[name].reshape(-1)[flat])
    expected = {n: t.clone() for n, t in before.items()}
    expected["w13"][1, :i] = new["experts.1.gate_proj.weight"]
    expected["w13"][1, i:].reshape(-1)[flat] = new["experts.1.up_proj.weight"].reshape(-1)[flat]
    expected["w2"][2].reshape(-1)[flat] = new["experts.2.down_proj.weight"].reshape(-1)[flat]
    b_cols = expected["ab"][:, i:].clone()  # a column slice: written through a non-contiguous view
    b_cols.reshape(-1)[flat] = new["b.weight"].reshape(-1)[flat]
    expected["ab"][:, i:] = b_cols
    for n, p in module.named_parameters():
        assert torch.equal(p.data, expected[n]), n  # those elements changed, no others
    # a whole update session through the same slots: dense, patch (contiguous and strided), then verified
    receiver = WeightReceiver(weights)
    target = {n: torch.randn(s.shape, generator=g) for n, s in weights.layout.items()}
    idx = torch.arange(0, i * h, 3)
    patched = {n: weights.view(n).clone() for n in ("experts.0.down_proj.weight", "a.weight")}
    for n, t in patched.items():
        t.view(-1)[idx] = target[n].view(-1)[idx]
    records = [Dense.of(n, target[n]) for n in target if n not in patched]
    records += [Patch(name=n, indices=PackedIndices.encode(idx), values=t.view(-1)[idx].clone(), checksum=checksum(t))
                for n, t in patched.items()]
    receiver.apply(1, records)
    for n in weights.layout:
        assert torch.equal(weights.view(n), patched.get(n, target[n])), n


def test_deterministic_mode_reaches_every_layer_through_its_own_method():
    cfg = ModelConfig.from_dict({"architectures": [ARCH], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2})
    with torch.device("meta"):
        model = UnfusedLlama(cfg)
    switched = [m for m in model.modules() if hasattr(m, "deterministic")]
    assert any(isinstance(m, UnfusedMLP) for m in switched) and len(switched) > 10
    for flag in (True, False):
        model.set_deterministic(flag)
        assert all(m.deterministic is flag for m in switched)


def _qwen2_cfg(**kw) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, **kw})


def test_sharded_layouts_are_the_hand_computed_slots():
    """Rank 1 of 2 (kv heads split) and rank 3 of 4 (kv heads replicated), head_dim 16."""
    with torch.device("meta"):
        model = DecoderForCausalLM(_qwen2_cfg())
    p = "model.layers.0."
    r1 = model.checkpoint_layout(1, 2)
    assert r1[p + "self_attn.q_proj.weight"] == CheckpointSlot(
        param=p + "self_attn.qkv_proj.weight", shape=(64, 64), dim=0, shard=(32, 64), narrows=((0, 0, 32),))
    assert r1[p + "self_attn.k_proj.weight"] == CheckpointSlot(
        param=p + "self_attn.qkv_proj.weight", shape=(32, 64), dim=0, shard=(16, 32), narrows=((0, 32, 16),))
    assert r1[p + "self_attn.v_proj.bias"] == CheckpointSlot(
        param=p + "self_attn.qkv_proj.bias", shape=(32,), dim=0, shard=(16, 32), narrows=((0, 48, 16),))
    assert r1[p + "self_attn.o_proj.weight"] == CheckpointSlot(
        param=p + "self_attn.o_proj.weight", shape=(64, 64), dim=1, shard=(32, 64), narrows=((1, 0, 32),))
    assert r1[p + "mlp.up_proj.weight"] == CheckpointSlot(
        param=p + "mlp.gate_up_proj.weight", shape=(128, 64), dim=0, shard=(64, 128), narrows=((0, 64, 64),))
    assert r1[p + "mlp.down_proj.weight"] == CheckpointSlot(
        param=p + "mlp.down_proj.weight", shape=(64, 128), dim=1, shard=(64, 128), narrows=((1, 0, 64),))
    assert r1["model.embed_tokens.weight"] == CheckpointSlot(
        param="model.embed_tokens.weight", shape=(256, 64), shard=(128, 256), narrows=((0, 0, 128),))
    assert r1["lm_head.weight"] == CheckpointSlot(
        param="lm_head.weight", shape=(256, 64), shard=(128, 256), narrows=((0, 0, 128),))
    assert r1[p + "input_layernorm.weight"] == CheckpointSlot(
        param=p + "input_layernorm.weight", shape=(64,), shard=(0, 64), init="ones")
    r3 = model.checkpoint_layout(3, 4)  # q heads [3, 4); kv head 1 shared by ranks 2 and 3
    assert r3[p + "self_attn.q_proj.weight"].shard == (48, 64)
    assert r3[p + "self_attn.k_proj.weight"] == CheckpointSlot(
        param=p + "self_attn.qkv_proj.weight", shape=(32, 64), shard=(16, 32), narrows=((0, 16, 16),))
    assert r3[p + "self_attn.v_proj.weight"].narrows == ((0, 32, 16),)
    assert model.checkpoint_layout(2, 4)[p + "self_attn.k_proj.weight"].shard == (16, 32)
    assert model.checkpoint_layout() == model.checkpoint_layout(0, 1)
    with pytest.raises(ValueError, match="intermediate_size=128 is not divisible by tensor_parallel_size=3"):
        model.model.layers[0].mlp.checkpoint_layout(0, 3)


def test_undeclared_modules_hold_their_parameters_whole():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.proj = nn.Linear(3, 2)

    layout = module_layout(Plain(), 1, 2, "head.")
    assert layout == {"head.scale": CheckpointSlot(param="head.scale", shape=(3,)),
                      "head.proj.weight": CheckpointSlot(param="head.proj.weight", shape=(2, 3)),
                      "head.proj.bias": CheckpointSlot(param="head.proj.bias", shape=(2,))}
