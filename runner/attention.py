"""Per-step attention metadata and the attention call that dispatches to the device's implementation.

The metadata tensors are slices of the runner's persistent step buffers (so CUDA graphs can capture
them); `AttentionMetadata` only carries them plus two host ints used for grid sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_ref import AttentionPlan, paged_attention_ref, plan_paged_attention, store_kv_ref


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each request's query tokens
    seq_lens: torch.Tensor  # [B] int32, context length after this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each query token (-1 = padding)
    max_query_len: int
    max_seq_len: int
    deterministic: bool = False
    plan: AttentionPlan | None = None  # CPU path: blocks to read and masks, built by the first layer

    @classmethod
    def one_sequence(cls, num_query: int, seq_len: int, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                     deterministic: bool) -> "AttentionMetadata":
        """One sequence whose last `num_query` of `seq_len` tokens are the query (block_table [1, blocks])."""
        dev = block_table.device
        return cls(query_start_loc=torch.tensor([0, num_query], dtype=torch.int32, device=dev),
                   seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=dev), block_tables=block_table,
                   slot_mapping=slot_mapping, max_query_len=num_query, max_seq_len=seq_len,
                   deterministic=deterministic)


class AttentionBackend:
    """Stores new K/V into the paged cache and attends over it. CPU: torch reference; CUDA: Triton."""

    def __init__(self, device: torch.device) -> None:
        self.use_triton = device.type == "cuda"
        if self.use_triton:
            from kernels.attention import paged_attention, store_kv

            self._store, self._attend = store_kv, paged_attention
        else:
            self._store, self._attend = None, None

    def store(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if self.use_triton:
            self._store(key, value, k_cache, v_cache, meta.slot_mapping)
            return
        store_kv_ref(key, value, k_cache, v_cache, meta.slot_mapping, self._plan(meta, k_cache).all_slots_valid)

    @staticmethod
    def _plan(meta: AttentionMetadata, k_cache: torch.Tensor) -> AttentionPlan:
        """The step's CPU attention plan, built once per step and shared by all layers."""
        if meta.plan is None:
            meta.plan = plan_paged_attention(
                meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping, k_cache.shape[1],
                meta.slot_mapping.shape[0], meta.max_query_len, meta.max_seq_len,
            )
        return meta.plan

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D]; on CUDA written into `out` when given (the CPU path ignores it)."""
        if self.use_triton:
            return self._attend(
                query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                meta.max_query_len, meta.max_seq_len, out=out, deterministic=meta.deterministic,
            )
        return paged_attention_ref(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            meta.max_query_len, meta.max_seq_len, plan=self._plan(meta, k_cache), deterministic=meta.deterministic,
        )
