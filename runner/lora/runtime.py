"""LoRA in a running model: the runner's adapter slots, the hooks on the linears they target, each forward's
per-token slot assignment, and the weight-update target of one slot.

`LoraRuntime` (one per `ModelRunner`, only when `RunnerConfig.max_loras > 0`) owns a `LoraSlots` and puts a
`LoraHook` on every fused linear of every decoder layer that has slots (`qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`; `runner.layers.Linear.lora`). A forward that serves adapters runs inside `runtime.tokens(idx)`: idx [T]
holds each token's slot (-1: the base model), turned once per forward into the `kernels.lora.LoraBatch` every hook
of the forward shares (on CUDA, one launch; inside a captured decode graph that is part of the graph, so a replay
re-sorts the tokens of each step's idx), and each hook adds its layer's stack's delta to the base output:
`add_lora_ref` on the CPU; on CUDA, with `overlap` (`EngineConfig.lora_overlap`, off by default), in two halves
around the base matmul: `start(x)`, called by the Linear before its matmul, forks the shrink onto the runtime's side
stream (`kernels.lora.lora_shrink_partials`; one high-priority stream per runtime, made on first use), so it runs
while the current stream runs the matmul, and the hook called on the output joins it and runs the expand
(`lora_expand_partials`); in a captured decode graph the fork and the join are the graph's edges (the shrink a
branch beside the matmul). Without `overlap`, `add_lora` after the matmul (its two launches); both give the same bits.
With `fused_linear` (`EngineConfig.lora_fused_linear`), a forward of a decode step's few tokens takes the linear
from the Linear altogether (`LoraHook.linear`: the base GEMM and the delta in one Triton launch).
With `deferred` (`EngineConfig.lora_deferred`), the hooks of o_proj and down_proj, whose outputs only join the
residual sum, add their delta to that sum instead: the decoder layer hands it over just before the layer
(`Linear.lora_residual`), `start(x)` forks the whole `add_lora` into it onto the side stream and the call joins it
after the matmul (on the CPU, `add_lora_ref` in `start`); the residual add after the layer then sums both.
gate_up_proj's hook computes its delta on the side stream into a float32 buffer of its own, which the SiLU-and-mul
reading the output takes (`Linear.lora_delta`, joining the side stream) and adds before the activation; qkv_proj's
computes it the same way and adds it to the output after the matmul (one elementwise add in place of the hook's
kernels there); the deferred hooks round their sums in another order. Outside `tokens` (or with idx None) the hooks
add nothing, so scoring and the profile run see the base model unless they ask, and a step without adapter tokens
costs what the base model's does (the runner's decode graphs have a variant captured that way,
runner/cuda_graph.py). A row-parallel layer (o_proj, down_proj) adds its delta to its own output, which without
tensor parallelism is the whole sum.

Under tensor parallelism (`tp`) each rank's slots hold its shard of every adapter (runner/lora/slots.py, cut as
the model's checkpoint layout cuts the base weight of each module), each rank loads the adapter directory itself,
and a row-parallel layer adds its partial delta before its all-reduce (runner/parallel/layers.py), so the ranks'
partial deltas sum to the full one. Pushes stay in full PEFT coordinates on every rank: `target(slot)` narrows
dense records and filters patch indices to the rank's part and reads full tensors with one all-gather (so every
rank runs the same session: `prepare` / `commit` / `publish` / `rollback`, each a collective RPC of the engine,
rollout/loras.py); `export` assembles them the same way. The deferred deltas (`deferred`) add a rank's partial
delta to the replicated residual sum, so the engine refuses them under tensor parallelism.

Slots are written only in place (`load`, `clear`, `LoraSlotTarget` writes), so captured graphs stay valid across
swaps and pushes. Which name lives in which slot is the engine's business (rollout/loras.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from runner.layers import Linear
from runner.lora.adapters import LORA_MODULES, LoraAdapter, lora_module_shapes, read_adapter
from runner.lora.slots import FUSED_MODULES, LoraSlots, LoraStack, Shard
from runner.model_config import ModelConfig
from runner.models.layout import CheckpointSlot
from runner.weight_sync import StagedOnRank
from weight_updates.target import ParamSpec

_PARENTS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_DEFERRED = {"o_proj": "residual", "down_proj": "residual",  # outputs that only join the residual sum
             "gate_up_proj": "consumer",  # read by the SiLU-and-mul alone
             "qkv_proj": "add"}  # its delta joined and added after the matmul (EngineConfig.lora_deferred)
DEFER_MAX_TOKENS = 512
"""The most tokens a forward may have for gate_up_proj and qkv_proj to defer their delta: a float32 delta of the
output costs 4 bytes an element (29 MB for gate_up at 256 tokens of an 8B model), and a long prefill's hooks are
small next to its matmuls."""


class _Deferred:
    """What `LoraHook.start` returns when the layer's delta is left to the next kernel: the stream the delta is
    computed on (None: already done) and, for a consumer's delta, the float32 delta [T, N] itself."""

    __slots__ = ("stream", "delta")

    def __init__(self, stream, delta: torch.Tensor | None = None) -> None:
        self.stream, self.delta = stream, delta

    def join(self, device: torch.device) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(device).wait_stream(self.stream)


