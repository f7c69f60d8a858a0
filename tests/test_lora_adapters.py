"""PEFT LoRA adapters (runner/lora/adapters.py) and their device slots (runner/lora/slots.py), against real
adapters written by `peft` on tiny random transformers models: what is read, the scaling (plain and rsLoRA),
every refusal naming its field, and each fused layer's output with the adapter applied through the slots by
`kernels.lora_ref` equal to peft's merged module (float32), for a batch mixing two adapters and the base."""

from __future__ import annotations

import copy
import json
import shutil

import peft
import pytest
import torch

from conftest import load_hf, make_checkpoint
from kernels.lora_ref import add_lora_ref
from runner.lora import (FUSED_MODULES, LORA_MODULES, LoraSlots, adapter_from_peft, lora_module_shapes,
                         peft_tensor_name, read_adapter)
from runner.model_config import ModelConfig


def write_adapter(base_dir, out_dir, *, seed, safe_serialization=True, **lora_kwargs):
    """A PEFT adapter with random A and B (B is not zero-initialised) saved to out_dir; returns the PeftModel."""
    model = load_hf(base_dir)
    torch.manual_seed(seed)
    lora_kwargs.setdefault("target_modules", list(LORA_MODULES))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return peft_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v with bias
def base(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(f"lora_base_{request.param}"), request.param, seed=3)
    return path, ModelConfig.from_dir(path)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Two adapters of one base: rank 4 plain scaling on every module, rank 2 rsLoRA on some."""
    root = tmp_path_factory.mktemp("adapters")
    one = write_adapter(base[0], root / "one", seed=1, r=4, lora_alpha=8)
    two = write_adapter(base[0], root / "two", seed=2, r=2, lora_alpha=3, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "down_proj", "up_proj"])
    return {"one": (root / "one", one), "two": (root / "two", two)}


def _peft_scaling(peft_model) -> float:
    return peft_model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]


def test_reads_what_peft_wrote(base, adapters):
    from safetensors.torch import load_file

    _, cfg = base
    for name, modules, rank in (("one", LORA_MODULES, 4), ("two", ("q_proj", "v_proj", "up_proj", "down_proj"), 2)):
        path, peft_model = adapters[name]
        adapter = read_adapter(path, cfg)
        assert adapter.name == name and adapter.rank == rank
        assert set(adapter.modules) == set(modules)
        assert set(adapter.weights) == {(layer, m) for layer in range(cfg.num_layers) for m in modules}
        stored = load_file(path / "adapter_model.safetensors")
        for (layer, module), (a, b) in adapter.weights.items():
            assert torch.equal(a, stored[peft_tensor_name(layer, module, "A")])
            assert torch.equal(b, stored[peft_tensor_name(layer, module, "B")])
            out, inp = lora_module_shapes(cfg)[module]
            assert a.shape == (rank, inp) and b.shape == (out, rank)
        assert adapter.scaling == pytest.approx(_peft_scaling(peft_model), rel=1e-12)
    assert read_adapter(adapters["one"][0], cfg).scaling == 8 / 4  # lora_alpha / r
    assert read_adapter(adapters["two"][0], cfg).scaling == pytest.approx(3 / 2**0.5)  # lora_alpha / sqrt(r)
    assert read_adapter(adapters["one"][0], cfg, name="other").name == "other"


def _fused_weights(hf_layer, fused):
    """The base model's fused weight [N, in] and bias [N] or None of runtime linear `fused`."""
    parent = hf_layer.self_attn if fused in ("qkv_proj", "o_proj") else hf_layer.mlp
    linears = [getattr(parent, m) for m in FUSED_MODULES[fused]]
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    return weight, bias


def test_slots_with_lora_ref_equal_peft_merged_modules_in_a_mixed_batch(base, adapters):
    base_dir, cfg = base
    plain = load_hf(base_dir)
    merged = {name: copy.deepcopy(pm).merge_and_unload() for name, (_, pm) in adapters.items()}
    slots = LoraSlots(cfg, max_loras=3, max_rank=8, device="cpu", dtype=torch.float32)
    slots.load(0, read_adapter(adapters["one"][0], cfg))
    slots.load(2, read_adapter(adapters["two"][0], cfg))
    which = {-1: plain, 0: merged["one"], 2: merged["two"]}
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([0, -1, 2, 2, 0, -1, 2, 0, 0, 2], dtype=torch.int32)
    with torch.no_grad():
        for layer in range(cfg.num_layers):
            for fused in FUSED_MODULES:
                stack = slots.stack(layer, fused)
                weight, bias = _fused_weights(plain.model.layers[layer], fused)
                x = torch.randn(idx.numel(), weight.shape[1], generator=g)
                out = add_lora_ref(torch.nn.functional.linear(x, weight, bias), x, stack.A, stack.B, idx,
                                   slots.scaling, slices=stack.slices)
                for t, slot in enumerate(idx.tolist()):
                    w, b = _fused_weights(which[slot].model.layers[layer], fused)
                    expect = torch.nn.functional.linear(x[t], w, b)
                    torch.testing.assert_close(out[t], expect, rtol=1e-5, atol=1e-5, msg=f"{layer} {fused} {t}")
    # the slot-0 adapter really changes every fused layer (the comparison above is not base against base)
    w1, _ = _fused_weights(merged["one"].model.layers[0], "qkv_proj")
    assert not torch.allclose(w1, _fused_weights(plain.model.layers[0], "qkv_proj")[0], atol=1e-4)


