"""LoRA in the engine on CUDA (skipped without CUDA), float32 on a tiny random Llama with real PEFT adapters: the
decode graphs (captured once, before any adapter is loaded) give what eager steps give for a batch mixing the base
and two adapters, and what peft gives, also when the adapter requests finish first and the last steps replay the
graphs captured without LoRA; an adapter swapped under the same name and an adapter push are served by
the same graphs (the slots are written in place); the Triton path's logits match peft's; `lora_overlap` on and off
give the same tokens and logprobs, through the graphs and eagerly."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import load_hf, make_checkpoint
from rollout import Engine, EngineConfig, SamplingParams
from test_lora_engine import PROMPTS, hf_greedy, peft_model, write_adapter
from trainer_bridge import TrainerBridge

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_lora")
    base = make_checkpoint(root / "base", "llama", seed=3)
    adapters = {"a": write_adapter(base, root / "a", seed=1, r=4, lora_alpha=8),
                "b": write_adapter(base, root / "b", seed=2, r=2, lora_alpha=3, use_rslora=True,
                                   target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
                "c": write_adapter(base, root / "c", seed=5, r=8, lora_alpha=4)}
    return base, adapters


def _engine(base, **kw) -> Engine:
    return Engine(EngineConfig(model=str(base), device="cuda", dtype="float32", max_loras=3, max_lora_rank=8,
                               num_kv_blocks=64, max_num_seqs=8, **kw))


def test_graphs_serve_mixed_adapters_swaps_and_pushes(setup):
    base, adapters = setup
    graphs, eager = _engine(base), _engine(base, enforce_eager=True)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    for e in (graphs, eager):
        e.load_lora("x", str(adapters["a"]))
        e.load_lora("y", str(adapters["b"]))
    loras = [None, "x", "y", "x", None, "y"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora=lora) for lora in loras]
    got, want = graphs.generate(prompts, params), eager.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert g.outputs[0].logprobs == pytest.approx(w.outputs[0].logprobs, abs=1e-4)
    # adapter requests finishing first: the last decode steps replay the graphs captured without LoRA
    replayed, plain = [], graphs.runner.graphs.replay

    def recording(size, truncation=False, lora=False):
        replayed.append(lora)
        return plain(size, truncation, lora)

    graphs.runner.graphs.replay = recording
    short = [SamplingParams(temperature=0, max_tokens=4 if lora else 10, ignore_eos=True, lora=lora) for lora in loras]
    try:
        got_short = graphs.generate(prompts, short)
    finally:
        del graphs.runner.graphs.replay
    assert True in replayed and False in replayed, replayed
    assert replayed == sorted(replayed, reverse=True)  # LoRA while adapter requests run, then without
    assert ([o.outputs[0].token_ids for o in got_short] ==
            [o.outputs[0].token_ids for o in eager.generate(prompts, short)])
    models = {None: load_hf(base), "x": peft_model(base, adapters["a"]), "y": peft_model(base, adapters["b"])}
    for prompt, lora, out in zip(prompts, loras, got):
        assert out.outputs[0].token_ids == hf_greedy(models[lora], prompt, 8), lora
    # the Triton path's logits (a prefill of one sequence)
    tokens = list(range(3, 40))
    graphs.step()
    slot = next(i.slot for i in graphs.list_loras() if i.name == "x")
    with torch.no_grad():
        ref = models["x"](torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(graphs.collective_rpc("full_sequence_logits", tokens, slot)[0].cpu(), ref,
                               atol=1e-4, rtol=1e-4)
    # swapped under the same name, after the graphs were captured
    graphs.unload_lora("x")
    graphs.load_lora("x", str(adapters["c"]))
    swapped = peft_model(base, adapters["c"])
    x_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="x")
    for prompt, out in zip(PROMPTS, graphs.generate(PROMPTS, x_params)):
        assert out.outputs[0].token_ids == hf_greedy(swapped, prompt, 8)
    # pushed: a patch of the swapped adapter, served by the same graphs
    bridge = TrainerBridge(graphs, lora="x")
    bridge.push_weights(swapped)
    with torch.no_grad():
        for name, p in swapped.named_parameters():
            if ".lora_B." in name:
                p[0] += 0.5
    assert bridge.push_weights(swapped).num_patch > 0
    merged = copy.deepcopy(swapped).merge_and_unload()
    for prompt, out in zip(PROMPTS, graphs.generate(PROMPTS, x_params)):
        assert out.outputs[0].token_ids == hf_greedy(merged, prompt, 8)
        assert out.outputs[0].lora_versions == [2] * 8


def test_lora_overlap_on_and_off_give_the_same_tokens(setup):
    """The overlapped hooks (shrink on the side stream beside the matmul) against the hooks after cuBLAS's matmul
    (`lora_fused_linear` off in both: its Triton GEMM rounds otherwise), with the decode graphs and eagerly: the
    same greedy tokens and the same logprobs (the kernels' bits agree)."""
    base, adapters = setup
    loras = [None, "x", "y", "x", "y", None, "x", "y"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, lora=lora) for lora in loras]
    results = {}
    for eager in (False, True):
        for overlap in (True, False):
            engine = _engine(base, lora_overlap=overlap, lora_fused_linear=False, enforce_eager=eager)
            assert engine.runner.lora.overlap is overlap
            assert (engine.runner.graphs is None) is eager
            engine.load_lora("x", str(adapters["a"]))
            engine.load_lora("y", str(adapters["c"]))
            outs = engine.generate(prompts, params)
            assert (engine.runner.lora._side is not None) is overlap  # the overlapped hooks ran
            results[eager, overlap] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs])
            engine.close()
        assert results[eager, True] == results[eager, False], eager
    assert results[False, True][0] == results[True, True][0]  # graphs and eager: the same tokens