class LoraHook:
    """What a targeted `Linear` calls: `start(x)` before its matmul, then the hook itself on the output, which adds
    the delta of each token's adapter to it (in place). Under `EngineConfig.lora_deferred` (`defer`) the delta is
    computed beside the matmul: o_proj's and down_proj's hooks add it to the residual sum the decoder layer gave
    them (`set_residual`) instead, gate_up_proj's leaves it, in float32, to the SiLU-and-mul that reads the output
    (`take_delta`), and qkv_proj's adds the float32 delta to the output after the matmul."""

    __slots__ = ("runtime", "stack", "defer", "residual", "pending")

    def __init__(self, runtime: "LoraRuntime", stack: LoraStack, defer: str | None = None) -> None:
        assert defer in (None, "residual", "consumer", "add"), defer
        self.runtime, self.stack, self.defer = runtime, stack, defer
        self.residual = None  # [T, N]: the residual sum the next call's output joins (set_residual), or None
        self.pending = None  # _Deferred: the delta of the last call, until the consumer takes it (take_delta)

    def set_residual(self, residual: torch.Tensor) -> None:
        """The residual sum [T, N] the layer's next output is about to join (the decoder layer calls this just
        before the layer): with `defer="residual"`, in a forward with adapter tokens, the next call adds its
        delta there, in place."""
        if self.defer == "residual" and self.runtime.current is not None:
            self.residual = residual

    def take_delta(self) -> torch.Tensor | None:
        """With `defer="consumer"`: the float32 delta [T, N] of the last call, for the kernel that reads the
        output to add (the current stream joins the stream computing it); None when there is none."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.join(pending.delta.device)
        return pending.delta

    def start(self, x: torch.Tensor):
        """In a forward with adapter tokens: a deferred delta (into the residual sum set, or into a float32 delta
        for the consumer) started, on CUDA forked onto the side stream (on the CPU: done here); else with
        `runtime.overlap`, this layer's shrink of x [T, in] forked onto the side stream, a
        `kernels.lora.LoraPartials`. Whatever it returns goes to the call; None: the call does all of the work."""
        runtime = self.runtime
        if runtime.current is None:
            return None
        residual, self.residual = self.residual, None
        if residual is not None and residual.dim() == 2 and residual.is_contiguous():
            return self._deferred(x, residual)
        if self.defer in ("consumer", "add") and x.dim() == 2 and x.shape[0] <= DEFER_MAX_TOKENS:
            return self._deferred(x, torch.empty(x.shape[0], self.stack.B.shape[1], dtype=torch.float32,
                                                 device=x.device), zero=True)
        if not runtime.overlap:
            return None
        from kernels.lora import lora_shrink_partials

        return lora_shrink_partials(x, self.stack.A, runtime.current, stream=runtime.side_stream(x.device))

    def _deferred(self, x: torch.Tensor, into: torch.Tensor, zero: bool = False) -> _Deferred:
        """The delta added into `into` [T, N] (zeroed first with `zero`: then the delta alone)."""
        stack, scaling, tokens = self.stack, self.runtime.slots.scaling, self.runtime.current
        delta = into if zero else None
        if not x.is_cuda:
            from kernels.lora_ref import add_lora_ref

            add_lora_ref(into.zero_() if zero else into, x, stack.A, stack.B, tokens, scaling, slices=stack.slices)
            return _Deferred(None, delta)
        from kernels.lora import add_lora

        side = self.runtime.side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            add_lora(into.zero_() if zero else into, x, stack.A, stack.B, tokens, scaling, slices=stack.slices)
        return _Deferred(side, delta)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """With `runtime.fused_linear`, in a forward with adapter tokens of at most
        `kernels.lora_linear.LinearLoraConfig.max_rows` rows (no autograd): x [T, in] weight^T (+ bias) and the
        adapters' delta in one launch (`kernels.lora_linear.linear_lora`), [T, N]. None otherwise: the layer runs its
        matmul, then `start` / the call."""
        runtime = self.runtime
        if (not runtime.fused_linear or runtime.current is None or not x.is_cuda or x.dim() != 2
                or torch.is_grad_enabled()):
            return None
        from kernels.lora_linear import linear_config_for, linear_lora

        config = linear_config_for(weight.shape[1], weight.shape[0])  # the tile of the layer's shape
        if not 0 < x.shape[0] <= config.max_rows:
            return None
        stack = self.stack
        return linear_lora(x, weight, bias, stack.A, stack.B, runtime.current, runtime.slots.scaling,
                           slices=stack.slices, config=config)

    def __call__(self, out: torch.Tensor, x: torch.Tensor, partials=None) -> torch.Tensor:
        """out [T, N] += the adapters' delta for x [T, in]; `partials`: what `start(x)` returned."""
        tokens = self.runtime.current
        if tokens is None:
            assert partials is None
            return out
        stack, scaling = self.stack, self.runtime.slots.scaling
        if isinstance(partials, _Deferred):
            if self.defer == "consumer":  # the kernel reading the output adds it (take_delta)
                self.pending = partials
                return out
            partials.join(out.device)  # the delta is in the residual sum, or is added here
            return out if partials.delta is None else out.add_(partials.delta)
        if partials is not None:
            from kernels.lora import lora_expand_partials

            return lora_expand_partials(out, partials, stack.B, scaling, slices=stack.slices)
        if out.is_cuda:
            from kernels.lora import add_lora

            return add_lora(out, x, stack.A, stack.B, tokens, scaling, slices=stack.slices)
        from kernels.lora_ref import add_lora_ref

        return add_lora_ref(out, x, stack.A, stack.B, tokens, scaling, slices=stack.slices)


