"""One rank's weights as weight-update targets under tensor parallelism, in two coordinate systems.

`ShardedCheckpointWeights` (updates broadcast from rank 0): full checkpoint coordinates. Its
`checkpoint_specs` are the full Hugging Face shapes, so every rank validates the same records a
single-process engine would. Writes apply only the rank's own coordinates: a dense tensor is narrowed to
the rank's rows or columns, and a patch's flat indices are filtered to the rank's slice and mapped to
flat indices of the rank's view (through the slice's row / column offset). Reads (used by update
sessions for checksums and verification) assemble the full tensor with one all-gather, so every rank must
run the same session over the same records; reads of replicated tensors are local.

`RankLocalWeights` (rank-local updates, weight_updates/transports/rank_local.py): the rank's own part in
its own coordinates. Specs are the shard shapes (`CheckpointSlot.shard_shape`: q_proj [q / P, hidden],
o_proj [hidden, q / P], a replicated tensor whole), dense records are shard-shaped, patch indices are flat
indices of the shard, and reads are the rank's views: nothing is a collective, so each rank's session is
its own. Not here: moving the records to the ranks (worker.py).
"""

from __future__ import annotations

import torch

from runner.loader import CheckpointWeights
from runner.models.llama import CheckpointSlot, DecoderForCausalLM
from runner.parallel.group import TPGroup
from weight_updates.target import ParamSpec


class ShardedCheckpointWeights(CheckpointWeights):
    def __init__(self, model: DecoderForCausalLM, tp: TPGroup) -> None:
        super().__init__(model)
        self.tp = tp
        self.rank_layouts = [model._sharded_checkpoint_layout(r, tp.size) for r in range(tp.size)]  # every rank's

    def read_checkpoint_tensor(self, name: str) -> torch.Tensor:
        """The full checkpoint tensor (a collective unless the tensor is replicated)."""
        slot = self.layout[name]
        if slot.shard_shape == slot.shape:
            return self.view(name)
        parts = self.tp.all_gather(self.view(name).contiguous())  # [P, *shard_shape]
        full = parts.new_empty(slot.shape)
        for rank, part in enumerate(parts):
            start, end = self.rank_layouts[rank][name].shard
            assert end - start == part.shape[slot.dim], (name, rank)
            full.narrow(slot.dim, start, end - start).copy_(part)
        return full

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        slot = self.layout[name]
        view = self.view(name)
        assert view.is_contiguous()
        local, keep = local_flat_indices(slot, flat_indices.to(view.device, torch.int64))
        view.view(-1).index_put_((local,), values.to(view.device, view.dtype)[keep])



class RankLocalWeights(CheckpointWeights):
    """The rank's part of every checkpoint tensor, in the part's own shape and flat coordinates."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        super().__init__(model)
        for name in self.layout:
            assert self.view(name).is_contiguous(), name  # every TP part is a row range of its parameter

    def checkpoint_specs(self) -> dict[str, ParamSpec]:
        return {n: ParamSpec(s.shard_shape, self._params[s.param].dtype) for n, s in self.layout.items()}

    def _own_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # records are the rank's part already

    def writable_views(self, names: list[str]) -> list[torch.Tensor]:
        return [self.view(name) for name in names]


def local_flat_indices(slot: CheckpointSlot, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the full checkpoint tensor -> (flat indices into the rank's shard [k], mask [n] of
    the inputs that fall in the shard)."""
    start, end = slot.shard
    cols = slot.shape[1] if len(slot.shape) == 2 else 1
    row, col = flat // cols, flat % cols  # [n] each
    coord = row if slot.dim == 0 else col
    keep = (coord >= start) & (coord < end)  # [n]
    row, col = row[keep], col[keep]
    if slot.dim == 0:
        return (row - start) * cols + col, keep
    return row * (end - start) + (col - start), keep
