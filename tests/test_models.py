"""The engine's model code against transformers: logits at every position, greedy continuations."""

from __future__ import annotations

import pytest
import torch

from conftest import load_hf, variant_id
from rollout import Engine, EngineConfig, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 500000.0}),
    ("llama", {"attention_bias": True}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),
    ("mistral", {}),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_logits_match_transformers_at_every_position(ckpt_factory, variant):
    family, overrides = variant
    path = ckpt_factory(family, **overrides)
    hf = load_hf(path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, num_kv_blocks=64))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (150,), generator=g).tolist()  # crosses llama3's 64-token original context
    ours = engine.collective_rpc("full_sequence_logits", tokens)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert ref.std() > 0.5, "logits too flat for a meaningful comparison"
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


PROMPTS = [
    [5, 9, 13, 2, 7],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62],
    [100],
    list(range(3, 60)),
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
]


def _hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(
    "family,engine_kw",
    [
        ("llama", {}),
        ("qwen2", {"max_num_batched_tokens": 8}),  # chunked prefill
        ("qwen3", {"num_kv_blocks": 24, "block_size": 4}),  # so few blocks that requests get preempted
        ("llama", {"max_num_batched_tokens": 5, "num_kv_blocks": 12, "block_size": 8, "max_num_seqs": 3}),
    ],
)
def test_greedy_matches_transformers(ckpt_factory, family, engine_kw):
    path = ckpt_factory(family)
    hf = load_hf(path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", **{"max_num_seqs": 8, **engine_kw}))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 32), prompt
        assert out.outputs[0].finish_reason == "length"
    if "num_kv_blocks" in engine_kw:
        assert engine.scheduler.stats.num_preemptions > 0
        assert any(o.outputs[0].num_preemptions > 0 for o in outs)
    if engine_kw.get("max_num_batched_tokens", 8192) < 20:
        assert engine.scheduler.stats.num_steps > len(PROMPTS[3]) // engine_kw["max_num_batched_tokens"]


def test_bfloat16_checkpoint_loads_and_follows_transformers(ckpt_factory):
    path = ckpt_factory("qwen2", dtype=torch.bfloat16)
    engine = Engine(EngineConfig(model=str(path), dtype="auto", max_num_seqs=4, num_kv_blocks=32))
    assert engine.runner.dtype == torch.bfloat16
    hf = load_hf(path, dtype=torch.bfloat16)
    tokens = list(range(10, 40))
    ours = engine.collective_rpc("full_sequence_logits", tokens)[0].float()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    # bf16 activations: compare the predicted tokens and a loose tolerance
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)


def test_sliding_window_models_stay_within_the_window(ckpt_factory):
    """Inside its window sliding-window attention is full attention: the engine caps max_model_len there
    (and refuses an explicit larger one), and matches transformers' logits up to the window."""
    path = ckpt_factory("mistral", sliding_window=48)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, num_kv_blocks=64))
    assert engine.max_model_len == 48
    with pytest.raises(ValueError, match="sliding_window=48"):
        Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=100, num_kv_blocks=64))
    tokens = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = load_hf(path)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(engine.collective_rpc("full_sequence_logits", tokens)[0], ref, atol=1e-4, rtol=1e-4)
    qwen = ckpt_factory("qwen2", use_sliding_window=True, sliding_window=40, max_window_layers=0)
    assert Engine(EngineConfig(model=str(qwen), dtype="float32", num_kv_blocks=64)).max_model_len == 40


def test_dummy_load_format_draws_weights_without_reading_a_checkpoint(ckpt_factory, tmp_path):
    """load_format="dummy": only config.json is read; every slot is drawn (seeded: same seed, same weights;
    norms near 1, the rest about N(0, 0.02^2)), and the engine generates."""
    (tmp_path / "config.json").write_bytes((ckpt_factory("qwen3_moe") / "config.json").read_bytes())
    engines = [Engine(EngineConfig(model=str(tmp_path), dtype="float32", load_format="dummy", seed=s,
                                   num_kv_blocks=16)) for s in (0, 0, 1)]
    views = [e.runner.weights for e in engines]
    for name in views[0].layout:
        a, b, c = (w.view(name) for w in views)
        assert torch.equal(a, b) and not torch.equal(a, c), name
        if name.endswith("norm.weight"):
            assert (a - 1).abs().max() < 0.1, name
        else:
            assert 0.015 < a.std() < 0.025, name
    out = engines[0].generate([[3, 4, 5]], SamplingParams(max_tokens=4, seed=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="load_format must be 'safetensors' or 'dummy', got 'npz'"):
        EngineConfig(model=str(tmp_path), load_format="npz")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_fused_small_batch_kernels_follow_the_unfused_layers(ckpt_factory, family, monkeypatch):
    """Decode rows through the fused norm / activation + GEMV kernels (kernels/gemv.py, which the engine turns on
    by default at one row; switched on here by hand for up to 4, on the CPU in Triton's interpreter) give the
    tokens and, within 1e-4, the logprobs of the unfused layers. The fused kernel must actually have run."""
    import kernels.gemv

    calls = []
    real = kernels.gemv.fused_gemv
    monkeypatch.setattr(kernels.gemv, "fused_gemv", lambda *a, **kw: calls.append(kw.get("prologue", "none")) or real(*a, **kw))
    path = ckpt_factory(family)
    prompts = [[3, 9, 27, 31, 5], [7, 7, 2]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for rows in (0, 4):
        engine = Engine(EngineConfig(model=str(path), max_num_seqs=4, device=DEVICE))
        engine.runner.model.set_gemv_rows(rows)
        outs.append([r.outputs[0] for r in engine.generate(prompts, params)])
        engine.close()
    kinds = set(calls)
    assert kinds == ({"rms_norm", "none"} if family == "qwen3_moe" else {"rms_norm", "none", "silu_mul"})
    for ref, fused in zip(*outs):
        assert fused.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(fused.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_cuda_kernels_follow_the_cpu_path_in_float32(ckpt_factory, family):
    """The CUDA engine with its default kernels (graphs, the batch-1 GEMV path, Qwen3's q / k norms inside the
    rotary kernel, split-KV attention) against the CPU engine's torch path, float32: the same greedy tokens, and
    the logprobs within 1e-4, at batch 1 and at batch 3."""
    path = ckpt_factory(family)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompts in ([[3, 9, 27, 31, 5]], [[3, 9, 27, 31, 5], [7, 7, 2], list(range(2, 40))]):
        outs = []
        for device in ("cpu", "cuda"):
            engine = Engine(EngineConfig(model=str(path), max_num_seqs=4, device=device))
            outs.append([r.outputs[0] for r in engine.generate(prompts, params)])
            engine.close()
        for cpu, cuda in zip(*outs):
            assert cuda.token_ids == cpu.token_ids
            torch.testing.assert_close(torch.tensor(cuda.logprobs), torch.tensor(cpu.logprobs), rtol=0, atol=1e-4)