class LoraRuntime:
    """`max_loras` adapter slots of up to rank `max_rank` on the model's device, hooked into `model`."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, *, max_loras: int, max_rank: int,
                 target_modules: tuple[str, ...] | None, device: torch.device, dtype: torch.dtype,
                 overlap: bool = False, deferred: bool = False, fused_linear: bool = False, tp=None) -> None:
        if target_modules is None:  # every module the model supports (a MoE model: the attention projections)
            target_modules = tuple(m for m in LORA_MODULES if m in lora_module_shapes(model_config))
        assert tp is None or not deferred, "deferred LoRA deltas under tensor parallelism"
        self.tp = tp  # runner.parallel.group.TPGroup, or None
        # per rank: module -> the Shard of its weight the rank holds (what the model's checkpoint layout says)
        self._rank_shards: list[dict[str, Shard]] = [] if tp is None else [
            _module_shards(model, rank, tp.size) for rank in range(tp.size)]
        try:
            self.slots = LoraSlots(model_config, max_loras=max_loras, max_rank=max_rank, device=device, dtype=dtype,
                                   target_modules=tuple(target_modules),
                                   shards=None if tp is None else self._rank_shards[tp.rank])
        except ValueError as e:
            raise ValueError(f"EngineConfig.lora_target_modules / max_loras / max_lora_rank: {e}") from None
        self.model_config = model_config
        self._receivers: dict = {}  # slot -> weight_updates.WeightReceiver of its pushes (made on first use)
        self._stage = StagedOnRank()  # the push `prepare` staged, until published or rolled back
        self.current = None  # the running forward's LoraBatch (CUDA) or idx [T] (CPU); None: no adapter
        self.overlap = overlap and device.type == "cuda"  # each hook's shrink on the side stream, beside the matmul
        self.fused_linear = fused_linear and device.type == "cuda"  # decode linears and their LoRA in one launch
        self._side = None  # torch.cuda.Stream: the side stream, made on first use
        self.hooks: list[LoraHook] = []
        for (layer, fused), stack in self.slots.stacks.items():
            module = getattr(getattr(model.model.layers[layer], _PARENTS[fused], None), fused, None)
            assert isinstance(module, Linear), f"layer {layer}: no {fused} Linear to hook LoRA into"
            assert (module.out_features, module.in_features) == (stack.B.shape[1], stack.A.shape[2]), (
                layer, fused, module, tuple(stack.A.shape), tuple(stack.B.shape))
            module.lora = LoraHook(self, stack, defer=_DEFERRED.get(fused) if deferred else None)
            self.hooks.append(module.lora)

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream the hooks' shrinks run on (high priority: its programs go first when the matmul beside it
        leaves room on the device)."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=device, priority=-1)
        return self._side

    @contextmanager
    def tokens(self, idx: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside use the per-token slots idx [T] (int64 on the model's device, -1: none; None: no
        adapter for any token). On CUDA the tiles are built here, once for every layer of the forward."""
        if idx is not None and idx.is_cuda:
            from kernels.lora import lora_batch

            self.current = lora_batch(idx, self.slots.max_loras)
        else:
            self.current = idx
        try:
            yield
        finally:
            self.current = None
            unconsumed = sum(hook.pending is not None for hook in self.hooks)
            for hook in self.hooks:  # nothing of this forward is kept for the next
                hook.residual = hook.pending = None
        assert not unconsumed, f"{unconsumed} deferred LoRA deltas were left unconsumed"

    # ---- adapters in and out -----------------------------------------------------------------------------
    def load(self, slot: int, name: str, path: str) -> tuple[int, tuple[str, ...]]:
        """Read the PEFT adapter directory `path`, validate it against the model and the slots, and put it into
        `slot` (whatever the slot held is zeroed first). Returns its (rank, modules). A refused adapter leaves
        the slot as it was."""
        return self.load_adapter(slot, read_adapter(path, self.model_config, name=name))

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> tuple[int, tuple[str, ...]]:
        """`load` of an adapter already read (and validated against the model)."""
        slots = self.slots
        if adapter.rank > slots.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, above EngineConfig.max_lora_rank="
                             f"{slots.max_rank}")
        missing = [m for m in adapter.modules if m not in slots.modules]
        if missing:
            raise ValueError(f"adapter {adapter.name!r} adapts {missing}, which have no slots here "
                             f"(EngineConfig.lora_target_modules gives {list(slots.modules)})")
        slots.load(slot, adapter)
        self._receivers.pop(slot, None)
        return adapter.rank, adapter.modules

    def clear(self, slot: int) -> None:
        """Empty `slot` (zeros: a token still pointing at it gets nothing added)."""
        self.slots.clear(slot)
        self._receivers.pop(slot, None)

    def target(self, slot: int) -> "LoraSlotTarget":
        """The weight-update target of the adapter in `slot` (its A / B in full PEFT names and shapes)."""
        slots = self.slots
        every = None if self.tp is None else [slots.checkpoint_slots(slot, shards) for shards in self._rank_shards]
        return LoraSlotTarget(slots.named_views(slot), slots.checkpoint_slots(slot), slots.device, tp=self.tp,
                              rank_slots=every)

    # ---- pushes on every rank (collective RPCs of rollout/loras.py under tensor parallelism) -----------------
    def prepare(self, slot: int, version: int, records: list, current_version: int, dense_rollback: bool) -> None:
        """Validate a push to the adapter in `slot` (at `current_version`) and stage it; nothing written."""
        receiver = self._receivers.get(slot)
        if receiver is None:
            from weight_updates import WeightReceiver

            receiver = self._receivers[slot] = WeightReceiver(self.target(slot), version=current_version)
        receiver.version = current_version
        self._stage.prepare(receiver, version, records, dense_rollback)

    def commit(self) -> None:
        self._stage.commit()

    def publish(self):
        return self._stage.publish()

    def rollback(self) -> str:
        return self._stage.rollback()

    def export(self, slot: int) -> list | None:
        """The adapter in `slot` as full Dense records (copies; under TP assembled with collectives, so every rank
        takes part); rank 0 returns them, other ranks None."""
        from weight_updates import Dense

        target = self.target(slot)
        records = [Dense.of(n, target.read_checkpoint_tensor(n).clone()) for n in target.checkpoint_specs()]
        return records if self.tp is None or self.tp.rank == 0 else None