def test_load_zero_pads_and_replaces_what_the_slot_held(base, adapters):
    _, cfg = base
    one, two = (read_adapter(adapters[n][0], cfg) for n in ("one", "two"))
    slots = LoraSlots(cfg, max_loras=3, max_rank=8, device="cpu", dtype=torch.float64)
    slots.load(2, one)
    before = {k: (s.A[2].clone(), s.B[2].clone()) for k, s in slots.stacks.items()}
    slots.load(1, one)
    slots.load(1, two)  # rank 2 over rank 4, fewer modules
    assert slots.ranks == [0, 2, 4] and slots.scaling[1].item() == pytest.approx(two.scaling)
    expected = {key: [torch.zeros_like(s.A[1]), torch.zeros_like(s.B[1])] for key, s in slots.stacks.items()}
    for (layer, module), (a, b) in two.weights.items():
        fused = next(f for f, ms in FUSED_MODULES.items() if module in ms)
        i = FUSED_MODULES[fused].index(module)
        row0 = sum(lora_module_shapes(cfg)[m][0] for m in FUSED_MODULES[fused][:i])
        expected[(layer, fused)][0][i * 8:i * 8 + 2] = a
        expected[(layer, fused)][1][row0:row0 + b.shape[0], :2] = b
    for key, stack in slots.stacks.items():
        assert torch.equal(stack.A[1], expected[key][0]) and torch.equal(stack.B[1], expected[key][1]), key
        assert torch.equal(stack.A[2], before[key][0]) and torch.equal(stack.B[2], before[key][1]), key
        assert not stack.A[0].any() and not stack.B[0].any()
    views = slots.views(1)
    assert set(views) == set(two.weights)
    for key, (a, b) in two.weights.items():
        assert views[key][0].dtype == torch.float64 and torch.equal(views[key][0], a.double())
        assert torch.equal(views[key][1], b.double())
    slots.clear(1)
    assert slots.ranks[1] == 0 and slots.scaling[1].item() == 0
    assert all(not s.A[1].any() and not s.B[1].any() for s in slots.stacks.values())
    with pytest.raises(ValueError, match="slot 1 holds no adapter"):
        slots.views(1)


