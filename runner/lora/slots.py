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
name lives in which slot is the caller's business; so are tensor-parallel shards (the stacks here have the
full, unsharded shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.lora.adapters import LORA_MODULES, LoraAdapter, lora_module_shapes, peft_tensor_name
from runner.model_config import ModelConfig

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


@dataclass(frozen=True, slots=True)
class _Place:
    fused: str  # runtime linear
    index: int  # the module's slice in it
    row0: int  # first output column of the slice
    out: int
    inp: int


class LoraSlots:
    """`max_loras` adapter slots of up to rank `max_rank` for every decoder layer of `model_config`, on one
    device in one dtype. `target_modules` limits the memory to the fused layers holding those modules (a
    fused layer gets slots for all of its modules)."""

    def __init__(self, model_config: ModelConfig, *, max_loras: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype, target_modules: tuple[str, ...] = LORA_MODULES):
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
            widths = tuple(shapes[m][0] for m in modules)
            inp = shapes[modules[0]][1]
            for i, module in enumerate(modules):
                self._places[module] = _Place(fused, i, sum(widths[:i]), widths[i], inp)
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
            place = self._places[module]
            if tuple(a.shape) != (adapter.rank, place.inp) or tuple(b.shape) != (place.out, adapter.rank):
                raise ValueError(f"adapter {adapter.name!r}: layer {layer} {module} has lora_A {tuple(a.shape)}, "
                                 f"lora_B {tuple(b.shape)}; the slots need [{adapter.rank}, {place.inp}], "
                                 f"[{place.out}, {adapter.rank}]")
        self._zero(slot)
        with torch.no_grad():
            for (layer, module), (a, b) in adapter.weights.items():
                a_view, b_view = self._module_views(slot, layer, module, adapter.rank)
                a_view.copy_(a)
                b_view.copy_(b)
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
        """The checkpoint-coordinate views of the adapter in `slot`: per (layer, module) it adapts, (A [r, in],
        B [out, r]) sharing the slots' storage (writing them is writing the slot; keep to the same rank)."""
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
