"""Small-batch linear layers in Triton, with the layer before them fused in (decode at a few rows).

At one to a few rows a decode step's projections are matrix-vector products bound by reading the weight,
and much of a step's time goes to the small kernels between them: the residual add + RMSNorm before the
qkv and gate_up projections, the SiLU-and-mul before the down projection. `fused_gemv` reads the weight
once and computes its input on the fly from what those kernels would have read, so each pair is one launch:

    prologue "none"     : y = x W^T (+ b)                              x [M, K]
    prologue "rms_norm" : s = x (+ residual); y = rms_norm(s) W^T (+ b)  returns (y, s)
    prologue "silu_mul" : y = (silu(g) * u) W^T (+ b)                  x [M, 2K] = (g | u)

Numerics: the residual sum s is rounded to the activation dtype as `kernels/norm.py` rounds it (bitwise the
same residual stream); the SiLU-and-mul input is rounded as `kernels/activation.py` rounds it. The RMSNorm
is applied in float32 without its intermediate roundings: each product term is w_norm[k] * s[k] * W[n, k]
and the row's 1 / rms multiplies the sums at the end, so x is read once. The dot products accumulate in
float32 over K in a fixed order, each output element in one program: no atomics, the same bits every run.
Against the unfused layers: float32 within 1e-5, bfloat16 within a few ulps of the output.

Kernel structure: grid = (cdiv(N, BLOCK_N),); one program owns BLOCK_N output columns for all M rows
(at most `MAX_ROWS`), walks K in BLOCK_K steps and reduces a [M, BLOCK_N, BLOCK_K] product per step on the
CUDA cores (the rows are few: the weight's bytes are the cost), program 0 writing the residual sum s as it
goes. Tiles are chosen by shape and prologue (`pick_config`): long K steps (up to 4096) and few columns per
program, as measured fastest at one row by `bench/gemv.py`. Each extra row costs a weight-sized product
more; past one or two rows a GEMM library is faster (the engine's default is one row).

The plain-torch composition of the references is `fused_gemv_ref` (kernels/gemv_ref.py). Not here: more
than MAX_ROWS rows (use a GEMM), split-K, deterministic (batch-invariant) mode, quantized weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 8  # rows of x one launch serves; more rows belong to a GEMM
PROLOGUES = ("none", "rms_norm", "silu_mul")


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, sum_ptr,
    M, N, K, stride_x, stride_r, stride_w, stride_o, stride_s, eps,
    PROLOGUE: tl.constexpr,  # 0 none, 1 rms_norm, 2 silu_mul
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x  # [M_PAD, 1]
    r_rows = res_ptr + offs_m[:, None].to(tl.int64) * stride_r
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    dtype = w_ptr.dtype.element_ty

    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    squares = tl.zeros([M_PAD], tl.float32)  # rms_norm: the rows' sums of squares
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if PROLOGUE == 2:
            g = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            u = tl.load(x_rows + K + kk[None, :], mask=mask, other=0.0)
            gf = g.to(tl.float32)
            silu = (gf / (1.0 + tl.exp(-gf))).to(dtype)
            a = (silu.to(tl.float32) * u.to(tl.float32)).to(dtype).to(tl.float32)
        else:
            s = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            if PROLOGUE == 1:
                if HAS_RESIDUAL:
                    r = tl.load(r_rows + kk[None, :], mask=mask, other=0.0)
                    s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the residual stream, rounded
                    if pid == 0:
                        tl.store(sum_ptr + offs_m[:, None].to(tl.int64) * stride_s + kk[None, :], s, mask=mask)
                sf = s.to(tl.float32)
                squares += tl.sum(sf * sf, 1)
                nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
                a = nw[None, :] * sf  # the row's 1 / rms multiplies the sums after the loop
            else:
                a = s.to(tl.float32)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], 2)  # [M_PAD, BLOCK_N]
    if PROLOGUE == 1:
        acc = acc * tl.math.rsqrt(squares / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One launch's tiles: output columns per program, K per step, warps."""

    block_n: int
    block_k: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    if not torch.cuda.is_available():
        return 8  # the interpreter: any small grid
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def pick_config(rows: int, n: int, k: int, device: torch.device, prologue: str = "none") -> GemvConfig:
    """Tiles by shape and prologue, as measured fastest at one row on an H200 (`bench/gemv.py`'s sweep,
    2026-12-02). Without a prologue and with "silu_mul", long K steps (up to 4096: fewer serial loads per program)
    over tiles of 8192 (16384 with "silu_mul", at 8 warps) weight elements, as few columns per program as that
    leaves while the grid still fills the SMs (the 8B o projection 10.8 us against 12.5 with 1024-long steps, the
    0.5B down 7.4 against 8.9, the MoE o 6.9 against 8.7); so too with "rms_norm" over few columns (the MoE
    router's 128: 2.6 against 3.7 us). Otherwise with "rms_norm", whose steps also load the residual stream and the
    norm weight, and at more than one row (not swept): steps of up to 1024 and 8 columns where that gives two
    programs per SM (else 4). As rows add registers (at most 64 products per thread per step), fewer columns, then
    shorter steps."""
    sms = _num_sms(device.index if device.type == "cuda" else None)
    if rows > 1 or (prologue == "rms_norm" and triton.cdiv(n, 4) >= sms):
        block_k = min(1024, triton.next_power_of_2(max(k, 16)))
        block_n = 8 if triton.cdiv(n, 8) >= 2 * sms else 4
        num_warps = 4
    else:
        block_k = min(4096, triton.next_power_of_2(max(k, 16)))
        num_warps = 8 if prologue == "silu_mul" else 4
        block_n = max(1, 64 * 32 * num_warps // block_k)
        while block_n > 1 and triton.cdiv(n, block_n) < sms:
            block_n //= 2
    while triton.next_power_of_2(rows) * block_n * block_k > 64 * 32 * num_warps:
        if block_n > 2:
            block_n //= 2
        else:
            block_k //= 2
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)


