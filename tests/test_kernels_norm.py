"""Triton rms_norm / fused_add_rms_norm against the torch references.

Tolerances: float32 relative 1e-5; float16 / bfloat16 two ulps of the output (the normalized value may
be one ulp off before the weight multiply, whose rounding can add another; checked as relative 2**-9 for
fp16 and 2**-6 for bf16, plus a tiny absolute floor); the residual sum must be bitwise equal.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}
CPU_DTYPES = [torch.float32, torch.float16]


def _rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[ref.dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_matches_ref(dtype):
    x = _rand(2, 5, 96, dtype=dtype, seed=0) * 3  # [..., H] with H not a power of two
    w = _rand(96, dtype=dtype, seed=1)
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fused_add_rms_norm_matches_ref(dtype):
    x = _rand(7, 64, dtype=dtype, seed=2)
    residual = _rand(7, 64, dtype=dtype, seed=3) * 10
    w = _rand(64, dtype=dtype, seed=4)
    out, summed = fused_add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_sum = fused_add_rms_norm_ref(x, residual, w, 1e-5)
    assert torch.equal(summed, ref_sum)
    _close(out, ref_out)


def test_fused_add_rms_norm_on_strided_rows():
    base = _rand(4, 2 * 32, dtype=torch.float32, seed=5)
    x, residual = base[:, :32], base[:, 32:]  # row stride 64
    w = _rand(32, dtype=torch.float32, seed=6)
    out, summed = fused_add_rms_norm(x, residual, w, 1e-6)
    ref_out, ref_sum = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    assert torch.equal(summed, ref_sum)
    _close(out, ref_out)


def test_norm_rejects_misuse():
    x = _rand(3, 16, dtype=torch.float32, seed=7)
    w = _rand(16, dtype=torch.float32, seed=8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:8], 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w.half(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x[:2], w, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), _rand(3, dtype=torch.float32, seed=9), 1e-6)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_qwen_hidden_matches_ref(dtype):
    x = _rand(4096, 896, dtype=dtype, seed=10)
    residual = _rand(4096, 896, dtype=dtype, seed=11) * 4
    w = _rand(896, dtype=dtype, seed=12)
    out, summed = fused_add_rms_norm(x, residual, w, 1e-6)
    ref_out, ref_sum = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    assert torch.equal(summed, ref_sum)
    _close(out, ref_out)
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def test_norms_write_into_given_out_and_check_it():
    x, r = torch.randn(6, 32, device=DEVICE), torch.randn(6, 32, device=DEVICE)
    w = torch.randn(32, device=DEVICE)
    out = torch.full((6, 32), float("nan"), device=DEVICE)
    rms_norm(x, w, 1e-6, out)
    assert torch.equal(out, rms_norm(x, w, 1e-6))
    normed, summed = fused_add_rms_norm(x, r, w, 1e-6, out)
    assert normed is out and torch.equal(out, fused_add_rms_norm(x, r, w, 1e-6)[0])
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, w, 1e-6, torch.empty(6, 32, dtype=torch.float16, device=DEVICE))
