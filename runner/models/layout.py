"""Checkpoint layouts: where each checkpoint (Hugging Face) tensor lives in a model's runtime parameters.

Each layer declares once, in `checkpoint_layout(tp_rank, tp_size) -> {checkpoint name: CheckpointSlot}`,
how the checkpoint names of its subtree map into its parameters (names and parameters relative to the
layer): which slice of which fused tensor, at which index of a stacked tensor, and which part of the
checkpoint tensor rank `tp_rank` of `tp_size` holds. The declaration is a function of the layer's full
(unsharded) sizes and of (tp_rank, tp_size) only, so any rank can compute every rank's layout.
`module_layout` composes a module's layout from its children's under their name prefixes; a module that
declares nothing holds its own parameters whole, under their own names, on every rank (replicated), and
composes its children's.

Everything that reads or writes weights by checkpoint name reads these slots: the loader, the weight-update
targets (`runner.loader.CheckpointWeights` and runner/parallel/weights.py: dense, patch and rank-local
updates), the TP gather of full tensors, the trainer's cut of each rank's part (`shard_weights`) and the
random-checkpoint writer (runner/testing.py). Not here: the partitions themselves (runner/parallel/layers.py).

Examples, for a layer whose checkpoint holds `gate_proj.weight` and `up_proj.weight` [I, H]:

    part("gate_up_proj.weight", (I, H))                  # rows [0, I) of a fused [2I, H] parameter
    part("gate_up_proj.weight", (I, H), at=I)            # rows [I, 2I)
    part("gate_up_proj.weight", (I, H), shard=(i0, i1), at=i1 - i0)   # under TP: the rank's rows of up
    part("experts.w13", (I, H), index=(e,), at=I)        # expert e's up rows of a stacked [E, 2I, H]
    part("down_proj.weight", (H, I), dim=1, shard=(i0, i1))           # row-parallel: the rank's columns
    part("experts.w2", (H, I), shard=(0, 0), index=(0,))  # another rank's expert: an empty [0, I] view
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

INITS = ("normal", "ones")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSlot:
    """Where this rank's part of one checkpoint tensor lives.

    Checkpoint side: the tensor has its full Hugging Face shape `shape`; the rank holds the range `shard`
    along `dim` (all of every other dimension); without tensor parallelism, all of it; under expert
    parallelism, none of another rank's expert (an empty range: the view and own part are empty).
    Runtime side: parameter `param`, indexed by `index` (leading dimensions of a stacked parameter), then
    narrowed by each `(dim, start, length)` of `narrows` in turn (dimensions of the indexed tensor). The
    result, a view of the parameter, has the shape `shard_shape`.
    """

    param: str  # runtime parameter name (relative to the declaring module until composed)
    shape: tuple[int, ...]  # the checkpoint tensor's full shape
    dim: int = 0  # the checkpoint dimension split under tensor parallelism
    shard: tuple[int, int] | None = None  # the rank's range [start, end) along dim; None: all of it
    index: tuple[int, ...] = ()  # leading indices into a stacked parameter, e.g. (expert,)
    narrows: tuple[tuple[int, int, int], ...] = ()  # (dim, start, length) of param[index], applied in order
    init: str = "normal"  # random-checkpoint writer: "normal" (std-scaled) or "ones" (1 + small noise: norms)
    shard_shape: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    """The shape of this rank's part of the checkpoint tensor (the shape of `view`), from the fields above."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.shard is None:
            object.__setattr__(self, "shard", (0, self.shape[self.dim]))
        start, end = self.shard
        assert 0 <= self.dim < len(self.shape) and 0 <= start <= end <= self.shape[self.dim], self
        assert self.init in INITS, self.init
        object.__setattr__(self, "shard_shape", tuple(end - start if d == self.dim else n for d, n in enumerate(self.shape)))

    @property
    def is_empty(self) -> bool:
        """Whether the rank holds none of the checkpoint tensor (expert parallelism: another rank's expert)."""
        return self.shard[0] == self.shard[1]

    @property
    def is_whole(self) -> bool:
        """Whether the rank holds all of the checkpoint tensor."""
        return self.shard_shape == self.shape

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """This slot's view of `param` (the runtime parameter's data): shard-shaped, sharing its storage."""
        view = param[self.index] if self.index else param
        for dim, start, length in self.narrows:
            view = view.narrow(dim, start, length)
        assert tuple(view.shape) == self.shard_shape, (self, tuple(view.shape))
        return view

    def own_part(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of a full checkpoint-shaped tensor (a view)."""
        start, end = self.shard
        return full.narrow(self.dim, start, end - start)

    def with_prefix(self, prefix: str) -> "CheckpointSlot":
        return dataclasses.replace(self, param=prefix + self.param)


def whole(param: str, shape: tuple[int, ...], *, init: str = "normal") -> CheckpointSlot:
    """A checkpoint tensor that is all of parameter `param`, on every rank (replicated)."""
    return CheckpointSlot(param=param, shape=shape, init=init)


def part(param: str, shape: tuple[int, ...], *, at: int = 0, dim: int = 0, shard: tuple[int, int] | None = None,
         index: tuple[int, ...] = ()) -> CheckpointSlot:
    """A checkpoint tensor of full `shape`, of which the rank holds `shard` along `dim` (None: all of it),
    stored at [at, at + its length) along `dim` of `param[index]` (all of the other dimensions)."""
    start, end = (0, shape[dim]) if shard is None else shard
    return CheckpointSlot(param=param, shape=shape, dim=dim, shard=(start, end), index=index,
                          narrows=((dim, at, end - start),))


def module_layout(module: nn.Module, tp_rank: int, tp_size: int, prefix: str = "") -> dict[str, CheckpointSlot]:
    """The layout of `module` for rank `tp_rank` of `tp_size`, names and parameters under `prefix`: its own
    `checkpoint_layout(tp_rank, tp_size)` if it declares one, else its parameters whole plus its children's
    layouts under their attribute names."""
    declare = getattr(module, "checkpoint_layout", None)
    if declare is not None:
        own = declare(tp_rank, tp_size)
    else:
        own = {name: whole(name, tuple(p.shape)) for name, p in module.named_parameters(recurse=False)}
        for name, child in module.named_children():
            own.update(module_layout(child, tp_rank, tp_size, f"{name}."))
    return {prefix + name: slot.with_prefix(prefix) for name, slot in own.items()}

