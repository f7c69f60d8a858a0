"""Paged-KV attention and KV-cache store in plain torch (reference and CPU path).

Cache layout (per layer): k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`. Token t
of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.

A batch is a flat list of query tokens `[T, ...]`, grouped per request by `query_start_loc [B+1]`. Request
b has `seq_lens[b]` tokens of context after this step's tokens were stored; its query tokens are the last
`query_start_loc[b+1] - query_start_loc[b]` of them, each attending causally to every earlier token.
That one rule covers prefill, chunked prefill, prefix-cache hits, decode and speculative verification.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int; negative = padding, not stored
) -> None:
    """Scatter each token's key and value into its cache slot."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        k_flat[slot_mapping] = key
        v_flat[slot_mapping] = value
    else:
        k_flat[slot_mapping[valid]] = key[valid]
        v_flat[slot_mapping[valid]] = value[valid]


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int, all > 0
    block_tables: torch.Tensor,  # [B, max_blocks] int
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context. Returns [T, Hq, D]."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = query.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)  # [B]
    seq_lens = seq_lens.to(torch.int64)

    key_pos = torch.arange(max_seq_len, device=device)  # [S]
    blocks = block_tables.to(torch.int64)[:, key_pos // block_size]  # [B, S]
    slots = blocks * block_size + key_pos % block_size  # [B, S]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    keys = k_flat[slots]  # [B, S, Hkv, D]
    values = v_flat[slots]

    q_off = torch.arange(max_query_len, device=device)  # [Qm]
    q_valid = q_off[None, :] < q_lens[:, None]  # [B, Qm]
    q_idx = (query_start_loc[:-1].to(torch.int64)[:, None] + q_off[None, :]).clamp(max=num_tokens - 1)
    queries = query[q_idx]  # [B, Qm, Hq, D]
    q_pos = (seq_lens - q_lens)[:, None] + q_off[None, :]  # [B, Qm]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])

    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2) if group > 1 else keys
    values = values.repeat_interleave(group, dim=2) if group > 1 else values
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [B, Hq, Qm, D]
        keys.transpose(1, 2),  # [B, Hq, S, D]
        values.transpose(1, 2),
        attn_mask=mask[:, None, :, :],
        scale=scale,
    ).transpose(1, 2)  # [B, Qm, Hq, D]
    result = torch.empty_like(query)
    result[q_idx[q_valid]] = out[q_valid]
    return result
