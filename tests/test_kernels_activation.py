"""Triton silu_and_mul against the torch reference.

Tolerances: float32 relative 1e-6; float16 / bfloat16 two ulps of the output (Triton's exp may round
differently from torch's by an ulp of float32, which can move the rounded SiLU by one ulp, and the
product's rounding by one more), checked as relative 2**-9 for fp16 and 2**-6 for bf16 plus a tiny
absolute floor.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.activation_ref import silu_and_mul_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
RTOL = {torch.float32: 1e-6, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # the interpreter has no bf16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 40), (2, 5, 2 * 1100), (1, 2)])  # I not a power of two, > one block
def test_silu_and_mul_matches_ref(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype).to(DEVICE)
    out, ref = silu_and_mul(x), silu_and_mul_ref(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[dtype], atol=1e-6)


def test_silu_and_mul_rejects_bad_input():
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.randn(3, 5, device=DEVICE))
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.randn(3, 4, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(torch.randn(4, 3, device=DEVICE).t())
    assert silu_and_mul(torch.randn(0, 8, device=DEVICE)).shape == (0, 4)


def test_writes_into_given_out_and_checks_it():
    x = torch.randn(4, 2 * 24, device=DEVICE)
    out = torch.full((4, 24), float("nan"), device=DEVICE)
    assert silu_and_mul(x, out) is not None and torch.equal(out, silu_and_mul(x))
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(x, torch.empty(4, 23, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_float32_delta_is_added_to_gate_and_up_first(dtype):
    """The delta (a LoRA delta left to this kernel) joins x in float32, rounded to x's dtype, before the
    activation: as the reference does, and as silu_and_mul of the rounded sum does."""
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(5, 2 * 1100, generator=gen) * 4).to(dtype).to(DEVICE)
    delta = torch.randn(5, 2 * 1100, generator=gen).to(DEVICE)
    out, ref = silu_and_mul(x, delta=delta), silu_and_mul_ref(x, delta)
    torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[dtype], atol=1e-6)
    summed = (x.float() + delta).to(dtype)
    assert torch.equal(out, silu_and_mul(summed))
    assert not torch.equal(out, silu_and_mul(x))
    with pytest.raises(ValueError, match="delta must be a float32"):
        silu_and_mul(x, delta=delta[:, :-2])
    with pytest.raises(ValueError, match="delta must be a float32"):
        silu_and_mul(x, delta=delta.to(torch.float64))
