"""Deterministic mode's linear layer (GEMMs over fixed-shape row blocks): matches F.linear on any device,
and on CUDA a row's result is bitwise independent of the batch it is computed in (the CPU's BLAS makes no
such promise, so that check is CUDA-only; the CPU path is `matmul_ref`)."""

from __future__ import annotations

import pytest
import torch

from kernels.matmul import ROWS, batch_invariant_linear, padded_rows
from kernels.matmul_ref import batch_invariant_linear_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 40, False), (5, 70, 33, True), (ROWS + 67, 16, 64, True)])
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


def test_leading_dims_views_and_errors():
    x = torch.randn(2, 3, 16).to(DEVICE)
    w = torch.randn(8, 16).to(DEVICE)
    assert batch_invariant_linear(x, w).shape == (2, 3, 8)
    wide = torch.randn(5, 40).to(DEVICE)
    view = wide[:, 3:19]  # not contiguous, not aligned
    torch.testing.assert_close(batch_invariant_linear(view, w), torch.nn.functional.linear(view, w))
    with pytest.raises(ValueError, match="weight must be"):
        batch_invariant_linear(x, torch.randn(8, 15).to(DEVICE))
    with pytest.raises(ValueError, match="share one of"):
        batch_invariant_linear(x, w.half())
    with pytest.raises(ValueError, match="contiguous and 16-byte aligned"):
        batch_invariant_linear(x, torch.randn(16, 8).to(DEVICE).t())


def test_padded_rows_input_is_read_in_place_and_scratch_rows_do_not_matter():
    w = torch.randn(8, 16).to(DEVICE)
    x = padded_rows(5, 16, torch.float32, DEVICE)
    x.copy_(torch.randn(5, 16))
    x.as_strided((ROWS, 16), (16, 1))[5:] = float("nan")  # the scratch rows past the tensor
    out = batch_invariant_linear(x, w)
    assert out.shape == (5, 8) and torch.isfinite(out).all()
    assert torch.equal(out, batch_invariant_linear(x.clone(), w))  # staged copy: the same GEMM shape


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,bias", [(896, False), (1152, True), (4864, False), (151936, False)])
def test_rows_are_batch_invariant_on_cuda(dtype, n, bias):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, 896, generator=g) * 0.02).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.02).to("cuda", dtype) if bias else None
    x = torch.randn(700, 896, generator=g).to("cuda", dtype)
    full = batch_invariant_linear(x, w, b)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 67), slice(250, 300), slice(256, 700), slice(1, 700)):
        assert torch.equal(batch_invariant_linear(x[rows], w, b), full[rows]), rows
    fast = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(full.float(), fast.float(), atol=2e-2, rtol=2e-2)