# Largest weight (bytes) whose product takes its layer before it as a prologue: measured at one row on an H200
# (`bench/gemv.py`), the fused RMSNorm wins on small weights (Qwen2.5-0.5B's qkv: 3.1 us against 6.1 us for the
# norm kernel + cuBLAS) and loses a few percent on large ones (the row's extra loads per weight tile), where a
# separate norm kernel + the plain kernel is used; the SiLU-and-mul breaks even near 100 MB (8B's down).
PROLOGUE_MAX_WEIGHT_BYTES = {"rms_norm": 8 << 20, "silu_mul": 16 << 20}


def fuses_prologue(prologue: str, weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] is small enough for `prologue` to pay inside the product (see above)."""
    return weight.numel() * weight.element_size() <= PROLOGUE_MAX_WEIGHT_BYTES[prologue]


def fused_gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) for "silu_mul"
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,  # [K], "rms_norm" only
    residual: torch.Tensor | None = None,  # [M, K], "rms_norm" only: normalise x + residual
    eps: float = 1e-6,
    config: GemvConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y [M, N] in x's dtype; with prologue "rms_norm", (y, s) where s = x + residual (a new tensor) or x
    itself when no residual is given. `config` overrides the tiles (benchmarks)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}; got {prologue!r}")
    if x.dim() != 2 or x.dtype not in _DTYPES or x.stride(-1) != 1:
        raise ValueError(f"x must be a [M, K] tensor of {_DTYPES}, contiguous in K; got {x.dtype} {tuple(x.shape)}")
    rows = x.shape[0]
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows; got {rows}")
    if weight.dim() != 2 or weight.dtype != x.dtype or weight.stride(-1) != 1 or weight.device != x.device:
        raise ValueError(f"weight must be [N, K] {x.dtype} on {x.device}, contiguous in K; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[1] != (2 * k if prologue == "silu_mul" else k):
        raise ValueError(f"x must have {2 * k if prologue == 'silu_mul' else k} columns for prologue {prologue!r} "
                         f"and weight [N, {k}]; got {x.shape[1]}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] {x.dtype}; got {bias.dtype} {tuple(bias.shape)}")
    if prologue == "rms_norm":
        if norm_weight is None or norm_weight.shape != (k,) or norm_weight.dtype != x.dtype \
                or norm_weight.stride(0) != 1 or norm_weight.device != x.device:
            raise ValueError(f"prologue 'rms_norm' needs norm_weight [{k}] {x.dtype}, contiguous")
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or residual.stride(-1) != 1 or residual.device != x.device):
            raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype}, contiguous in K")
    elif norm_weight is not None or residual is not None:
        raise ValueError("norm_weight and residual belong to prologue 'rms_norm'")
    cfg = config or pick_config(rows, n, k, x.device, prologue)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x  # [M, K]
    res = residual if residual is not None else x
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, res, norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
        out, summed,
        rows, n, k, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), summed.stride(0), float(eps),
        PROLOGUE=PROLOGUES.index(prologue), HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        M_PAD=triton.next_power_of_2(rows), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
    )
    return (out, summed) if prologue == "rms_norm" else out
