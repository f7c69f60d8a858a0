"""Paged-KV attention and KV-cache store in Triton (the CUDA path of `kernels/attention_ref.py`).

Same contracts as the reference: cache layout `[num_blocks, block_size, num_kv_heads, head_dim]`, a batch
is a flat list of query tokens grouped per request by `query_start_loc`, and the query tokens of request b
are the last `q_len` of its `seq_lens[b]` context tokens, each attending causally to all earlier ones.
One kernel serves decode (q_len 1), prefill and chunked prefill over a cached prefix, and speculative
verification (q_len k+1).

Kernel structure:

    grid = (num_reqs * num_q_blocks, num_kv_heads, num_splits)
    program: BLOCK_Q query tokens of one request x all GROUP query heads of one KV head
             = one [BLOCK_Q * GROUP_PAD, D] tile, so each KV tile is loaded once for the whole group
      fast mode, num_splits == 1 : online softmax over the context, write the output
      fast mode, num_splits > 1  : online softmax over one KV split, write (max, sum, acc) partials,
                                   then `_combine_splits_kernel` merges the splits with log-sum-exp;
                                   unless a split size is forced, the program cuts its request's actual
                                   context into num_splits equal runs of whole KV tiles, so a graph
                                   captured for max_seq_len splits a short context as finely as a long one
      deterministic mode         : num_splits == 1; the program walks the context in fixed splits of
                                   `kv_split_size` tokens, each an online softmax over fixed BLOCK_N
                                   tiles started afresh, merged in order by one fixed combine step

In deterministic mode every launch parameter that touches arithmetic (tile shapes, split size, warps)
is a function of the model shape only, never of the batch; query tiles are aligned to absolute
positions (a token always sits in tile row `position % BLOCK_Q`, KV tiles start at multiples of BLOCK_N);
and masked KV positions contribute exact zeros. So a query token's output is bitwise the same whatever
its batch, its place in it, or how many query tokens its request has this step.

The launchers never synchronize with the device: grid sizes come from tensor shapes and the host ints
`max_query_len` / `max_seq_len`, so they can be captured in a CUDA graph.

Not here: sliding windows, ALiBi, soft-capping, quantized KV caches, cross-attention.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
DETERMINISTIC_KV_SPLIT_SIZE = 256  # tokens per KV split in deterministic mode unless given
_FAST_MAX_SPLITS = 32  # fast mode splits a request's context into at most this many runs on its own


# --------------------------------------------------------------------------------------------------
# store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_slot,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_kv_heads, head_dim, block_size,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [H_PAD, D_PAD]
        block = slot // block_size
        offset = slot % block_size
        k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(k_dst, k, mask=mask)
        tl.store(v_dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; negative = padding, not stored
) -> None:
    """Scatter each token's key and value into its cache slot, in place in `k_cache` / `v_cache`.

    Slot s is row `s % block_size` of block `s // block_size`. Rows with a negative slot are skipped.
    Slots must be below `num_blocks * block_size` (not checked: that would need a device sync).
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, slot_mapping.stride(0),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim, block_size,
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