def _module_shards(model: torch.nn.Module, rank: int, size: int) -> dict[str, Shard]:
    """Module -> the Shard of its weight [out, in] that rank `rank` of `size` holds, from the model's checkpoint
    layout of layer 0 (every decoder layer is cut alike)."""
    layout = model.checkpoint_layout(rank, size)
    shards = {}
    for fused, parent in _PARENTS.items():
        for module in FUSED_MODULES[fused]:
            slot = layout.get(f"model.layers.0.{parent}.{module}.weight")
            if slot is not None:
                shards[module] = (slot.dim, *slot.shard)
    return shards


class LoraSlotTarget:
    """A `weight_updates.WeightTarget` over one slot's adapter: PEFT tensor names
    (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]) in
    their full shapes, each backed by a view of the slot's stacks (the rank's part under tensor parallelism,
    `slots`), written in place. Writes keep the rank's part of a dense record or of a patch's indices; reads
    assemble the full tensor (`tp`: one all-gather when the tensor is cut, with every rank's `rank_slots`). The B
    views are strided (their rows are max_rank long) unless r = max_rank, so only whole, contiguous views are lent
    for batched scatters."""

    def __init__(self, views: dict[str, torch.Tensor], slots: dict[str, CheckpointSlot], device: torch.device, *,
                 tp=None, rank_slots: list[dict[str, CheckpointSlot]] | None = None) -> None:
        assert (tp is None) == (rank_slots is None)
        self.views, self.slots = views, slots
        self._device, self._tp, self._rank_slots = device, tp, rank_slots
        self._specs = {name: ParamSpec(slots[name].shape, v.dtype) for name, v in views.items()}

    def checkpoint_specs(self) -> dict[str, ParamSpec]:
        return self._specs

    def read_checkpoint_tensor(self, name: str) -> torch.Tensor:
        if self._tp is None:
            return self.views[name]
        from runner.parallel.weights import gather_full

        return gather_full(self._tp, self.views[name], [slots[name] for slots in self._rank_slots])

    def write_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.views[name].copy_(self.slots[name].own_part(tensor))

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        from runner.parallel.weights import write_patch_part

        write_patch_part(self.views[name], self.slots[name], flat_indices, values)

    def writable_views(self, names: list[str]) -> list[torch.Tensor] | None:
        views = [self.views[name] for name in names]
        whole = all(self.slots[name].is_whole for name in names)
        return views if whole and all(v.is_contiguous() for v in views) else None

    @property
    def device(self) -> torch.device:
        return self._device


__all__ = ["LoraHook", "LoraRuntime", "LoraSlotTarget"]
