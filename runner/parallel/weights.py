"""One rank's weights as weight-update targets under tensor parallelism, in two coordinate systems.

`ShardedCheckpointWeights` (updates broadcast from rank 0): full checkpoint coordinates. Its
`checkpoint_specs` are the full Hugging Face shapes, so every rank validates the same records a
single-process engine would. Writes apply only the rank's own coordinates: a dense tensor is narrowed to
the rank's rows or columns, and a patch's flat indices are filtered to the rank's slice and mapped to
flat indices of the rank's view (through the slice's row / column offset). Reads (used by update
sessions for checksums and verification) assemble the full tensor with one all-gather, so every rank must
run the same session over the same records; reads of replicated tensors are local. Under expert
parallelism a rank's part of another rank's expert is empty (shard (0, 0)): it writes nothing of it and
adds nothing to the gather.

`RankLocalWeights` (rank-local updates, weight_updates/transports/rank_local.py): the rank's own part in
its own coordinates. Specs are the shard shapes (`CheckpointSlot.shard_shape`: q_proj [q / P, hidden],
o_proj [hidden, q / P], a replicated tensor whole), dense records are shard-shaped, patch indices are flat
indices of the shard, and reads are the rank's views: nothing is a collective, so each rank's session is
its own. Both read the model's one `checkpoint_layout` declaration (every rank's, for the gather).
Not here: moving the records to the ranks (worker.py).
"""

from __future__ import annotations

import math

import torch

from runner.loader import CheckpointWeights, scatter_flat
from runner.models import CausalLM, CheckpointSlot
from runner.parallel.group import TPGroup
from weight_updates.target import ParamSpec


class ShardedCheckpointWeights(CheckpointWeights):
    def __init__(self, model: CausalLM, tp: TPGroup) -> None:
        super().__init__(model)
        self.tp = tp
        self.rank_layouts = [model.checkpoint_layout(r, tp.size) for r in range(tp.size)]  # every rank's

    def read_checkpoint_tensor(self, name: str) -> torch.Tensor:
        """The full checkpoint tensor (a collective unless every rank holds all of it)."""
        return gather_full(self.tp, self.view(name), [layout[name] for layout in self.rank_layouts])

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        write_patch_part(self.view(name), self.layout[name], flat_indices, values)


class RankLocalWeights(CheckpointWeights):
    """The rank's part of every checkpoint tensor, in the part's own shape and flat coordinates."""

    def checkpoint_specs(self) -> dict[str, ParamSpec]:
        return {n: ParamSpec(s.shard_shape, self._params[s.param].dtype) for n, s in self.layout.items()}

    def _own_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # records are the rank's part already

    def _lends(self, name: str, view: torch.Tensor) -> bool:
        """Any contiguous view is lent: flat indices are shard coordinates."""
        return view.is_contiguous()


def gather_full(tp: TPGroup, mine: torch.Tensor, slots: list[CheckpointSlot]) -> torch.Tensor:
    """The full checkpoint tensor of which this rank holds `mine` (its view), `slots` being every rank's slot of
    it in rank order: `mine` itself when every rank holds all of it, else one all-gather (every rank must call
    it). Parts of unequal lengths (expert parallelism: one rank holds the expert whole, the others nothing) are
    padded to the longest for the all-gather."""
    if all(s.is_whole for s in slots):
        return mine
    dim, shape = slots[0].dim, slots[0].shape
    assert all(s.dim == dim and s.shape == shape for s in slots), slots
    width = max(s.shard[1] - s.shard[0] for s in slots)
    if mine.shape[dim] < width:
        padded = mine.new_zeros(tuple(width if d == dim else n for d, n in enumerate(mine.shape)))
        padded.narrow(dim, 0, mine.shape[dim]).copy_(mine)
        mine = padded
    parts = tp.all_gather(mine.contiguous())  # [P, *padded shard shape]
    full = parts.new_empty(shape)
    for part, s in zip(parts, slots):
        start, end = s.shard
        full.narrow(dim, start, end - start).copy_(part.narrow(dim, 0, end - start))
    return full


def write_patch_part(view: torch.Tensor, slot: CheckpointSlot, flat_indices: torch.Tensor,
                     values: torch.Tensor) -> None:
    """Scatter the entries of a patch in full checkpoint coordinates (flat indices [n], values [n]) that fall in
    the rank's part `view` of the tensor `slot` describes."""
    flat, values = flat_indices.to(view.device, torch.int64), values.to(view.device, view.dtype)
    if not slot.is_whole:
        flat, keep = local_flat_indices(slot, flat)
        values = values[keep]
    scatter_flat(view, flat, values)


def local_flat_indices(slot: CheckpointSlot, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the full checkpoint tensor [n] -> (flat indices into the rank's shard [k], mask [n]
    of the inputs that fall in the shard). Any number of dimensions; the shard is a range along `slot.dim`."""
    start, end = slot.shard
    inner = math.prod(slot.shape[slot.dim + 1 :])  # elements per step along dim
    span = inner * slot.shape[slot.dim]
    outer, coord, within = flat // span, flat % span // inner, flat % inner  # [n] each
    keep = (coord >= start) & (coord < end)  # [n]
    return (outer[keep] * (end - start) + coord[keep] - start) * inner + within[keep], keep
