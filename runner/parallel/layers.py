"""Tensor-parallel partitions and the layers that need a collective.

Partitions (pure functions of the model config, the rank and the group size) say which heads, rows or
vocabulary entries a rank holds; the model's `checkpoint_layout` turns them into checkpoint coordinates.
Column-parallel projections need no layer of their own: qkv, gate_up and the LM head are plain `Linear`s
over the rank's rows and their outputs stay sharded. Row-parallel projections (o_proj, down_proj) sum
partial products over ranks; the vocab-parallel embedding sums each rank's rows (zero elsewhere).
Not here: loading (runner/loader.py) and sampling from sharded logits (sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runner.layers import Linear, linear
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


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T, plus the (replicated) bias once.

    weight [out, in / size] holds the rank's input columns; x [..., in / size] is the rank's slice of the
    input (the output of a column-parallel layer).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.deterministic))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding over the rank's vocabulary rows [vocab_start, vocab_end); weight [vocab / size, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_start, self.vocab_end = even_partition(num_embeddings, tp.rank, tp.size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [*S]
        local_ids = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # [*S, hidden]
        return self.tp.all_reduce(out)