def test_views_are_the_slots_storage_under_peft_names(base, adapters):
    from safetensors.torch import load_file

    _, cfg = base
    slots = LoraSlots(cfg, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    slots.load(1, read_adapter(adapters["one"][0], cfg))
    named = slots.named_views(1)
    assert set(named) == set(load_file(adapters["one"][0] / "adapter_model.safetensors"))
    name = peft_tensor_name(1, "k_proj", "B")
    assert named[name].shape == (cfg.num_kv_heads * cfg.head_dim, 4)
    named[name].fill_(7.0)  # a push writes here
    q = cfg.num_heads * cfg.head_dim
    assert (slots.stack(1, "qkv_proj").B[1, q:q + named[name].shape[0]] == 7.0).all()
    assert not (slots.stack(1, "qkv_proj").B[1, :q] == 7.0).any()


def test_slots_refuse_without_writing(base, adapters, tmp_path):
    _, cfg = base
    one = read_adapter(adapters["one"][0], cfg)
    attention_only = LoraSlots(cfg, max_loras=2, max_rank=8, device="cpu", dtype=torch.float32,
                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert set(k for _, k in attention_only.stacks) == {"qkv_proj", "o_proj"}
    with pytest.raises(ValueError, match="module (gate|up|down)_proj has no slots"):
        attention_only.load(0, one)
    assert attention_only.ranks == [0, 0] and all(not s.A.any() for s in attention_only.stacks.values())
    small = LoraSlots(cfg, max_loras=2, max_rank=2, device="cpu", dtype=torch.float32)
    small.load(0, read_adapter(adapters["two"][0], cfg))
    kept = {k: s.A[0].clone() for k, s in small.stacks.items()}
    with pytest.raises(ValueError, match="rank 4 exceeds max_rank 2"):
        small.load(0, one)
    assert small.ranks[0] == 2 and all(torch.equal(s.A[0], kept[k]) for k, s in small.stacks.items())
    with pytest.raises(ValueError, match=r"slot must be an integer in \[0, 2\)"):
        small.load(2, one)
    with pytest.raises(ValueError, match="max_rank must be"):
        LoraSlots(cfg, max_loras=2, max_rank=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="max_loras must be"):
        LoraSlots(cfg, max_loras=0, max_rank=4, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="target_modules must be among"):
        LoraSlots(cfg, max_loras=1, max_rank=4, device="cpu", dtype=torch.float32, target_modules=("lm_head",))


# ---- refusals: each names the field or tensor at fault -------------------------------------------------------
def _edited(src, dst, config=None, drop=(), tensors=None):
    """A copy of adapter `src` at `dst` with config keys set (None: removed), tensors dropped or replaced."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg_file = dst / "adapter_config.json"
    raw = json.loads(cfg_file.read_text())
    for key, value in (config or {}).items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    cfg_file.write_text(json.dumps(raw))
    weights = load_file(dst / "adapter_model.safetensors")
    for name in drop:
        del weights[name]
    weights |= {k: v(weights) if callable(v) else v for k, v in (tensors or {}).items()}
    save_file(weights, dst / "adapter_model.safetensors")
    return dst


A0 = peft_tensor_name(0, "q_proj", "A")
B0 = peft_tensor_name(0, "q_proj", "B")


@pytest.mark.parametrize("edit, match", [
    (dict(config={"peft_type": "IA3"}), "peft_type must be 'LORA'"),
    (dict(config={"bias": "lora_only"}), "bias='lora_only' is not supported"),
    (dict(config={"fan_in_fan_out": True}), "fan_in_fan_out=True is not supported"),
    (dict(config={"rank_pattern": {"q_proj": 2}}), "rank_pattern="),
    (dict(config={"alpha_pattern": {"q_proj": 2}}), "alpha_pattern="),
    (dict(config={"lora_bias": True}), "lora_bias=True"),
    (dict(config={"target_modules": ["q_proj", "lm_head"]}), "target_modules has 'lm_head'"),
    (dict(config={"r": 0}), "r must be a positive integer"),
    (dict(config={"r": 5}), "differs from the config's r=5"),
    (dict(config={"lora_alpha": None}), "lora_alpha must be a finite number"),
    (dict(config={"use_rslora": "yes"}), "use_rslora must be true or false"),
    (dict(config={"some_new_option": {"on": True}}), "unknown option some_new_option="),
    (dict(tensors={A0: lambda w: w[A0][:3]}), "rank mismatch between lora_A"),
    (dict(drop=[B0]), "q_proj.lora_B.weight is missing"),
    (dict(tensors={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "'base_model.model.lm_head"),
    (dict(tensors={peft_tensor_name(9, "q_proj", "A"): lambda w: w[A0].clone(),
                  peft_tensor_name(9, "q_proj", "B"): lambda w: w[B0].clone()}),
     "layer 9 is past the model's 2"),
    (dict(tensors={A0: lambda w: torch.full_like(w[A0], float("nan"))}), "has non-finite values"),
    (dict(tensors={A0: lambda w: w[A0][:, :32].contiguous()}), r"do not match the base model's q_proj \[64, 64\]"),
])
def test_refusals_name_the_field(base, adapters, tmp_path, edit, match):
    _, cfg = base
    path = _edited(adapters["one"][0], tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=match):
        read_adapter(path, cfg)


def test_refuses_peft_written_variants_and_pickle(base, tmp_path):
    base_dir, cfg = base
    cases = [(dict(use_dora=True), "use_dora=True is not supported"),
             (dict(modules_to_save=["lm_head"]), "modules_to_save=\\['lm_head'\\] is not supported"),
             (dict(safe_serialization=False), "no adapter_model.safetensors .*pickle")]
    for i, (kwargs, match) in enumerate(cases):
        write_adapter(base_dir, tmp_path / str(i), seed=i, r=2, lora_alpha=2, **kwargs)
        with pytest.raises(ValueError, match=match):
            read_adapter(tmp_path / str(i), cfg)


def test_refuses_shapes_of_another_base_and_mlp_targets_of_moe(base, adapters, tmp_path):
    _, cfg = base
    path = adapters["one"][0]
    wider = copy.deepcopy(cfg)
    wider.intermediate_size = 96
    with pytest.raises(ValueError, match=r"layer 0 down_proj: shapes .* do not match the base model's down_proj \[64, 96"):
        read_adapter(path, wider)
    moe = ModelConfig.from_dir(make_checkpoint(tmp_path / "moe", "qwen3_moe", num_hidden_layers=1))
    assert "gate_proj" not in lora_module_shapes(moe) and "q_proj" in lora_module_shapes(moe)
    with pytest.raises(ValueError, match="target_modules has '(gate|up|down)_proj'"):
        read_adapter(path, moe)
    config = json.loads((path / "adapter_config.json").read_text()) | {"target_modules": "all-linear"}
    tensors = {peft_tensor_name(0, "gate_proj", "A"): torch.zeros(4, 64),
               peft_tensor_name(0, "gate_proj", "B"): torch.zeros(32, 4)}
    with pytest.raises(ValueError, match="gate_proj is not an adapter target of this model"):
        adapter_from_peft("x", config, tensors, moe)
    with pytest.raises(ValueError, match="has no lora_A / lora_B tensors"):
        adapter_from_peft("x", config, {}, cfg)
