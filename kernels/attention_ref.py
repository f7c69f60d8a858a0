"""Paged-KV attention and KV-cache store in plain torch (reference and CPU path).

Cache layout (per layer): k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`. Token t
of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.

A batch is a flat list of query tokens `[T, ...]`, grouped per request by `query_start_loc [B+1]`. Request
b has `seq_lens[b]` tokens of context after this step's tokens were stored; its query tokens are the last
`query_start_loc[b+1] - query_start_loc[b]` of them, each attending causally to every earlier token.
That one rule covers prefill, chunked prefill, prefix-cache hits, decode and speculative verification.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class AttentionPlan:
    """Index and mask tensors of one step, shared by every layer (they depend only on the batch)."""

    gather_index: torch.Tensor  # [B, S] int64 cache slot of each context position
    q_index: torch.Tensor | None  # [B * Qm] int64 token of each padded query row (None: no padding)
    q_valid: torch.Tensor | None  # [B, Qm] bool
    mask: torch.Tensor  # [B, 1, G * Qm, S] bool, True = attend
    bias: torch.Tensor  # [B, 1, G * Qm, S] float32, 0 where attended, -inf elsewhere (faster in SDPA)


def plan_paged_attention(
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int
    block_tables: torch.Tensor,  # [B, max_blocks] int
    block_size: int,
    group: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
) -> AttentionPlan:
    device = block_tables.device
    num_reqs = seq_lens.shape[0]
    key_pos = torch.arange(max_seq_len, device=device)  # [S]
    gather = block_tables.to(torch.int64)[:, key_pos // block_size] * block_size + key_pos % block_size
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)  # [B]
    seq_lens = seq_lens.to(torch.int64)
    q_off = torch.arange(max_query_len, device=device)  # [Qm]
    q_index = q_valid = None
    if num_tokens != num_reqs * max_query_len:
        q_valid = q_off[None, :] < q_lens[:, None]
        q_index = (query_start_loc[:-1].to(torch.int64)[:, None] + q_off[None, :]).clamp(max=num_tokens - 1)
        q_index = q_index.reshape(-1)
    q_pos = (seq_lens - q_lens)[:, None] + q_off[None, :]  # [B, Qm]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    mask = mask[:, None, None].expand(num_reqs, 1, group, max_query_len, max_seq_len)
    mask = mask.reshape(num_reqs, 1, group * max_query_len, max_seq_len)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill_(~mask, float("-inf"))
    return AttentionPlan(gather, q_index, q_valid, mask, bias)


def rowwise_attention_ref(
    queries: torch.Tensor,  # [B, Hkv, R, D] (R query rows per KV head)
    keys: torch.Tensor,  # [B, Hkv, S, D]
    values: torch.Tensor,  # [B, Hkv, S, D]
    mask: torch.Tensor,  # [B, 1, R, S] bool, True = attend
    scale: float,
) -> torch.Tensor:
    """Attention whose result for a query row depends on that row's visible keys only (deterministic mode).

    Dot products reduce over the fixed head dimension; the softmax denominator and the weighted sum of
    values are sequential sums over key positions (cumsum), so masked positions past a row's context add
    exact zeros and the row's result does not depend on S, on the batch or on how many other query rows
    there are. Returns [B, Hkv, R, D].
    """
    scores = (queries[..., :, None, :] * keys[..., None, :, :]).sum(-1) * scale  # [B, Hkv, R, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # [B, Hkv, R, S]
    denom = torch.cumsum(weights, -1)[..., -1:]  # [B, Hkv, R, 1]
    weighted = weights[..., None, :] * values.transpose(-1, -2)[..., None, :, :]  # [B, Hkv, R, D, S]
    return torch.cumsum(weighted, -1)[..., -1] / denom


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
    plan: AttentionPlan | None = None,  # from plan_paged_attention, shared by all layers of a step
    deterministic: bool = False,  # batch-invariant reduction (rowwise_attention_ref) instead of SDPA
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context. Returns [T, Hq, D]."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if plan is None:
        plan = plan_paged_attention(query_start_loc, seq_lens, block_tables, block_size, group, num_tokens,
                                    max_query_len, max_seq_len)
    flat = plan.gather_index.reshape(-1)
    keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat)  # [B*S, Hkv, D]
    values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat)
    keys = keys.view(num_reqs, max_seq_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    values = values.view(num_reqs, max_seq_len, num_kv_heads, head_dim).transpose(1, 2)
    queries = query if plan.q_index is None else query.index_select(0, plan.q_index)
    # [B, Qm, Hkv, G, D] -> [B, Hkv, G*Qm, D]: one KV head serves its G query heads
    queries = queries.view(num_reqs, max_query_len, num_kv_heads, group, head_dim)
    queries = queries.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group * max_query_len, head_dim)
    if deterministic:
        out = rowwise_attention_ref(queries, keys, values, plan.mask, scale)
    else:
        bias = plan.bias if queries.dtype == torch.float32 else plan.bias.to(queries.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scale)
    out = out.view(num_reqs, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_reqs, max_query_len, num_heads, head_dim)  # [B, Qm, Hq, D]
    if plan.q_index is None:
        return out.reshape(num_tokens, num_heads, head_dim)
    result = torch.empty_like(query)
    valid = plan.q_valid
    result[plan.q_index.view(num_reqs, max_query_len)[valid]] = out[valid]
    return result
