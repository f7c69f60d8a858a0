"""Batch-invariant Triton matmul: matches F.linear, and on CUDA a row's result is bitwise independent
of the batch it is computed in (the interpreter's numpy dot gives no such guarantee, so that check is
CUDA-only)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.matmul import batch_invariant_linear, block_n  # noqa: E402
from kernels.matmul_ref import batch_invariant_linear_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 40, False), (5, 70, 33, True), (67, 16, 64, True)])
def test_matches_linear_fp32(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    out = batch_invariant_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.cpu(), batch_invariant_linear_ref(x.cpu(), w.cpu(), None if b is None else b.cpu()),
                               atol=1e-4, rtol=1e-4)


def test_column_tile_depends_on_the_weight_only():
    assert (block_n(896), block_n(4864), block_n(9728)) == (16, 32, 64)


def test_leading_dims_and_errors():
    x = torch.randn(2, 3, 16).to(DEVICE)
    w = torch.randn(8, 16).to(DEVICE)
    assert batch_invariant_linear(x, w).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="weight must be"):
        batch_invariant_linear(x, torch.randn(8, 15).to(DEVICE))
    with pytest.raises(ValueError, match="share one of"):
        batch_invariant_linear(x, w.half())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [896, 4864, 9728])  # column tiles of 16, 32 and 64
def test_rows_are_batch_invariant_on_cuda(dtype, n):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, 896, generator=g) * 0.02).to("cuda", dtype)
    x = torch.randn(300, 896, generator=g).to("cuda", dtype)
    full = batch_invariant_linear(x, w)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 67), slice(250, 300)):
        assert torch.equal(batch_invariant_linear(x[rows], w), full[rows])
    fast = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(full.float(), fast.float(), atol=2e-2, rtol=2e-2)
