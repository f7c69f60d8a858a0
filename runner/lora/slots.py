"""Preallocated device slots for LoRA adapters: what the LoRA kernels read, and what loads and pushes write.

For each decoder layer and each fused runtime linear of the model (qkv_proj = q|k|v, o_proj, gate_up_proj =
gate|up, down_proj), one `LoraStack` of `max_loras` slots: A [S, num_slices * max_rank, in] and
B [S, sum(out_i), max_rank], slice i being the module's rows of the fused output (the layout
`kernels.lora_ref` documents). Its A, B and `slices` are the arguments of `kernels.lora.add_lora` (CUDA) and
`kernels.lora_ref.add_lora_ref`, with `LoraSlots.scaling` [S] float32 and a per-token slot index.

Tensors are allocated once and only ever written in place (`load`, `clear`, writes through `views`), so a
CUDA graph captured over them stays valid across adapter swaps and pushes. An adapter of rank r fills the
first r rows of each module's A rows and the first r columns of its B rows; the rest of the slot is zero (a
load first zeroes everything the previous adapter of the slot left), and zeros add nothing. Which adapter
name lives in which slot is the caller's business.

Under tensor parallelism the slots hold the rank's shard (`shards`, from the model's own checkpoint layout): a
column-parallel module (q/k/v/gate/up: the rank's output rows) keeps its B rows of those outputs and A whole; a
row-parallel one (o/down: the rank's input columns) keeps A's columns of those inputs and B whole, so its partial
delta, added before the layer's all-reduce, sums to the full one. Adapters still come whole (`load` checks the
full shapes, then keeps the rank's part); `views` are the rank's parts, `checkpoint_slots` says where each lies
in the full tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.lora.adapters import LORA_MODULES, LoraAdapter, lora_module_shapes, peft_tensor_name
from runner.model_config import ModelConfig
from runner.models.layout import CheckpointSlot

FUSED_MODULES = {  # runtime linear -> its checkpoint modules, in the fused output's column order
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(kw_only=True, slots=True)
class LoraStack:
    """The adapter slots of one fused linear layer of one decoder layer."""

    A: torch.Tensor  # [S, len(slices) * max_rank, in]: module i's A rows at [i * max_rank, i * max_rank + r)
    B: torch.Tensor  # [S, sum(slices), max_rank]: module i's B rows at its output columns, first r columns used
    slices: tuple[int, ...]  # output width of each module, in the fused output's column order
    modules: tuple[str, ...]  # the checkpoint modules of the slices


Shard = tuple[int, int, int]
"""(dim, start, end): the range of a module's weight [out, in] one rank holds along dim (0: output rows, 1: input
columns)."""


@dataclass(frozen=True, slots=True)
class _Place:
    fused: str  # runtime linear
    index: int  # the module's slice in it
    row0: int  # first output column of the slice (of the rank's outputs)
    out: int  # the rank's outputs of the module
    inp: int  # the rank's inputs
    full: tuple[int, int]  # the module's full (out, in)
    shard: Shard  # which part of the full weight the rank's out x inp are

    def part_a(self, a: torch.Tensor) -> torch.Tensor:
        """The rank's part of a full lora_A [r, in] (its input columns, or all of it)."""
        dim, start, end = self.shard
        return a[:, start:end] if dim == 1 else a

    def part_b(self, b: torch.Tensor) -> torch.Tensor:
        """The rank's part of a full lora_B [out, r] (its output rows, or all of it)."""
        dim, start, end = self.shard
        return b[start:end] if dim == 0 else b


