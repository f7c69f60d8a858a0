"""Triton apply_rotary against apply_rotary_ref: float16 / bfloat16 bitwise, float32 within 1e-6; the fused
rotary_store_kv against apply_rotary + store_kv, bitwise."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.attention import store_kv  # noqa: E402
from kernels.rotary import apply_rotary, rotary_store_kv  # noqa: E402
from kernels.rotary_ref import apply_rotary_ref, build_cos_sin_cache, rope_inv_freq  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _case(num_tokens, hq, hkv, head_dim, dtype, max_pos=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype).to(DEVICE)
    query = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)  # strided views of a fused qkv, as in a model
    key = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(num_tokens, hkv, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    cache = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, None), max_pos).to(DEVICE)
    return query, key, positions, cache


def _assert_matches(out, ref):
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    else:
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 32), (torch.float16, 16), (torch.float16, 24)])
def test_rotary_matches_ref(dtype, head_dim):
    query, key, positions, cache = _case(9, 4, 2, head_dim, dtype)
    q, k = apply_rotary(query, key, positions, cache)
    q_ref, k_ref = apply_rotary_ref(query, key, positions, cache)
    _assert_matches(q, q_ref)
    _assert_matches(k, k_ref)


def test_rotary_in_place_overwrites_inputs():
    query, key, positions, cache = _case(5, 2, 1, 16, torch.float16, seed=1)
    q_ref, k_ref = apply_rotary_ref(query, key, positions, cache)
    q, k = apply_rotary(query, key, positions, cache, inplace=True)
    assert q.data_ptr() == query.data_ptr() and k.data_ptr() == key.data_ptr()
    _assert_matches(query, q_ref)
    _assert_matches(key, k_ref)


def test_rotary_rejects_misuse():
    query, key, positions, cache = _case(3, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(query, key, positions[:2], cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(query, key, positions, cache[:, :8])
    with pytest.raises(ValueError, match="share one of"):
        apply_rotary(query, key.half(), positions, cache)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(query[..., :15], key[..., :15], positions, cache[:, :15])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_qwen_shapes_match_ref(dtype):
    query, key, positions, cache = _case(4096, 14, 2, 64, dtype, max_pos=32768, seed=2)
    q, k = apply_rotary(query, key, positions, cache)
    q_ref, k_ref = apply_rotary_ref(query, key, positions, cache)
    _assert_matches(q, q_ref)
    _assert_matches(k, k_ref)


def _fused_vs_separate(num_tokens, hq, hkv, head_dim, dtype, seed, slot_stride=1):
    """(fused caches, query), (separate caches, query) for one step; some tokens are padding (slot -1)."""
    query, key, positions, cache = _case(num_tokens, hq, hkv, head_dim, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    value = torch.randn(num_tokens, hkv, head_dim, generator=gen).to(dtype).to(DEVICE)
    num_blocks, block_size = 6, 4
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding rows: not stored
    slot_mapping = torch.stack([slots] * slot_stride, 1).reshape(-1)[::slot_stride].to(DEVICE)  # a strided view
    shape = (num_blocks, block_size, hkv, head_dim)
    results = []
    for fused in (True, False):
        k_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)  # untouched slots keep 7
        v_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
        q, k = query.clone(), key.clone()
        if fused:
            q = rotary_store_kv(q, k, value, positions, cache, k_cache, v_cache, slot_mapping)
            assert torch.equal(k, key)  # the key itself is left as it was
        else:
            q, k = apply_rotary(q, k, positions, cache)
            store_kv(k, value, k_cache, v_cache, slot_mapping)
        results.append((q, k_cache, v_cache))
    return results


@pytest.mark.parametrize("dtype,head_dim,slot_stride", [(torch.float32, 32, 1), (torch.float16, 16, 3), (torch.float16, 24, 1)])
def test_fused_rotary_store_writes_what_rotary_then_store_write(dtype, head_dim, slot_stride):
    (q_f, k_f, v_f), (q_s, k_s, v_s) = _fused_vs_separate(10, 4, 2, head_dim, dtype, seed=3, slot_stride=slot_stride)
    assert torch.equal(q_f, q_s) and torch.equal(k_f, k_s) and torch.equal(v_f, v_s)
    assert (k_f == 7.0).all(dim=(2, 3)).sum() == 6 * 4 - 6  # the 4 padding rows stored nothing (10 tokens, 4 padding)


def test_fused_rotary_store_rejects_misuse():
    query, key, positions, cache = _case(3, 2, 1, 16, torch.float32)
    value = torch.zeros_like(key)
    k_cache = torch.zeros(4, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_kv(query, key, value, positions, cache, k_cache, k_cache.clone(), positions[:2])
    with pytest.raises(ValueError, match="key and value"):
        rotary_store_kv(query, key, value[:, :, :8], positions, cache, k_cache, k_cache.clone(), positions)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fused_rotary_store_at_qwen_shapes(dtype):
    (q_f, k_f, v_f), (q_s, k_s, v_s) = _fused_vs_separate(24, 14, 2, 64, dtype, seed=4)
    assert torch.equal(q_f, q_s) and torch.equal(k_f, k_s) and torch.equal(v_f, v_s)


@pytest.mark.skipif(CUDA, reason="drives the CPU engine through the interpreter; GPU engine tests take this path by default")
def test_paged_model_step_through_the_fused_kernel_matches_the_torch_path(ckpt_factory, monkeypatch):
    """The engine's CUDA attention path (fused rotary + KV store, Triton paged attention), run here in the
    interpreter on float32, generates what the torch path generates: the same greedy tokens through
    prefill, chunked prefill and decode, logprobs within 1e-4. Qwen3 (q/k norms) keeps the layers off
    the CPU-only fast path."""
    from kernels.attention import paged_attention
    from rollout import Engine, EngineConfig, SamplingParams
    from runner.models import llama

    model = ckpt_factory("qwen3", seed=8)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32, block_size=4, max_num_batched_tokens=8)
    torch_path = Engine(config).generate(prompts, params)

    engine = Engine(config)
    backend = engine.runner.backend
    monkeypatch.setattr(backend, "use_triton", True)
    monkeypatch.setattr(backend, "_store", store_kv)
    monkeypatch.setattr(backend, "_attend", paged_attention)
    make = llama.Rotary.make
    monkeypatch.setattr(llama.Rotary, "make", classmethod(
        lambda cls, positions, cache, dtype, dense, deterministic=False: llama.Rotary(positions, cache, None)
        if not dense else make(positions, cache, dtype, dense, deterministic)))
    calls, fused = [], llama.Rotary.apply_and_store
    monkeypatch.setattr(llama.Rotary, "apply_and_store", lambda self, *a: calls.append(1) or fused(self, *a))
    kernel_path = engine.generate(prompts, params)
    assert calls  # the fused kernel served the steps
    for a, b in zip(torch_path, kernel_path):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(b.outputs[0].logprobs), torch.tensor(a.outputs[0].logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 32), (torch.float16, 16)] +
                         ([(torch.bfloat16, 128)] if CUDA else []))
def test_fused_rotary_store_with_head_norms(dtype, head_dim):
    """norms=(q_norm, k_norm, eps): each head RMS-normalised before its rotation, against rms_norm_ref then
    rotary + store (float32 within 1e-5; float16 / bfloat16 within two ulps: the mean of squares is summed in
    another order, which can move the normalised value by one ulp, and the rotation's roundings by one more)."""
    from kernels.norm_ref import rms_norm_ref

    query, key, positions, cache = _case(7, 4, 2, head_dim, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    value = torch.randn(7, 2, head_dim, generator=gen).to(dtype).to(DEVICE)
    q_w, k_w = (torch.randn(head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    slot_mapping = torch.arange(7, device=DEVICE)
    k_cache = torch.zeros(2, 4, 2, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = rotary_store_kv(query.clone(), key, value, positions, cache, k_cache, v_cache, slot_mapping,
                        norms=(q_w, k_w, 1e-6))
    q_ref, k_ref = apply_rotary_ref(rms_norm_ref(query, q_w, 1e-6), rms_norm_ref(key, k_w, 1e-6), positions, cache)
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=rtol, atol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(k_cache.view(-1, 2, head_dim)[:7].float(), k_ref.float(), rtol=rtol,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(v_cache.view(-1, 2, head_dim)[:7], value)
    with pytest.raises(ValueError, match="k_norm"):
        rotary_store_kv(query.clone(), key, value, positions, cache, k_cache, v_cache, slot_mapping,
                        norms=(q_w, k_w[:-2], 1e-6))
