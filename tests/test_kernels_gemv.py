"""Small-batch fused linear layers (`kernels/gemv.py`) against the composed torch references.

Tolerances: float32 relative 1e-5 with an absolute floor of 1e-5 (the dot product's summation order
differs from the reference GEMM's); float16 relative 2**-9 (two ulps of the output; the fused prologue's
rounded input can differ from the reference's by one ulp), bfloat16 (CUDA only) 2**-6. The residual sum must be bitwise equal.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.gemv import MAX_ROWS, GemvConfig, fused_gemv, pick_config  # noqa: E402
from kernels.gemv_ref import fused_gemv_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2.0**-9, 1e-3), torch.bfloat16: (2.0**-6, 1e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])  # no bf16 in the interpreter


def _rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol, atol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_plain_with_bias(dtype, rows):
    x = _rand(rows, 96, dtype=dtype, seed=0)  # K not a multiple of the K step below
    w = _rand(40, 96, dtype=dtype, seed=1, scale=0.1)  # N not a multiple of the column block
    b = _rand(40, dtype=dtype, seed=2)
    cfg = GemvConfig(block_n=16, block_k=64, num_warps=4)
    _close(fused_gemv(x, w, b, config=cfg), fused_gemv_ref(x, w, b))
    _close(fused_gemv(x, w, config=cfg), fused_gemv_ref(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_prologue_with_residual(dtype):
    x = _rand(2, 80, dtype=dtype, seed=3)
    residual = _rand(2, 80, dtype=dtype, seed=4, scale=4.0)
    nw = _rand(80, dtype=dtype, seed=5)
    w = _rand(24, 80, dtype=dtype, seed=6, scale=0.1)
    cfg = GemvConfig(block_n=8, block_k=32, num_warps=4)  # several programs: only program 0 writes the sum
    out, summed = fused_gemv(x, w, prologue="rms_norm", norm_weight=nw, residual=residual, eps=1e-5, config=cfg)
    ref_out, ref_sum = fused_gemv_ref(x, w, prologue="rms_norm", norm_weight=nw, residual=residual, eps=1e-5)
    assert torch.equal(summed, ref_sum)
    _close(out, ref_out)


def test_rms_norm_prologue_without_residual_returns_x():
    x = _rand(1, 64, dtype=torch.float32, seed=7)
    nw = _rand(64, dtype=torch.float32, seed=8)
    w = _rand(32, 64, dtype=torch.float32, seed=9)
    b = _rand(32, dtype=torch.float32, seed=10)
    out, summed = fused_gemv(x, w, b, prologue="rms_norm", norm_weight=nw)
    ref_out, _ = fused_gemv_ref(x, w, b, prologue="rms_norm", norm_weight=nw)
    assert summed is x
    _close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_prologue(dtype):
    x = _rand(MAX_ROWS, 2 * 48, dtype=dtype, seed=11, scale=2.0)  # the most rows one launch takes
    w = _rand(20, 48, dtype=dtype, seed=12, scale=0.1)
    cfg = GemvConfig(block_n=4, block_k=16, num_warps=2)
    _close(fused_gemv(x, w, prologue="silu_mul", config=cfg), fused_gemv_ref(x, w, prologue="silu_mul"))


def test_default_tiles_cover_the_output():
    x = _rand(2, 200, dtype=torch.float32, seed=13)
    w = _rand(300, 200, dtype=torch.float32, seed=14)
    cfg = pick_config(2, 300, 200, DEVICE)
    assert cfg.block_n >= 2 and cfg.block_k >= 16
    _close(fused_gemv(x, w), fused_gemv_ref(x, w))


@pytest.mark.parametrize("prologue", ["none", "rms_norm", "silu_mul"])
def test_default_one_row_tiles_cover_the_output(prologue):
    """At one row over few columns (N = 10 fills fewer programs than there are SMs) the tiles take one column per
    program and the whole of K (300, no multiple of the step) in one step, for every prologue; the masks at both
    ends of K are exercised."""
    n, k = 10, 300
    cfg = pick_config(1, n, k, DEVICE, prologue)
    assert cfg.block_n == 1 and cfg.block_k >= k, cfg
    x = _rand(1, 2 * k if prologue == "silu_mul" else k, dtype=torch.float32, seed=18)
    w = _rand(n, k, dtype=torch.float32, seed=19, scale=0.1)
    if prologue == "rms_norm":
        nw, r = _rand(k, dtype=torch.float32, seed=20), _rand(1, k, dtype=torch.float32, seed=21)
        out, summed = fused_gemv(x, w, prologue=prologue, norm_weight=nw, residual=r)
        ref, ref_sum = fused_gemv_ref(x, w, prologue=prologue, norm_weight=nw, residual=r)
        assert torch.equal(summed, ref_sum)
        _close(out, ref)
    else:
        _close(fused_gemv(x, w, prologue=prologue), fused_gemv_ref(x, w, prologue=prologue))


def test_bad_inputs_name_the_rule():
    x = _rand(2, 32, dtype=torch.float32, seed=15)
    w = _rand(8, 32, dtype=torch.float32, seed=16)
    with pytest.raises(ValueError, match="prologue"):
        fused_gemv(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="rows"):
        fused_gemv(_rand(MAX_ROWS + 1, 32, dtype=torch.float32, seed=17), w)
    with pytest.raises(ValueError, match="64 columns"):
        fused_gemv(x, w, prologue="silu_mul")
    with pytest.raises(ValueError, match="norm_weight"):
        fused_gemv(x, w, prologue="rms_norm")
    with pytest.raises(ValueError, match="belong to prologue"):
        fused_gemv(x, w, residual=x)
    with pytest.raises(ValueError, match="weight must be"):
        fused_gemv(x, w.half())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need CUDA")
@pytest.mark.parametrize("rows", [1, 4, MAX_ROWS])
@pytest.mark.parametrize("n,k,prologue", [(1152, 896, "rms_norm"), (896, 4864, "silu_mul"), (6144, 4096, "rms_norm"),
                                          (4096, 12288, "silu_mul"), (151936, 896, "none")])
def test_real_shapes_bf16(rows, n, k, prologue):
    x = _rand(rows, 2 * k if prologue == "silu_mul" else k, dtype=torch.bfloat16, seed=20)
    w = _rand(n, k, dtype=torch.bfloat16, seed=21, scale=0.02)
    kw = {}
    if prologue == "rms_norm":
        kw = dict(norm_weight=_rand(k, dtype=torch.bfloat16, seed=22), residual=_rand(rows, k, dtype=torch.bfloat16, seed=23))
    out = fused_gemv(x, w, prologue=prologue, **kw)
    ref = fused_gemv_ref(x, w, prologue=prologue, **kw)
    if prologue == "rms_norm":
        assert torch.equal(out[1], ref[1])
        out, ref = out[0], ref[0]
    _close(out, ref)
