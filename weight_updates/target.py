"""The interface a weight-update session writes through, and a plain-dict implementation of it.

Coordinates are checkpoint (Hugging Face) names, checkpoint shapes and flat indices into the
checkpoint-shaped tensor. The target maps them onto its runtime tensors (fused ``qkv``, packed
``gate_up``, tensor-parallel shards). This module does not validate updates, hold versions or move
bytes between processes; see ``session`` and ``transports``.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the engine accepts for one checkpoint name."""

    shape: tuple[int, ...]  # checkpoint (HF) shape, e.g. q_proj.weight [num_heads*head_dim, hidden]
    dtype: torch.dtype  # the engine's dtype for this tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class WeightTarget(Protocol):
    """What the engine implements so that sessions can read and write its weights in place."""

    def checkpoint_specs(self) -> Mapping[str, ParamSpec]:
        """Every checkpoint name the engine accepts."""
        ...

    def read_checkpoint_tensor(self, name: str) -> torch.Tensor:
        """Current values in checkpoint shape on ``device``; may be a view, treat as read-only."""
        ...

    def write_dense(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (checkpoint shape, engine dtype) in place."""
        ...

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        """Scatter ``values`` at int64 ``flat_indices`` of the checkpoint-shaped tensor, in place."""
        ...

    # Optional, used by sessions when present:
    #   write_dense_many(pairs: list[tuple[str, torch.Tensor]]): ``write_dense`` of every pair, batched.
    #   writable_views(names) -> list[torch.Tensor] | None: contiguous checkpoint-shaped tensors sharing the
    #     live storage, which a session may scatter patches into directly (None where the layout does not
    #     allow it, e.g. column shards).
    #   writable_addresses(names) -> (list[torch.Tensor], np.ndarray [k] int64) | None: the same lent through the
    #     data pointers of those views (and the tensors holding them, kept alive while written), without making
    #     a view per name; preferred where present.

    @property
    def device(self) -> torch.device: ...


class TensorDictTarget:
    """A target over a plain ``{checkpoint name: tensor}`` dict, no fusion or sharding.

    Writes go into the dict's tensors in place, so their storage never changes.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("TensorDictTarget needs at least one tensor")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise ValueError(f"{name}: tensor must be contiguous")
        self.tensors = dict(tensors)
        self._device = devices.pop()
        self._specs = {n: ParamSpec(shape=tuple(t.shape), dtype=t.dtype) for n, t in self.tensors.items()}

    def checkpoint_specs(self) -> Mapping[str, ParamSpec]:
        return self._specs

    def read_checkpoint_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def write_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name].copy_(tensor)

    def write_dense_many(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        torch._foreach_copy_([self.tensors[name] for name, _ in pairs], [t for _, t in pairs])

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        self.tensors[name].view(-1)[flat_indices] = values

    def writable_views(self, names: list[str]) -> list[torch.Tensor]:
        return [self.tensors[name] for name in names]

    @property
    def device(self) -> torch.device:
        return self._device