class LoraSlots:
    """`max_loras` adapter slots of up to rank `max_rank` for every decoder layer of `model_config`, on one
    device in one dtype. `target_modules` limits the memory to the fused layers holding those modules (a
    fused layer gets slots for all of its modules). `shards`: module -> the rank's `Shard` of its weight under
    tensor parallelism (None, or a module left out: all of it); the modules of one fused linear share their
    inputs."""

    def __init__(self, model_config: ModelConfig, *, max_loras: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype, target_modules: tuple[str, ...] = LORA_MODULES,
                 shards: dict[str, Shard] | None = None):
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
        if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_rank must be a positive integer, got {max_rank!r}")
        shapes = lora_module_shapes(model_config)
        unknown = [m for m in target_modules if m not in shapes]
        if unknown or not target_modules:
            raise ValueError(f"target_modules must be among {sorted(shapes)} for this model; got "
                             f"{list(target_modules)}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.num_layers = model_config.num_layers
        self.device, self.dtype = torch.device(device), dtype
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=self.device)  # [S]; 0 in empty slots
        self.ranks = [0] * max_loras  # per slot: the loaded adapter's rank, 0 when empty
        self._loaded: list[tuple[tuple[int, str], ...]] = [()] * max_loras  # per slot: its adapter's (layer, module)s
        self._places: dict[str, _Place] = {}
        self.stacks: dict[tuple[int, str], LoraStack] = {}  # (layer, fused linear) -> its slots
        for fused, modules in FUSED_MODULES.items():
            if not any(m in target_modules for m in modules):
                continue
            cut = [(shards or {}).get(m) or (0, 0, shapes[m][0]) for m in modules]
            widths = tuple(end - start if dim == 0 else shapes[m][0] for m, (dim, start, end) in zip(modules, cut))
            inps = {end - start if dim == 1 else shapes[m][1] for m, (dim, start, end) in zip(modules, cut)}
            assert len(inps) == 1, (fused, cut)  # one input for the fused linear
            inp = inps.pop()
            for i, module in enumerate(modules):
                self._places[module] = _Place(fused, i, sum(widths[:i]), widths[i], inp, shapes[module], cut[i])
            for layer in range(self.num_layers):
                self.stacks[(layer, fused)] = LoraStack(
                    A=torch.zeros(max_loras, len(modules) * max_rank, inp, dtype=dtype, device=self.device),
                    B=torch.zeros(max_loras, sum(widths), max_rank, dtype=dtype, device=self.device),
                    slices=widths, modules=modules)

    @property
    def modules(self) -> tuple[str, ...]:
        """The checkpoint modules that have slots."""
        return tuple(m for m in LORA_MODULES if m in self._places)

    def stack(self, layer: int, fused: str) -> LoraStack:
        """The slots of runtime linear `fused` ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") of `layer`."""
        return self.stacks[(layer, fused)]

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be an integer in [0, {self.max_loras}), got {slot!r}")

    def _module_views(self, slot: int, layer: int, module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        place = self._places[module]
        stack = self.stacks[(layer, place.fused)]
        a0 = place.index * self.max_rank
        return (stack.A[slot, a0:a0 + rank],  # [r, in], contiguous
                stack.B[slot, place.row0:place.row0 + place.out, :rank])  # [out, r], row stride max_rank

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` into `slot` in place: everything the slot held is zeroed, then the adapter's A / B are
        copied (converted to the slots' dtype) and its scaling set. Checked in full before anything is written:
        a refused adapter leaves the slot as it was."""
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r}: rank {adapter.rank} exceeds max_rank {self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"adapter {adapter.name!r}: layer {layer} is past the model's {self.num_layers}")
            if module not in self._places:
                raise ValueError(f"adapter {adapter.name!r}: module {module} has no slots (slots exist for "
                                 f"{list(self.modules)})")
            out, inp = self._places[module].full
            if tuple(a.shape) != (adapter.rank, inp) or tuple(b.shape) != (out, adapter.rank):
                raise ValueError(f"adapter {adapter.name!r}: layer {layer} {module} has lora_A {tuple(a.shape)}, "
                                 f"lora_B {tuple(b.shape)}; the slots need [{adapter.rank}, {inp}], "
                                 f"[{out}, {adapter.rank}]")
        self._zero(slot)
        with torch.no_grad():
            for (layer, module), (a, b) in adapter.weights.items():
                a_view, b_view = self._module_views(slot, layer, module, adapter.rank)
                place = self._places[module]
                a_view.copy_(place.part_a(a))
                b_view.copy_(place.part_b(b))
            self.scaling[slot].fill_(adapter.scaling)
        self.ranks[slot] = adapter.rank
        self._loaded[slot] = tuple(sorted(adapter.weights))

    def clear(self, slot: int) -> None:
        """Empty `slot` in place: zero A, B and scaling (a token still pointing at it gets nothing added)."""
        self._check_slot(slot)
        self._zero(slot)
        self.scaling[slot].zero_()
        self.ranks[slot] = 0
        self._loaded[slot] = ()

    def _zero(self, slot: int) -> None:
        with torch.no_grad():
            for stack in self.stacks.values():
                stack.A[slot].zero_()
                stack.B[slot].zero_()

    def views(self, slot: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The views of the adapter in `slot`: per (layer, module) it adapts, (A [r, in], B [out, r]) of the
        rank's part (`checkpoint_slots`; all of it without tensor parallelism) sharing the slots' storage (writing
        them is writing the slot; keep to the same rank)."""
        self._check_slot(slot)
        if not self.ranks[slot]:
            raise ValueError(f"slot {slot} holds no adapter")
        return {key: self._module_views(slot, *key, self.ranks[slot]) for key in self._loaded[slot]}

    def named_views(self, slot: int) -> dict[str, torch.Tensor]:
        """`views(slot)` by PEFT tensor name (`...layers.{i}.self_attn.q_proj.lora_A.weight`: A, `lora_B`: B)."""
        named = {}
        for (layer, module), (a, b) in self.views(slot).items():
            named[peft_tensor_name(layer, module, "A")] = a
            named[peft_tensor_name(layer, module, "B")] = b
        return named

    def checkpoint_slots(self, slot: int, shards: dict[str, Shard] | None = None) -> dict[str, CheckpointSlot]:
        """Per PEFT tensor name of `named_views(slot)`: the full tensor's shape and the range the rank's view
        holds (`CheckpointSlot.shard` along `dim`; `param` is the name itself). `shards`: another rank's (the
        `shards` it was built with), for the ranges that rank holds."""
        rank, slots = self.ranks[slot], {}
        for layer, module in self.views(slot):
            place = self._places[module]
            out, inp = place.full
            dim, start, end = place.shard if shards is None else shards.get(module) or (0, 0, out)
            for kind, shape, along in (("A", (rank, inp), 1), ("B", (out, rank), 0)):
                name = peft_tensor_name(layer, module, kind)
                slots[name] = CheckpointSlot(param=name, shape=shape, dim=along,
                                             shard=(start, end) if dim == along else None)
        return slots
