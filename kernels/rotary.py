"""Rotary position embedding (NeoX / "rotate_half" layout) in Triton; the CUDA path of `kernels/rotary_ref.py`.

One program rotates all query and key heads of one token. As in the reference, cos and sin (float32
`cos_sin_cache [max_position, head_dim]`, cos half | sin half) are cast to the activation dtype, and
each product and the final sum are rounded to the activation dtype, so float16 / bfloat16 results are
bitwise the reference's (the kernel is compiled without multiply-add fusion); float32 results agree to
~1 ulp.

`rotary_store_kv` also writes the rotated key and the value into the paged KV cache in the same launch
(the engine's decode and prefill path: one kernel per layer instead of two), optionally after each head's
RMSNorm (Qwen3's q_norm / k_norm: one kernel instead of four).

Not here: partial rotary (rotary_dim < head_dim), the GPT-J interleaved layout, building the cache
(see `rope_inv_freq` / `build_cos_sin_cache` in the reference module).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_t, stride_h, stride_dt, stride_dh, token, num_heads, half, cos, sin,
                  norm_ptr, eps, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)  # [H_PAD, HALF_PAD]
    src = src_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    dtype = x1.dtype
    if NORM:  # each head's RMSNorm first, rounded as kernels/norm.py rounds (normalised, then the weight multiply)
        h1 = x1.to(tl.float32)
        h2 = x2.to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(h1 * h1, 1) + tl.sum(h2 * h2, 1)) / (2 * half) + eps)[:, None]  # [H_PAD, 1]
        w1 = tl.load(norm_ptr + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + half + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (h1 * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (h2 * rstd).to(dtype).to(tl.float32)).to(dtype)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # out1 = x1 * cos + (-x2) * sin; out2 = x2 * cos + x1 * sin; every product and sum rounded to dtype
    out1 = ((a1 * cos).to(dtype).to(tl.float32) + (-a2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
    dst = dst_ptr + token * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :]
    tl.store(dst, out1, mask=mask)
    tl.store(dst + half, out2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_q_heads, num_kv_heads, half,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_vt, stride_vh, stride_slot,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, block_size, head_dim,
    q_norm_ptr, k_norm_ptr, eps,
    HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF_PAD: tl.constexpr, STORE: tl.constexpr, D_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    """Rotate one token's query and key heads. STORE: the rotated key and the value go straight to the
    token's KV-cache slot (skipped for a negative slot) instead of to k_out (`rotary_store_kv`). NORM: each
    query and key head is RMS-normalised (weights q_norm / k_norm [D]) before its rotation."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < half
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, num_q_heads, half, cos[None, :], sin[None, :],
                  q_norm_ptr, eps, HQ_PAD, HALF_PAD, NORM)
    if STORE:
        slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
        if slot >= 0:
            block, offset = slot // block_size, slot % block_size
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
            _rotate_heads(k_ptr, k_dst, stride_kt, stride_kh, 0, stride_kch, token, num_kv_heads, half, cos[None, :],
                          sin[None, :], k_norm_ptr, eps, HK_PAD, HALF_PAD, NORM)
            offs_h = tl.arange(0, HK_PAD)
            offs_v = tl.arange(0, D_PAD)
            mask = (offs_h[:, None] < num_kv_heads) & (offs_v[None, :] < head_dim)  # [HK_PAD, D_PAD]
            v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=mask)
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_v[None, :]
            tl.store(v_dst, v, mask=mask)
    else:
        _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, num_kv_heads, half, cos[None, :],
                      sin[None, :], k_norm_ptr, eps, HK_PAD, HALF_PAD, NORM)


def _check_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"query must be [T, Hq, D] and key [T, Hkv, D]; got {tuple(query.shape)} and "
                         f"{tuple(key.shape)}")
    num_tokens, _, head_dim = query.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even; got {head_dim}")
    if query.dtype != key.dtype or query.dtype not in _DTYPES:
        raise ValueError(f"query and key must share one of {_DTYPES}; got {query.dtype} and {key.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32 [max_position, {head_dim}]; got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)}")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{num_tokens}]; got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if len({t.device for t in (query, key, positions, cos_sin_cache)}) != 1:
        raise ValueError("query, key, positions and cos_sin_cache must be on one device")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1 or positions.stride(0) != 1:
        raise ValueError("query, key, cos_sin_cache must be contiguous in their last dimension, positions contiguous")


def _launch(query, key, q_out, k_out, positions, cos_sin_cache, store=None, norms=None) -> None:
    """The rotary kernel over every token; `store` = (value, k_cache, v_cache, slot_mapping) or None; `norms` =
    (q_norm weight [D], k_norm weight [D], eps) or None."""
    num_tokens, num_q_heads, head_dim = query.shape
    if not num_tokens:
        return
    # without a store, any tensors fill the store's pointer arguments: STORE=False compiles their uses out
    value, k_cache, v_cache, slots = store if store is not None else (key, key, key, positions)
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3]) if store is not None else (0,) * 6
    _rotary_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        num_q_heads, key.shape[1], head_dim // 2,
        value, k_cache, v_cache, slots, value.stride(0), value.stride(1), slots.stride(0), *cache_strides,
        k_cache.shape[1] if store is not None else 1, head_dim,
        *(norms[:2] if norms is not None else (query, query)), float(norms[2]) if norms is not None else 0.0,
        HQ_PAD=triton.next_power_of_2(num_q_heads), HK_PAD=triton.next_power_of_2(key.shape[1]),
        HALF_PAD=triton.next_power_of_2(head_dim // 2), STORE=store is not None, D_PAD=triton.next_power_of_2(head_dim),
        NORM=norms is not None,
        enable_fp_fusion=False,  # a fused multiply-add would round once where the reference rounds twice
    )


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64, each in [0, max_position) (not checked: needs a sync)
    cos_sin_cache: torch.Tensor,  # [max_position, D] float32, cos half | sin half
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions. Returns (query, key) rotated: new tensors by default;
    with inplace=True the inputs themselves, overwritten."""
    _check_rotary(query, key, positions, cos_sin_cache)
    q_out = query if inplace else torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = key if inplace else torch.empty(key.shape, dtype=key.dtype, device=key.device)
    _launch(query, key, q_out, k_out, positions, cos_sin_cache)
    return q_out, k_out


def rotary_store_kv(
    query: torch.Tensor,  # [T, Hq, D], rotated in place
    key: torch.Tensor,  # [T, Hkv, D], read only
    value: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_position, D] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, any stride; negative = not stored
    *,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q_norm [D], k_norm [D], eps): Qwen3's
) -> torch.Tensor:
    """`apply_rotary` and `kernels.attention.store_kv` in one launch: the query is rotated in place and
    returned; the rotated key and the value are written to their cache slots (bitwise what the two
    kernels write), and `key` itself is left as it was. With `norms`, each query and key head is first
    RMS-normalised with its weight (Qwen3's q_norm / k_norm), as `kernels.norm.rms_norm` rounds it (within its
    one-ulp agreement: the mean of squares is summed in another order)."""
    from kernels.attention import check_store_kv

    _check_rotary(query, key, positions, cos_sin_cache)
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    if norms is not None:
        head_dim = query.shape[-1]
        for name, w in zip(("q_norm", "k_norm"), norms[:2]):
            if w.shape != (head_dim,) or w.dtype != query.dtype or w.device != query.device or w.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous [{head_dim}] {query.dtype} tensor on {query.device}")
    _launch(query, key, query, key, positions, cos_sin_cache, (value, k_cache, v_cache, slot_mapping), norms)
    return query
