"""Triton apply_rotary against apply_rotary_ref: float16 / bfloat16 bitwise, float32 within 1e-6."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.rotary import apply_rotary  # noqa: E402
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
