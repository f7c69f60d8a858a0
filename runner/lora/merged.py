"""LoRA's merged mode (`EngineConfig.lora_merged`): one adapter at a time folded into the live base weights, so
its requests run the plain model path (no slots, no hooks, no per-token adapter index).

`MergedLora` works on the runner's checkpoint view of the weights (`runner.loader.CheckpointWeights`: the
checkpoint tensor `model.layers.{i}.self_attn.q_proj.weight` [out, in] is a view of a fused parameter). It keeps

    base[(layer, module)]   [out, in], the weights' dtype, on their device: a copy of the base weight of every
                            module it may merge into (`target_modules`, every decoder layer), allocated when it
                            is built (the engine builds it before sizing the KV cache, so that memory is counted:
                            for all seven modules of a dense model about the size of its decoder layers' linear
                            weights) and filled from the live weights at each load
    A, B per adapted module [r, in], [out, r] in the weights' dtype: the loaded adapter's (what pushes write)

and writes W = W_base + scaling * (B @ A) of every adapted module, computed in float32 from the kept base and
rounded once to the weights' dtype (peft's merge computes the same sum in float32; for bfloat16 weights peft
rounds the delta before adding it, here only the sum is rounded). Every write is in place into the live
parameters, so captured CUDA graphs stay valid. A push (`target()`, a `weight_updates.WeightTarget` over A / B in
PEFT's names) marks the modules it wrote, and `fold_written()` recomputes exactly those from the base copy;
`clear()` copies the base back, bitwise, whatever pushes happened in between (nothing is ever subtracted). A
fold holds one float32 [out, in] temporary at a time. Live views are taken at each use (a level-2 sleep moves
the parameters' storage); the base copy and A / B stay on the device while the engine sleeps.

Not here: which name is loaded, versions, the refusals around requests and base updates (rollout/loras.py);
tensor-parallel shards (the engine refuses LoRA under tensor parallelism).
"""

from __future__ import annotations

import torch

from runner.lora.adapters import PARENT_MODULE, LORA_MODULES, LoraAdapter, lora_module_shapes, peft_tensor_name
from runner.lora.runtime import LoraSlotTarget
from runner.model_config import ModelConfig
from runner.models.layout import CheckpointSlot


