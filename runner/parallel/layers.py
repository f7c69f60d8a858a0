"""Tensor-parallel partitions and the layers whose sharding is their own.

Partitions (pure functions of the model config, the rank and the group size) say which heads, rows or
vocabulary entries a rank holds. The layers here work with or without a group (`tp=None`: one rank holding
everything, no collective) and each declares its checkpoint layout for any (tp_rank, tp_size) from its
full sizes (runner/models/layout.py): row-parallel projections (o_proj, down_proj) hold the rank's input
columns and sum partial products over ranks (with a LoRA hook, its partial delta joins them before the sum);
the vocab-parallel embedding and LM head hold the rank's
vocabulary rows (the embedding sums each rank's rows, zero elsewhere; the LM head's logits stay sharded).
Column-parallel projections that fuse several checkpoint tensors (qkv, gate_up) are plain `Linear`s over
the rank's rows, declared by the layer that owns them. Not here: loading (runner/loader.py) and sampling
from sharded logits (sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runner.layers import Linear, linear
from runner.models.layout import CheckpointSlot, part, whole

if TYPE_CHECKING:
    from runner.parallel.group import TPGroup


@dataclass(frozen=True, slots=True)
class HeadPartition:
    """The attention heads of one rank: query heads [q_start, q_start + num_heads), kv heads likewise.

    With fewer kv heads than ranks, each kv head is replicated on size / num_kv_heads consecutive ranks,
    which are exactly the ranks whose query heads use it.
    """

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_partition(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadPartition:
    if num_heads % size:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={size}")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tensor_parallel_size={size}")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} is not a multiple of num_key_value_heads={num_kv_heads} (kv heads are "
            "replicated only in whole groups)"
        )
    local = num_heads // size
    if num_kv_heads >= size:
        local_kv = num_kv_heads // size
        return HeadPartition(rank * local, local, rank * local_kv, local_kv)
    return HeadPartition(rank * local, local, rank * num_kv_heads // size, 1)


def even_partition(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, end) of rank's equal share of n entries; ValueError unless size divides n."""
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")
    share = n // size
    return rank * share, (rank + 1) * share


def rank_and_size(tp: TPGroup | None) -> tuple[int, int]:
    """(tp.rank, tp.size), or (0, 1) without a group."""
    return (0, 1) if tp is None else (tp.rank, tp.size)


def is_expert_parallel(tp: TPGroup | None) -> bool:
    """Whether MoE layers split their experts over the group's ranks (`TPGroup.expert_parallel`; a group
    without the attribute, as a test's stand-in, splits their intermediate dimension)."""
    return tp is not None and getattr(tp, "expert_parallel", False)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T, plus the (replicated) bias once.

    weight [out, in / size] holds the rank's input columns; x [..., in / size] is the rank's slice of the
    input (the output of a column-parallel layer). `in_features` is the full input size; `what` names it
    in partition errors. Without a group it is a plain `Linear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup | None,
                 what: str = "in_features") -> None:
        start, end = even_partition(in_features, *rank_and_size(tp), what)
        super().__init__(end - start, out_features, bias)
        self.full_in_features, self.what = in_features, what
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        y = self.fused_lora(x, None)  # the rank's partial products and partial delta in one launch
        if y is None:
            partials = None if self.lora is None else self.lora.start(x)  # the LoRA shrink of the rank's columns
            if self.takes_gemv(x):
                from kernels.gemv import fused_gemv

                y = fused_gemv(x, self.weight)
            else:
                y = linear(x, self.weight, None, self.deterministic)
            if self.lora is not None:  # the rank's partial delta, summed over ranks with the partial products
                y = self.lora(y, x, partials)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """weight [out, in]: the rank's columns; bias [out]: replicated."""
        cols = even_partition(self.full_in_features, tp_rank, tp_size, self.what)
        layout = {"weight": part("weight", (self.out_features, self.full_in_features), dim=1, shard=cols)}
        if self.bias is not None:
            layout["bias"] = whole("bias", (self.out_features,))
        return layout


class VocabParallelEmbedding(nn.Module):
    """Embedding over the rank's vocabulary rows [vocab_start, vocab_end); weight [vocab / size, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = even_partition(num_embeddings, *rank_and_size(tp), "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [*S]
        local_ids = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # [*S, hidden]
        return self.tp.all_reduce(out)

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """weight [vocab, hidden]: the rank's vocabulary rows."""
        rows = even_partition(self.num_embeddings, tp_rank, tp_size, "vocab_size")
        return {"weight": part("weight", (self.num_embeddings, self.embedding_dim), shard=rows)}


class ParallelLMHead(Linear):
    """The LM head over the rank's vocabulary rows: weight [vocab / size, hidden], logits stay sharded."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        start, end = even_partition(vocab_size, *rank_and_size(tp), "vocab_size")
        super().__init__(hidden_size, end - start, bias=False)
        self.vocab_size = vocab_size

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """weight [vocab, hidden]: the rank's vocabulary rows."""
        rows = even_partition(self.vocab_size, tp_rank, tp_size, "vocab_size")
        return {"weight": part("weight", (self.vocab_size, self.in_features), shard=rows)}