def check_store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """ValueError unless the arguments fit `store_kv`."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key and value must be [T, {num_kv_heads}, {head_dim}]; got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32/int64 [{key.shape[0]}]; got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype) or key.dtype not in _DTYPES:
        raise ValueError(f"key, value and caches must share one of {_DTYPES}; got {key.dtype}, {value.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    _check_same_device(key, value, k_cache, v_cache, slot_mapping)
    _check_last_dim_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache)


# --------------------------------------------------------------------------------------------------
# paged attention


@triton.jit
def _attend_kv_range(
    q, m_i, l_i, acc,  # [M, D_PAD] q tile; running max (log2 units) [M], sum [M], acc [M, D_PAD] f32
    kv_lo, kv_hi,  # KV positions [kv_lo, kv_hi); kv_lo a multiple of BLOCK_N
    q_pos,  # [M] int, position of each row's query token; -1 for padding rows
    seq_len, bt_row_ptr, k_ptr, v_ptr,  # k_ptr / v_ptr already offset to the KV head
    stride_kb, stride_ks, stride_vb, stride_vs, block_size, qk_scale,
    offs_d, d_mask,
    BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    """Online softmax over fixed BLOCK_N tiles. A row whose keys are all masked in a tile is left
    bitwise unchanged by it (scale factor exactly 1, added terms exactly 0)."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [N]
        n_valid = offs_n < seq_len
        block = tl.load(bt_row_ptr + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        row_in_block = (offs_n % block_size).to(tl.int64)
        kv_mask = n_valid[None, :] & d_mask[:, None]  # [D_PAD, N]
        k = tl.load(k_ptr + block[None, :] * stride_kb + row_in_block[None, :] * stride_ks + offs_d[:, None],
                    mask=kv_mask, other=0.0)  # [D_PAD, N]
        if IEEE_DOT:
            qk = tl.dot(q, k, input_precision="ieee")  # [M, N]
        else:
            qk = tl.dot(q, k)
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_i == m_new, 1.0, tl.exp2(m_i - m_safe))
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + row_in_block[:, None] * stride_vs + offs_d[None, :],
                    mask=n_valid[:, None] & d_mask[None, :], other=0.0)  # [N, D_PAD]
        acc = acc * alpha[:, None]
        if IEEE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,  # [T, Hq, NUM_SPLITS] f32 x2, [T, Hq, NUM_SPLITS, D] f32
    qsl_ptr, seq_lens_ptr, bt_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    num_q_blocks, head_dim, block_size, qk_scale, split_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, DETERMINISTIC: tl.constexpr, DET_SPLIT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(qsl_ptr + req).to(tl.int64)
    q_len = (tl.load(qsl_ptr + req + 1) - tl.load(qsl_ptr + req)).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    # deterministic mode aligns query tiles to absolute positions, so a token always sits in tile row
    # (position % BLOCK_Q); fast mode starts the first tile at the request's first query token
    if DETERMINISTIC:
        q_shift = tl.maximum(seq_len - q_len, 0) % BLOCK_Q
    else:
        q_shift = 0
    tile_lo = q_block * BLOCK_Q - q_shift  # first query index of this tile (may be negative)
    if tile_lo < q_len:
        offs_m = tl.arange(0, M)
        q_idx = tile_lo + offs_m // GROUP_PAD  # [M] query index within the request
        g = offs_m % GROUP_PAD
        row_valid = (q_idx >= 0) & (q_idx < q_len) & (g < GROUP)
        q_pos = tl.where(row_valid, seq_len - q_len + q_idx, -1)  # [M]
        token = q_start + q_idx
        head = kv_head * GROUP + g
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < head_dim
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [M, D_PAD]
        # context this tile needs: up to the last query token's position, never beyond seq_len
        ctx_hi = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, tile_lo + BLOCK_Q))
        bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_bt
        k_ptr = k_cache_ptr + kv_head * stride_kh
        v_ptr = v_cache_ptr + kv_head * stride_vh

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D_PAD], tl.float32)
        if DETERMINISTIC:
            # fixed splits of DET_SPLIT tokens from position 0, merged in order by one fixed rule
            for split_lo in range(0, ctx_hi, DET_SPLIT):
                m_s, l_s, acc_s = _attend_kv_range(
                    q, tl.full([M], float("-inf"), tl.float32), tl.zeros([M], tl.float32),
                    tl.zeros([M, D_PAD], tl.float32), split_lo, tl.minimum(split_lo + DET_SPLIT, ctx_hi),
                    q_pos, seq_len, bt_row_ptr, k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
                    block_size, qk_scale, offs_d, d_mask, BLOCK_N, IEEE_DOT)
                m_new = tl.maximum(m_i, m_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                a = tl.where(m_i == m_new, 1.0, tl.exp2(m_i - m_safe))
                b = tl.where(m_s == m_new, 1.0, tl.exp2(m_s - m_safe))
                l_i = l_i * a + l_s * b
                acc = acc * a[:, None] + acc_s * b[:, None]
                m_i = m_new
        else:
            size = split_size
            if size == 0:  # the request's context in NUM_SPLITS runs of whole tiles (some may be empty)
                size = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_lo = split * size
            m_i, l_i, acc = _attend_kv_range(
                q, m_i, l_i, acc, kv_lo, tl.minimum(kv_lo + size, ctx_hi),
                q_pos, seq_len, bt_row_ptr, k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
                block_size, qk_scale, offs_d, d_mask, BLOCK_N, IEEE_DOT)

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows without context (seq_len 0) -> 0
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
        else:
            num_heads = tl.num_programs(1) * GROUP
            part = (token * num_heads + head) * NUM_SPLITS + split  # [M]
            tl.store(part_m_ptr + part, m_i, mask=row_valid)
            tl.store(part_l_ptr + part, l_i, mask=row_valid)
            tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qsl_ptr,
    num_reqs, stride_ot, stride_oh, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # tokens outside [query_start_loc[0], query_start_loc[B]) belong to no request: leave them alone
    if (token >= tl.load(qsl_ptr)) & (token < tl.load(qsl_ptr + num_reqs)):
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, D_PAD)
        s_mask = offs_s < NUM_SPLITS
        part = (token.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
        m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
        l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [SPLITS_PAD]; empty splits -> 0
        l_sum = tl.sum(w * l, 0)
        acc_sum = tl.sum(w[:, None] * acc, 0)  # [D_PAD]
        out = acc_sum / tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < head_dim)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B + 1] int32/int64, nondecreasing
    seq_lens: torch.Tensor,  # [B] int32/int64; 0 marks a padding request (its output rows are zeros)
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, D] in query's dtype; written in place when given
    deterministic: bool = False,
    kv_split_size: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context. Returns out [T, Hq, D].

    Same result as `paged_attention_ref` (fp32 accumulation, output in query's dtype). `max_query_len` and
    `max_seq_len` must bound the real values (they size the grid; they are not checked against the
    tensors, which would need a device sync). Rows of tokens outside `query_start_loc[0]:query_start_loc[B]`
    are not written. Query tokens with no context (seq_len 0, e.g. graph padding) get zeros.

    kv_split_size: tokens per KV split, a multiple of 16.
      fast mode (default): None splits the context when the grid is too small to fill the device (small
        batches: up to 32 splits, never finer than one KV tile), each request's actual context cut into
        equal runs of whole KV tiles by the kernel; an int forces splits of that many tokens.
      deterministic=True: the context is always reduced in splits of `kv_split_size` tokens (default
        256) from position 0, in order, with fixed tiles, so each query token's output is bitwise
        independent of batch size, batch position, chunking and prefill vs decode. Use the same
        kv_split_size everywhere the results are compared.
    block_n, num_warps, num_stages: launch tuning of the fast mode (KV tile of 16, 32, 64 or 128 tokens;
      default 64, 32 for head_dim > 128; Triton's default pipelining); deterministic mode refuses them
      (its tiles are fixed by the model shape).
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [T, Hq, D]; got {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num query heads {num_heads} must be a multiple of num kv heads {num_kv_heads}")
    if not (query.dtype == k_cache.dtype == v_cache.dtype) or query.dtype not in _DTYPES:
        raise ValueError(f"query and caches must share one of {_DTYPES}; got {query.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [B + 1]; got {tuple(query_start_loc.shape)}")
    num_reqs = query_start_loc.shape[0] - 1
    if seq_lens.shape != (num_reqs,):
        raise ValueError(f"seq_lens must be [{num_reqs}]; got {tuple(seq_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables must be [{num_reqs}, max_blocks]; got {tuple(block_tables.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if max_query_len < 0 or max_seq_len < 0:
        raise ValueError(f"max_query_len and max_seq_len must be >= 0; got {max_query_len}, {max_seq_len}")
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(f"block_tables cover {block_tables.shape[1] * block_size} tokens < max_seq_len "
                         f"{max_seq_len}")
    if kv_split_size is not None and (kv_split_size <= 0 or kv_split_size % 16 != 0):
        raise ValueError(f"kv_split_size must be a positive multiple of 16; got {kv_split_size}")
    if block_n is not None and block_n not in (16, 32, 64, 128):
        raise ValueError(f"block_n must be 16, 32, 64 or 128; got {block_n}")
    if deterministic and (block_n is not None or num_warps != 4 or num_stages is not None):
        raise ValueError("block_n / num_warps / num_stages tune the fast mode; deterministic mode fixes them")
    _check_same_device(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    _check_last_dim_contiguous(query=query, k_cache=k_cache, v_cache=v_cache)
    if out is None:
        out = torch.empty_like(query)
    else:
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {query.device}; got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        _check_last_dim_contiguous(out=out)
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if deterministic:
        # tile shapes depend on the model shape only, never on the batch
        split_size = DETERMINISTIC_KV_SPLIT_SIZE if kv_split_size is None else kv_split_size
        block_q = max(1, 64 // group_pad)
        block_n = next(n for n in (64, 32, 16) if split_size % n == 0)
        num_splits = 1
        num_q_blocks = triton.cdiv(max_query_len - 1, block_q) + 1  # tiles are position-aligned
    else:
        block_q = min(max(triton.next_power_of_2(max_query_len), triton.cdiv(16, group_pad)),
                      max(1, 64 // group_pad))
        block_n = block_n or (64 if d_pad <= 128 else 32)
        if kv_split_size is not None:
            block_n = min(block_n, next(n for n in (64, 32, 16) if kv_split_size % n == 0))
            split_size = kv_split_size
        else:
            num_ctas = num_reqs * triton.cdiv(max_query_len, block_q) * num_kv_heads
            split_size = 0  # the kernel cuts each request's context into num_splits runs
            num_splits = max(1, min(triton.cdiv(2 * _num_sms(query.device), num_ctas),
                                    triton.cdiv(max_seq_len, block_n), _FAST_MAX_SPLITS))
        if split_size:
            num_splits = max(1, triton.cdiv(max_seq_len, split_size))
        num_q_blocks = triton.cdiv(max_query_len, block_q)

    if num_splits > 1:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32,
                               device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel when NUM_SPLITS == 1
    _paged_attention_kernel[(num_reqs * num_q_blocks, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_m, part_l, part_acc,
        query_start_loc, seq_lens, block_tables,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_q_blocks, head_dim, block_size, float(scale) * _LOG2E, split_size,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, D_PAD=d_pad,
        NUM_SPLITS=num_splits, DETERMINISTIC=deterministic, DET_SPLIT=split_size if deterministic else 0,
        IEEE_DOT=query.dtype == torch.float32,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, query_start_loc,
            num_reqs, out.stride(0), out.stride(1), head_dim,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), D_PAD=d_pad,
        )
    return out


# --------------------------------------------------------------------------------------------------
# checks shared by the launchers


def _check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")