class MergedLora:
    """The base copy of `target_modules` (None: every module the model supports) of every decoder layer of the
    model whose checkpoint view is `weights`, and the adapter folded into them (none at first)."""

    def __init__(self, weights, model_config: ModelConfig, *, target_modules: tuple[str, ...] | None) -> None:
        shapes = lora_module_shapes(model_config)
        if target_modules is None:
            target_modules = tuple(m for m in LORA_MODULES if m in shapes)
        unknown = [m for m in target_modules if m not in shapes]
        if unknown:
            raise ValueError(f"EngineConfig.lora_target_modules: {unknown} are not adapter targets of this model "
                             f"(supported: {sorted(shapes)})")
        self.model_config = model_config
        self.modules = tuple(m for m in LORA_MODULES if m in target_modules)
        self.device = weights.device
        self._weights = weights  # views are taken at each use: sleeping moves the parameters' storage
        self._names: dict[tuple[int, str], str] = {}  # (layer, module) -> checkpoint name of its weight
        self._base: dict[tuple[int, str], torch.Tensor] = {}  # (layer, module) -> its base copy [out, in]
        for layer in range(model_config.num_layers):
            for module in self.modules:
                name = self._names[(layer, module)] = f"model.layers.{layer}.{PARENT_MODULE[module]}.{module}.weight"
                view = weights.view(name)
                assert tuple(view.shape) == shapes[module], (layer, module, tuple(view.shape))
                self._base[(layer, module)] = torch.empty_like(view)
        self.adapter: LoraAdapter | None = None  # the merged one: its A / B on the device, in the weights' dtype
        self._written: set[tuple[int, str]] = set()  # modules a push wrote since the last fold

    @property
    def nbytes(self) -> int:
        """Device bytes of the base copy."""
        return sum(t.numel() * t.element_size() for t in self._base.values())

    def load(self, adapter: LoraAdapter) -> tuple[int, tuple[str, ...]]:
        """Fold `adapter` (validated against the model: runner/lora/adapters.py) into the weights; returns its
        (rank, modules). Refused (ValueError, nothing written) when an adapter is merged already or it adapts
        a module without a base copy."""
        if self.adapter is not None:
            raise ValueError(f"adapter {self.adapter.name!r} is merged already; clear it first")
        missing = [m for m in adapter.modules if m not in self.modules]
        if missing:
            raise ValueError(f"adapter {adapter.name!r} adapts {missing}, whose base weights are not kept here "
                             f"(EngineConfig.lora_target_modules gives {list(self.modules)})")
        weights = {}
        for key, (a, b) in adapter.weights.items():
            base = self._base[key]
            assert a.shape == (adapter.rank, base.shape[1]) and b.shape == (base.shape[0], adapter.rank), key
            weights[key] = (a.to(self.device, base.dtype, copy=True).contiguous(),
                            b.to(self.device, base.dtype, copy=True).contiguous())
        with torch.no_grad():
            for key in weights:
                self._base[key].copy_(self._weights.view(self._names[key]))
        self.adapter = LoraAdapter(name=adapter.name, rank=adapter.rank, scaling=adapter.scaling, weights=weights)
        self._fold(weights)
        return adapter.rank, adapter.modules

    def clear(self) -> None:
        """Write the base weights back (bitwise as they were at the load) and forget the adapter."""
        assert self.adapter is not None, "no adapter is merged"
        with torch.no_grad():
            for key in self.adapter.weights:
                self._weights.view(self._names[key]).copy_(self._base[key])
        self.adapter = None
        self._written.clear()

    def target(self) -> "MergedLoraTarget":
        """The weight-update target of the merged adapter's A / B (PEFT names); writes mark their modules for
        `fold_written`."""
        assert self.adapter is not None, "no adapter is merged"
        return MergedLoraTarget(self)

    def fold_written(self) -> None:
        """Recompute the merged weights of the modules written through `target()` since the last fold."""
        keys, self._written = self._written, set()
        self._fold(keys)

    def _fold(self, keys) -> None:
        adapter = self.adapter
        with torch.no_grad():
            for key in keys:
                a, b = adapter.weights[key]
                merged = torch.mm(b.float(), a.float()).mul_(adapter.scaling)  # [out, in] float32, as peft's delta
                merged.add_(self._base[key])  # + W_base in float32 (the sum peft's merge forms)
                self._weights.view(self._names[key]).copy_(merged)  # rounded once to the weights' dtype, in place

    def release(self) -> None:
        """Drop the base copy and the adapter (the engine closes)."""
        self._base, self.adapter, self._written = {}, None, set()


class MergedLoraTarget(LoraSlotTarget):
    """A `weight_updates.WeightTarget` over the merged adapter's A [r, in] / B [out, r] (PEFT tensor names), like a
    slot's; every write also marks its module, whose merged weight `MergedLora.fold_written` recomputes."""

    def __init__(self, merged: MergedLora) -> None:
        views, self._keys = {}, {}
        for (layer, module), (a, b) in merged.adapter.weights.items():
            for which, tensor in (("A", a), ("B", b)):
                name = peft_tensor_name(layer, module, which)
                views[name], self._keys[name] = tensor, (layer, module)
        slots = {name: CheckpointSlot(param=name, shape=tuple(v.shape)) for name, v in views.items()}  # whole
        super().__init__(views, slots, merged.device)
        self._merged = merged

    def write_dense(self, name: str, tensor: torch.Tensor) -> None:
        self._merged._written.add(self._keys[name])
        super().write_dense(name, tensor)

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        self._merged._written.add(self._keys[name])
        super().write_patch(name, flat_indices, values)

    def writable_views(self, names: list[str]) -> list[torch.Tensor] | None:
        self._merged._written.update(self._keys[name] for name in names)  # lent to be written
        return super().writable_views(names)


__all__ = ["MergedLora", "MergedLoraTarget"]
