"""Sender side: turn new trainer weights into Dense/Patch records against the last pushed version.

``WeightDiffer`` keeps a snapshot of the weights the rollout side holds (in the engine dtype) and
their checksums. ``encode`` casts the new weights to the engine dtype (fp32 master weights become
bf16 first), compares bit patterns (int16 view for bf16/fp16, int32 for fp32, so -0.0 vs 0.0 and
NaN payloads count as changes), and picks Dense or Patch per parameter by bytes. It changes nothing:
the snapshot moves only when the caller reports that the rollout side applied the push
(``commit``). A push that was not committed is simply diffed again next time against the same base.

This module does not move bytes (see ``transports``) and does not know the engine.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from weight_updates.checksum import check_dtype_supported, checksum_tensor, patch_checksum_delta
from weight_updates.encoding import MAX_PATCH_NUMEL, Dense, PackedIndices, Patch, Update, apply_bit_deltas, bit_deltas
from weight_updates.target import ParamSpec

Weights = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True, kw_only=True, slots=True)
class DiffConfig:
    """How the differ chooses encodings."""

    max_patch_ratio: float = 0.5
    """Send a Patch when its bytes are <= this fraction of the dense bytes; scatters cost more per
    byte than copies, so a patch must be clearly smaller to win."""
    bit_deltas: bool = True
    """Send a patch's values as int8 bit deltas against the last push when that is smaller (one byte per
    changed element, plus the full value of each change too large for a byte)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_patch_ratio <= 1.0:
            raise ValueError(f"max_patch_ratio must be in [0, 1], got {self.max_patch_ratio}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamStats:
    name: str
    encoding: str  # "dense" | "patch"
    numel: int
    num_changed: int  # -1 when there was no snapshot to compare with
    nbytes: int

    @property
    def changed_fraction(self) -> float:
        return self.num_changed / self.numel if self.numel else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PushStats:
    params: tuple[ParamStats, ...]
    num_dense: int
    num_patch: int
    nbytes: int  # payload bytes of all records
    dense_nbytes: int  # bytes had every parameter been sent dense
    changed_fraction: float  # over parameters that had a snapshot

    def to_json(self) -> dict:
        return {
            "num_dense": self.num_dense,
            "num_patch": self.num_patch,
            "bytes": self.nbytes,
            "dense_bytes": self.dense_nbytes,
            "changed_fraction": self.changed_fraction,
        }


@dataclass(kw_only=True, slots=True)
class PendingPush:
    """The result of ``WeightDiffer.encode``: records to send, and what ``commit`` needs."""

    updates: list[Update]
    stats: PushStats
    base_generation: int  # the differ generation this push was diffed against
    new_tensors: dict[str, torch.Tensor] = field(repr=False)  # name -> engine-dtype weights (dense only)
    patch_indices: dict[str, torch.Tensor] = field(repr=False)  # name -> [num_changed] int64 (patch only)
    new_checksums: dict[str, torch.Tensor] = field(repr=False)  # name -> 0-dim int64


def iter_named_tensors(weights: Weights) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module's parameters, a mapping, or an iterable of pairs."""
    if isinstance(weights, torch.nn.Module):
        return ((n, p.detach()) for n, p in weights.named_parameters())
    if isinstance(weights, Mapping):
        return weights.items()
    return weights


class WeightDiffer:
    """Keeps the last pushed weights and encodes the next push against them.

    Usage::

        differ = WeightDiffer(specs)                 # empty snapshot: first push is all Dense
        push = differ.encode(model)                  # validates everything; changes nothing
        result = transport.send(version, push.updates)
        differ.commit(push)                          # only after the rollout side succeeded

    Memory: one engine-dtype copy of every parameter pushed so far, on ``device``.
    """

    def __init__(self, specs: Mapping[str, ParamSpec], *, device: torch.device | str = "cpu", config: DiffConfig = DiffConfig()) -> None:
        for name, spec in specs.items():
            if not spec.dtype.is_floating_point:
                raise ValueError(f"{name}: engine dtype {spec.dtype} is not a floating point dtype")
            check_dtype_supported(spec.dtype)
        self.specs = dict(specs)
        self.device = torch.device(device)
        self.config = config
        self.generation = 0  # bumped by every commit
        self._snapshot: dict[str, torch.Tensor] = {}  # name -> checkpoint shape, engine dtype
        self._checksums: dict[str, torch.Tensor] = {}  # name -> 0-dim int64 on device

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Forget the snapshot (all, or ``names``) so the next push sends those parameters dense."""
        for name in list(self._snapshot) if names is None else names:
            self._snapshot.pop(name, None)
            self._checksums.pop(name, None)
        self.generation += 1

    def encode(self, weights: Weights) -> PendingPush:
        """Validate all of ``weights``, then build one record per parameter. Raises ValueError."""
        cast: dict[str, torch.Tensor] = {}
        for name, tensor in iter_named_tensors(weights):
            spec = self.specs.get(name)
            if spec is None:
                raise ValueError(f"unknown parameter {name!r} (not in the engine's checkpoint specs)")
            if name in cast:
                raise ValueError(f"parameter {name!r} appears twice in one push")
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {spec.shape}")
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating point dtype")
            cast[name] = tensor
        updates: list[Update] = []
        params: list[ParamStats] = []
        new_tensors: dict[str, torch.Tensor] = {}
        new_checksums: dict[str, torch.Tensor] = {}
        patch_indices: dict[str, torch.Tensor] = {}
        for name, tensor in cast.items():
            new = tensor.detach().to(device=self.device, dtype=self.specs[name].dtype).contiguous()
            update, indices, num_changed, check = self._encode_one(name, new)
            updates.append(update)
            new_checksums[name] = check
            if indices is not None:
                patch_indices[name] = indices
            else:
                # Keep our own copy: ``new`` may alias the caller's live tensor.
                new_tensors[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new
            params.append(ParamStats(name=name, encoding="dense" if isinstance(update, Dense) else "patch", numel=new.numel(), num_changed=num_changed, nbytes=update.nbytes))
        compared = [p for p in params if p.num_changed >= 0]
        stats = PushStats(
            params=tuple(params),
            num_dense=sum(p.encoding == "dense" for p in params),
            num_patch=sum(p.encoding == "patch" for p in params),
            nbytes=sum(p.nbytes for p in params),
            dense_nbytes=sum(p.numel * self.specs[p.name].dtype.itemsize for p in params),
            changed_fraction=sum(p.num_changed for p in compared) / max(1, sum(p.numel for p in compared)),
        )
        return PendingPush(updates=updates, stats=stats, base_generation=self.generation, new_tensors=new_tensors, patch_indices=patch_indices, new_checksums=new_checksums)

    def _encode_one(self, name: str, new: torch.Tensor) -> tuple[Update, torch.Tensor | None, int, torch.Tensor]:
        """One parameter -> (record, patch indices or None, num changed or -1, new checksum)."""
        old = self._snapshot.get(name)
        if old is None:
            check = checksum_tensor(new)
            return Dense(name=name, tensor=new, checksum=int(check.item())), None, -1, check
        int_dtype = {2: torch.int16, 4: torch.int32, 1: torch.int8}[new.element_size()]
        changed = torch.ne(new.view(-1).view(int_dtype), old.view(-1).view(int_dtype))  # [numel]
        indices = changed.nonzero().squeeze(1)  # [num_changed] int64
        num_changed = indices.numel()
        budget = new.numel() * new.element_size() * self.config.max_patch_ratio  # bytes
        values_bytes = num_changed * new.element_size()
        if new.numel() < MAX_PATCH_NUMEL and values_bytes <= budget:
            packed = PackedIndices.encode(indices)
            if packed.nbytes + values_bytes <= budget:
                values = new.view(-1)[indices]  # [num_changed]
                old_values = old.view(-1)[indices]  # [num_changed]
                check = self._checksums[name] + patch_checksum_delta(old_values, values, indices)
                patch = Patch(name=name, indices=packed, values=values, checksum=int(check.item()))
                if self.config.bit_deltas and new.element_size() > 1:
                    deltas, escapes = bit_deltas(old_values, values)
                    delta_patch = Patch(name=name, indices=packed, values=deltas, escapes=escapes, checksum=patch.checksum)
                    if delta_patch.nbytes < patch.nbytes:
                        patch = delta_patch
                return patch, indices, num_changed, check
        check = checksum_tensor(new)
        return Dense(name=name, tensor=new, checksum=int(check.item())), None, num_changed, check

    def commit(self, push: PendingPush) -> None:
        """Record that the rollout side applied ``push``: the snapshot becomes its weights.

        Raises ValueError if the snapshot moved since ``push`` was encoded (a stale push).
        """
        if push.base_generation != self.generation:
            raise ValueError(f"stale push: encoded against generation {push.base_generation}, differ is at {self.generation}")
        for update in push.updates:
            if isinstance(update, Dense):
                snap = self._snapshot.get(update.name)
                if snap is None:
                    self._snapshot[update.name] = push.new_tensors[update.name]
                else:
                    snap.copy_(push.new_tensors[update.name])
            else:
                flat = self._snapshot[update.name].view(-1)
                indices = push.patch_indices[update.name]
                values = update.values
                if update.is_delta:
                    values = apply_bit_deltas(flat[indices], update.values, update.escapes)
                flat[indices] = values
            self._checksums[update.name] = push.new_checksums[update.name]
        self.generation += 1