@pytest.mark.parametrize("mode", ["lora_deferred", "lora_fused_linear"])
def test_deferred_and_fused_linear_modes_through_graphs_and_eagerly_give_peft_tokens(setup, monkeypatch, mode):
    """`lora_deferred` (o_proj's and down_proj's deltas into the residual sum, gate_up_proj's left to the
    SiLU-and-mul, qkv_proj's added after the matmul, each computed on the side stream beside its matmul) and
    `lora_fused_linear` (each adapted linear of a decode step and its LoRA in one Triton launch), with the decode
    graphs and eagerly: peft's greedy tokens for a batch mixing the base and two adapters, the mode's path taken
    (the side stream used; the one-launch kernel called, captures included, at decode sizes only), and logprobs
    within float32 rounding of the default hooks'."""
    import kernels.lora_linear as lora_linear

    base, adapters = setup
    calls = []
    real = lora_linear.linear_lora
    monkeypatch.setattr(lora_linear, "linear_lora", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    loras = [None, "x", "y", "x", "y", None, "x", "y"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, lora=lora) for lora in loras]
    models = {None: load_hf(base), "x": peft_model(base, adapters["a"]), "y": peft_model(base, adapters["c"])}
    want = [hf_greedy(models[lora], prompt, 10) for lora, prompt in zip(loras, prompts)]
    logprobs = {}
    for eager, on in ((False, True), (True, True), (False, False)):
        calls.clear()
        engine = _engine(base, enforce_eager=eager, **({"lora_fused_linear": False} | {mode: on}))
        engine.load_lora("x", str(adapters["a"]))
        engine.load_lora("y", str(adapters["c"]))
        outs = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want, (eager, on)
        if mode == "lora_deferred":
            assert (engine.runner.lora._side is not None) is on  # the deferred hooks forked
        else:
            assert bool(calls) is on and all(0 < t <= 64 for t in calls), (eager, on)
        logprobs[eager, on] = [o.outputs[0].logprobs for o in outs]
        engine.close()
    for key in ((False, True), (True, True)):
        for got, ref in zip(logprobs[key], logprobs[False, False]):
            assert got == pytest.approx(ref, abs=1e-4), key
