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
    all_valid: bool | None = None,  # known to hold no padding (None: checked here)
) -> None:
    """Scatter each token's key and value into its cache slot."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    if all_valid is None:
        all_valid = slot_mapping is None or bool((slot_mapping >= 0).all())
    if all_valid and slot_mapping.dtype == torch.int64:
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)
    elif all_valid:
        k_flat[slot_mapping] = key
        v_flat[slot_mapping] = value
    else:
        valid = slot_mapping >= 0
        k_flat[slot_mapping[valid]] = key[valid]
        v_flat[slot_mapping[valid]] = value[valid]


@dataclass(slots=True)
class AttentionPlan:
    """What every layer of one step shares (it depends only on the batch): which cache blocks to read, which
    slots to write, and the masks. Built once per step by the first layer; the masks of the general path
    need the query-head group and are added by the first `paged_attention_ref` call."""

    blocks: torch.Tensor  # [B * nb] int cache block of each (request, block) pair, nb = ceil(S / block_size)
    all_slots_valid: bool  # no padding token in slot_mapping: the store needs no filter
    decode: bool  # one query token per request (T == B, Qm == 1): the batched-matmul path
    decode_bias: torch.Tensor | None  # [B, 1, S] float32, 0 where attended, -inf elsewhere (decode only)
    group: int = 0  # query heads per KV head of the masks below (0: not built yet)
    q_index: torch.Tensor | None = None  # [B * Qm] int64 token of each padded query row (None: no padding)
    q_valid: torch.Tensor | None = None  # [B, Qm] bool
    mask: torch.Tensor | None = None  # [B, 1, G * Qm, S] bool, True = attend
    bias: torch.Tensor | None = None  # [B, 1, G * Qm, S] float32, 0 where attended, -inf elsewhere (faster in SDPA)
    queries: torch.Tensor | None = None  # [B, Hkv, G, Hkv, D] zeros off the diagonal blocks (decode scratch)


def plan_paged_attention(
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int
    block_tables: torch.Tensor,  # [B, >= nb] int
    slot_mapping: torch.Tensor | None,  # [T] int (None: the step stores nothing)
    block_size: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
) -> AttentionPlan:
    num_reqs = seq_lens.shape[0]
    num_blocks = -(-max_seq_len // block_size)
    blocks = block_tables[:, :num_blocks].reshape(-1)
    all_valid = slot_mapping is None or bool((slot_mapping >= 0).all())
    decode = max_query_len == 1 and num_tokens == num_reqs
    bias = None
    if decode:
        key_pos = torch.arange(max_seq_len, device=seq_lens.device)  # [S]
        bias = torch.zeros(num_reqs, 1, max_seq_len, dtype=torch.float32, device=seq_lens.device)
        bias.masked_fill_(key_pos >= seq_lens[:, None, None], float("-inf"))
    return AttentionPlan(blocks, all_valid, decode, bias)


def _build_masks(plan: AttentionPlan, query_start_loc, seq_lens, group: int, num_tokens: int, max_query_len: int,
                 max_seq_len: int) -> None:
    """The general path's query padding and causal masks, for query-head group `group`."""
    device = seq_lens.device
    num_reqs = seq_lens.shape[0]
    key_pos = torch.arange(max_seq_len, device=device)  # [S]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)  # [B]
    seq_lens = seq_lens.to(torch.int64)
    q_off = torch.arange(max_query_len, device=device)  # [Qm]
    if num_tokens != num_reqs * max_query_len:
        plan.q_valid = q_off[None, :] < q_lens[:, None]
        q_index = (query_start_loc[:-1].to(torch.int64)[:, None] + q_off[None, :]).clamp(max=num_tokens - 1)
        plan.q_index = q_index.reshape(-1)
    q_pos = (seq_lens - q_lens)[:, None] + q_off[None, :]  # [B, Qm]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    mask = mask[:, None, None].expand(num_reqs, 1, group, max_query_len, max_seq_len)
    plan.mask = mask.reshape(num_reqs, 1, group * max_query_len, max_seq_len)
    plan.bias = torch.zeros(plan.mask.shape, dtype=torch.float32, device=device).masked_fill_(~plan.mask, float("-inf"))
    plan.group = group


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
    """Causal attention of each request's query tokens over its paged context. Returns [T, Hq, D].

    Each request's context is read as whole cache blocks (one index_select per cache), cut to the step's
    longest context S. A float32 decode step (one query token per request) attends with two batched
    matmuls; other steps use SDPA (or the row-wise reduction in deterministic mode) over masks built once.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if plan is None:
        plan = plan_paged_attention(query_start_loc, seq_lens, block_tables, None, block_size, num_tokens, max_query_len, max_seq_len)
    num_blocks = plan.blocks.shape[0] // max(num_reqs, 1)
    width = num_kv_heads * head_dim
    # [B * nb, block_size, Hkv, D] -> [B, S, Hkv * D]: the block gather is the token gather, cut to S
    keys = k_cache.index_select(0, plan.blocks).view(num_reqs, num_blocks * block_size, width)[:, :max_seq_len]
    values = v_cache.index_select(0, plan.blocks).view(num_reqs, num_blocks * block_size, width)[:, :max_seq_len]
    if plan.decode and not deterministic and query.dtype == torch.float32:
        return _decode_attention(query, keys, values, plan, scale, num_kv_heads, group)
    keys = keys.view(num_reqs, max_seq_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    values = values.view(num_reqs, max_seq_len, num_kv_heads, head_dim).transpose(1, 2)
    if plan.group != group:
        _build_masks(plan, query_start_loc, seq_lens, group, num_tokens, max_query_len, max_seq_len)
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


def _decode_attention(
    query: torch.Tensor,  # [B, Hq, D] float32
    keys: torch.Tensor,  # [B, S, Hkv * D]
    values: torch.Tensor,  # [B, S, Hkv * D]
    plan: AttentionPlan,
    scale: float,
    num_kv_heads: int,
    group: int,
) -> torch.Tensor:
    """One query token per request, all heads of a request in one matmul against its whole K/V rows.

    Query head h (KV head h // G) is laid out as a row of width Hkv * D that is zero outside its KV head's
    D columns, so `queries @ keys^T` gives every head's scores at once ([B, Hq, S]) and `probs @ values`
    gives [B, Hq, Hkv * D], whose diagonal blocks are the heads' outputs. The zeros add exact zeros.
    Returns [B, Hq, D].
    """
    num_reqs, num_heads, head_dim = query.shape
    if plan.queries is None or plan.queries.shape[1:] != (num_kv_heads, group, num_kv_heads, head_dim):
        plan.queries = query.new_zeros(num_reqs, num_kv_heads, group, num_kv_heads, head_dim)
    q = plan.queries
    torch.diagonal(q, dim1=1, dim2=3).copy_(query.view(num_reqs, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    width = num_kv_heads * head_dim
    scores = torch.baddbmm(plan.decode_bias, q.view(num_reqs, num_heads, width), keys.transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), values).view(num_reqs, num_kv_heads, group, num_kv_heads, head_dim)
    return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(num_reqs, num_heads, head_dim)
