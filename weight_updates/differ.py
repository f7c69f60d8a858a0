"""Sender side: turn new trainer weights into Dense/Patch records against the last pushed version.

``WeightDiffer`` keeps a snapshot of the weights the rollout side holds (in the engine dtype) and
their checksums. ``encode`` casts the new weights to the engine dtype (fp32 master weights become
bf16 first), compares bit patterns (int16 view for bf16/fp16, int32 for fp32, so -0.0 vs 0.0 and
NaN payloads count as changes), and picks Dense or Patch per parameter by bytes. It changes nothing:
the snapshot moves only when the caller reports that the rollout side applied the push
(``commit``). A push that was not committed is simply diffed again next time against the same base.

Cost: the parameters of one engine dtype are encoded as one group in a fixed number of kernels, whatever
their number. The snapshot of a dtype is one flat buffer; the pushed weights are cast into one flat buffer
laid out the same way (one cat), compared with it in one pass, and one nonzero gives every changed
position. Per-parameter counts are a searchsorted of the parameters' ends in those positions; gaps, gaps
over the uint8 / uint16 limits, bit-delta escapes and checksum changes are computed for all changed
elements at once and summed per parameter at the segment ends (``segment_sums``). One host copy then
brings every parameter's sums, and the checksums of parameters without a snapshot (one launch per
element size on CUDA), to the host, which picks each encoding; the records are views into a few arrays
per group (gaps of each width, escaped gaps, new values, bit deltas, escapes) built without another sync.
A parameter's checksum after the push is its snapshot checksum plus the change (the checksum is linear),
so only parameters without a snapshot are read in full. Host syncs per push: the nonzero of each dtype
group with a snapshot, plus one. ``commit`` writes a group's changed elements in one indexed write and
copies its parameters that had no snapshot in one multi-tensor copy.

This module does not move bytes (see ``transports``) and does not know the engine.
"""

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kernels.common import SIGNED_VIEW, upload
from weight_updates.checksum import check_dtype_supported, checksum_tensors, position_weights
from weight_updates.encoding import (MAX_PATCH_NUMEL, Dense, Patch, Update, bit_differences, choose_gap_dtype, delta_bytes,
                                     encode_streams, gaps_over_limits, packed_nbytes, segment_ids, segment_sums,
                                     stream_gaps)
from weight_updates.target import ParamSpec
from weight_updates.aliases import expand, fused_expert_aliases

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


@dataclass(frozen=True, kw_only=True, slots=True)
class _SnapshotWrite:
    """What ``commit`` writes into the flat snapshot of one engine dtype."""

    dtype: torch.dtype
    positions: torch.Tensor  # [m] int64 changed elements, in snapshot coordinates
    values: torch.Tensor  # [m] engine dtype, their new values
    fresh: tuple[tuple[int, torch.Tensor], ...]  # (snapshot offset, [numel] new values) of parameters without a snapshot


@dataclass(kw_only=True, slots=True)
class PendingPush:
    """The result of ``WeightDiffer.encode``: records to send, and what ``commit`` needs."""

    updates: list[Update]
    stats: PushStats
    base_generation: int  # the differ generation this push was diffed against
    writes: list[_SnapshotWrite] = field(repr=False)  # one per engine dtype pushed
    checksums: dict[str, int] = field(repr=False)  # name -> checksum after the push


def checked_named_tensors(weights: Weights, specs: Mapping[str, ParamSpec]) -> dict[str, torch.Tensor]:
    """Name -> detached tensor of a push: every name known to ``specs``, given once, of its spec's shape and
    a floating dtype. Raises ValueError naming the first offender. A fused expert name of transformers
    (``...experts.gate_up_proj``, ``...experts.down_proj``; see ``weight_updates.aliases``) stands for its
    per-expert checkpoint tensors, which it is split into (views)."""
    pushed: dict[str, torch.Tensor] = {}
    for name, tensor in _expanded(iter_named_tensors(weights), specs):
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"unknown parameter {name!r} (not in the engine's checkpoint specs)")
        if name in pushed:
            raise ValueError(f"parameter {name!r} appears twice in one push")
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {spec.shape}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating point dtype")
        pushed[name] = tensor.detach()
    return pushed


def _expanded(pairs: Iterable[tuple[str, torch.Tensor]], specs: Mapping[str, ParamSpec]):
    aliases = None
    for name, tensor in pairs:
        if name not in specs:
            aliases = fused_expert_aliases(specs) if aliases is None else aliases
            if name in aliases:
                yield from expand(name, tensor, aliases[name])
                continue
        yield name, tensor


def iter_named_tensors(weights: Weights) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module's parameters, a mapping, or an iterable of pairs."""
    if isinstance(weights, torch.nn.Module):
        return ((n, p.detach()) for n, p in weights.named_parameters())
    if isinstance(weights, Mapping):
        return weights.items()
    return weights


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layout:
    """Where the parameters of one engine dtype lie in its flat snapshot (in spec order)."""

    dtype: torch.dtype
    offsets: dict[str, int]  # name -> first element
    numel: int  # elements of all of them


@dataclass(kw_only=True, slots=True)
class _Group:
    """One engine dtype's share of a push, compared on the device (before the host sync)."""

    layout: _Layout
    names: list[str]  # pushed, in snapshot order
    starts: list[int]  # [k + 1] each name's first element in ``new``
    new: torch.Tensor  # [starts[-1]] engine dtype: the pushed weights, cast, one after another
    fresh: list[str]  # the names without a snapshot (sent dense)
    fresh_checks: torch.Tensor  # [len(fresh)] int64 their checksums
    # Over the m changed elements of the names with a snapshot (None when there are none):
    sums: torch.Tensor | None = None  # [k, 5] int64 per name: changed, gaps over uint8 / uint16, escaped deltas, checksum change
    gaps: torch.Tensor | None = None  # [m] int64 index gaps, stream by stream
    values: torch.Tensor | None = None  # [m] engine dtype, the new values
    deltas: torch.Tensor | None = None  # [m] int8 bit deltas, 0 = escaped
    escaped: torch.Tensor | None = None  # [m] bool
    positions: torch.Tensor | None = None  # [m] int64 in snapshot coordinates


def _wrap64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (the checksum's arithmetic)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


class WeightDiffer:
    """Keeps the last pushed weights and encodes the next push against them.

    Usage::

        differ = WeightDiffer(specs)                 # empty snapshot: first push is all Dense
        push = differ.encode(model)                  # validates everything; changes nothing
        result = transport.send(version, push.updates)
        differ.commit(push)                          # only after the rollout side succeeded

    Memory: per engine dtype, once a parameter of it was committed, one flat engine-dtype copy of every
    parameter of that dtype in ``specs``, on ``device``. While encoding a dtype group: its pushed weights cast
    into one flat buffer, a one-byte changed mask per element, and a few bytes per changed element (tens
    of them for the per-element sums). A push holds its cast weights while a Dense record or ``commit``
    needs them, and the changed elements' positions and values.
    """

    def __init__(self, specs: Mapping[str, ParamSpec], *, device: torch.device | str = "cpu", config: DiffConfig = DiffConfig()) -> None:
        for name, spec in specs.items():
            if not spec.dtype.is_floating_point:
                raise ValueError(f"{name}: engine dtype {spec.dtype} is not a floating point dtype")
            check_dtype_supported(spec.dtype)
        self.specs = dict(specs)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.generation = 0  # bumped by every commit
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, spec in self.specs.items():
            by_dtype.setdefault(spec.dtype, []).append(name)
        self._layouts: dict[torch.dtype, _Layout] = {}
        for dtype, names in by_dtype.items():
            offsets = dict(zip(names, itertools.accumulate((self.specs[n].numel for n in names), initial=0)))
            self._layouts[dtype] = _Layout(dtype=dtype, offsets=offsets, numel=sum(self.specs[n].numel for n in names))
        self._snapshots: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [layout.numel], engine dtype
        self._checksums: dict[str, int] = {}  # the names with a snapshot -> its checksum

    @property
    def snapshot_nbytes(self) -> int:
        """Bytes of the snapshot held now, on ``device`` (one flat copy per engine dtype with a committed parameter)."""
        return sum(t.numel() * t.element_size() for t in self._snapshots.values())

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Forget the snapshot (all, or ``names``) so the next push sends those parameters dense."""
        for name in list(self._checksums) if names is None else names:
            self._checksums.pop(name, None)
        for dtype, layout in self._layouts.items():
            if not any(n in self._checksums for n in layout.offsets):
                self._snapshots.pop(dtype, None)
        self.generation += 1

    def encode(self, weights: Weights) -> PendingPush:
        """Validate all of ``weights``, then build one record per parameter. Raises ValueError."""
        pushed = checked_named_tensors(weights, self.specs)
        groups = []
        for layout in self._layouts.values():
            names = [n for n in layout.offsets if n in pushed]
            if names:
                groups.append(self._compare(layout, names, pushed))
        # The one host copy of the push: every group's per-name sums and fresh checksums.
        parts = [t.reshape(-1) for g in groups for t in (g.sums, g.fresh_checks) if t is not None]
        host = torch.cat(parts).tolist() if parts else []
        records: dict[str, tuple[Update, ParamStats]] = {}
        checksums: dict[str, int] = {}
        writes = []
        at = 0
        for g in groups:
            rows = [host[at + 5 * i : at + 5 * i + 5] for i in range(len(g.names))] if g.sums is not None else None
            at += 0 if rows is None else 5 * len(g.names)
            fresh_checks = host[at : at + len(g.fresh)]
            at += len(g.fresh)
            writes.append(self._build(g, rows, fresh_checks, records, checksums))
        params = [records[n][1] for n in pushed]
        compared = [p for p in params if p.num_changed >= 0]
        stats = PushStats(
            params=tuple(params),
            num_dense=sum(p.encoding == "dense" for p in params),
            num_patch=sum(p.encoding == "patch" for p in params),
            nbytes=sum(p.nbytes for p in params),
            dense_nbytes=sum(p.numel * self.specs[p.name].dtype.itemsize for p in params),
            changed_fraction=sum(p.num_changed for p in compared) / max(1, sum(p.numel for p in compared)),
        )
        return PendingPush(updates=[records[n][0] for n in pushed], stats=stats, base_generation=self.generation,
                           writes=writes, checksums=checksums)

    def _compare(self, layout: _Layout, names: list[str], pushed: Mapping[str, torch.Tensor]) -> _Group:
        """Cast ``names`` (snapshot order) into one buffer and compare it with the snapshot: a fixed number of
        kernels, and one host sync (the nonzero) when any of them has a snapshot."""
        dtype, device = layout.dtype, self.device
        sizes = [self.specs[n].numel for n in names]
        starts = list(itertools.accumulate(sizes, initial=0))
        k = len(names)
        new = torch.empty(starts[-1], dtype=dtype, device=device)  # [n]
        if all(pushed[n].device == device for n in names):
            torch.cat([pushed[n].reshape(-1) for n in names], out=new)  # casts on the way
        else:  # one move per tensor, straight into place (cast where ``Tensor.to`` would cast it: same bits)
            for i, n in enumerate(names):
                new[starts[i] : starts[i + 1]].view(self.specs[n].shape).copy_(pushed[n])
        fresh = [n for n in names if n not in self._checksums]
        fresh_views = [new[starts[i] : starts[i + 1]] for i, n in enumerate(names) if n not in self._checksums]
        fresh_checks = checksum_tensors(fresh_views) if fresh_views else torch.empty(0, dtype=torch.int64, device=device)
        group = _Group(layout=layout, names=names, starts=starts, new=new, fresh=fresh, fresh_checks=fresh_checks)
        if len(fresh) == k:
            return group
        snapshot = self._snapshots[dtype]
        in_place = k == len(layout.offsets)  # every name pushed: ``new`` is laid out like the snapshot
        if in_place and not fresh:
            old = snapshot
        else:  # the snapshot of the pushed names; the new values where there is none (they compare equal)
            old = torch.cat([new[starts[i] : starts[i + 1]] if n not in self._checksums else
                             snapshot[layout.offsets[n] : layout.offsets[n] + sizes[i]] for i, n in enumerate(names)])
        int_dtype = SIGNED_VIEW[dtype.itemsize]
        changed = torch.ne(new.view(int_dtype), old.view(int_dtype)).nonzero().squeeze(1)  # [m], a host sync
        meta = upload(torch.tensor([*starts, *(layout.offsets[n] for n in names)], dtype=torch.int64), device)  # [2k + 1]
        bounds = meta[: k + 1]
        counts = torch.diff(torch.searchsorted(changed, bounds))  # [k] changed elements per name
        segment = segment_ids(counts, changed.numel())  # [m]
        local = changed - bounds[segment]  # [m] flat index within the parameter
        group.values = new.index_select(0, changed)  # [m]
        difference = bit_differences(old.index_select(0, changed), group.values)  # [m] int64
        group.deltas, group.escaped = delta_bytes(difference)
        group.gaps = stream_gaps(local, segment)
        rows = torch.cat([gaps_over_limits(group.gaps), group.escaped[None]]).to(torch.int64)  # [3, m]
        terms = difference.mul_(position_weights(local))[None]  # [1, m] checksum change per element
        group.sums = torch.cat([counts[:, None], segment_sums(torch.cat([rows, terms]), counts)], 1)  # [k, 5]
        group.positions = changed if in_place else local + meta[k + 1 :][segment]
        return group

    def _build(self, g: _Group, rows: list[list[int]] | None, fresh_checks: list[int],
               records: dict[str, tuple[Update, ParamStats]], checksums: dict[str, int]) -> _SnapshotWrite:
        """Pick each name's encoding from its host sums and build its record (views into the group's
        arrays, no host sync); fill ``records`` and ``checksums``; return what ``commit`` writes."""
        esize = g.layout.dtype.itemsize
        fresh = dict(zip(g.fresh, fresh_checks))
        kinds: list[str] = []  # per name: "fresh", "dense", "patch" or "delta"
        gap_dtypes: list[torch.dtype | None] = []
        for i, name in enumerate(g.names):
            kind, gap_dtype = "fresh" if name in fresh else "dense", None
            if kind == "dense":
                n, over8, over16, escapes, _ = rows[i]
                numel = self.specs[name].numel
                budget = numel * esize * self.config.max_patch_ratio  # bytes
                values_bytes = n * esize
                if numel < MAX_PATCH_NUMEL and values_bytes <= budget:
                    candidate = choose_gap_dtype(n, over8, over16)
                    index_bytes = packed_nbytes(n, candidate, {torch.uint8: over8, torch.uint16: over16}.get(candidate, 0))
                    if index_bytes + values_bytes <= budget:
                        gap_dtype = candidate
                        use_deltas = self.config.bit_deltas and esize > 1 and n + escapes * esize < values_bytes
                        kind = "delta" if use_deltas else "patch"
            kinds.append(kind)
            gap_dtypes.append(gap_dtype)
        ends = list(itertools.accumulate(r[0] for r in rows)) if rows is not None else []
        packed = encode_streams(g.gaps, [r[0] for r in rows], gap_dtypes, [(r[1], r[2]) for r in rows]) if rows is not None else []
        escape_ends: list[int] = []
        if "delta" in kinds:
            escape_ends = list(itertools.accumulate(r[3] for r in rows))
            where = torch.nonzero_static(g.escaped, size=escape_ends[-1]).squeeze(1)  # [escaped deltas of every name]
            escapes = g.values.index_select(0, where)
        for i, (name, kind) in enumerate(zip(g.names, kinds)):
            shape = self.specs[name].shape
            if kind == "fresh":
                checksums[name] = fresh[name]
                update: Update = Dense(name=name, tensor=g.new[g.starts[i] : g.starts[i + 1]].view(shape), checksum=fresh[name])
                records[name] = update, ParamStats(name=name, encoding="dense", numel=self.specs[name].numel, num_changed=-1, nbytes=update.nbytes)
                continue
            n = rows[i][0]
            checksums[name] = _wrap64(self._checksums[name] + rows[i][4])
            a, b = ends[i] - n, ends[i]
            if kind == "dense":
                update = Dense(name=name, tensor=g.new[g.starts[i] : g.starts[i + 1]].view(shape), checksum=checksums[name])
            elif kind == "patch":
                update = Patch(name=name, indices=packed[i], values=g.values[a:b], checksum=checksums[name])
            else:
                update = Patch(name=name, indices=packed[i], values=g.deltas[a:b], checksum=checksums[name],
                               escapes=escapes[escape_ends[i] - rows[i][3] : escape_ends[i]])
            records[name] = update, ParamStats(name=name, encoding="dense" if kind == "dense" else "patch",
                                               numel=self.specs[name].numel, num_changed=n, nbytes=update.nbytes)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return _SnapshotWrite(
            dtype=g.layout.dtype,
            positions=empty if g.positions is None else g.positions,
            values=empty.to(g.layout.dtype) if g.values is None else g.values,
            fresh=tuple((g.layout.offsets[n], g.new[g.starts[i] : g.starts[i + 1]]) for i, n in enumerate(g.names) if n in fresh),
        )

    def commit(self, push: PendingPush) -> None:
        """Record that the rollout side applied ``push``: the snapshot becomes its weights.

        Raises ValueError if the snapshot moved since ``push`` was encoded (a stale push).
        """
        if push.base_generation != self.generation:
            raise ValueError(f"stale push: encoded against generation {push.base_generation}, differ is at {self.generation}")
        for write in push.writes:
            snapshot = self._snapshots.get(write.dtype)
            if snapshot is None:
                snapshot = self._snapshots[write.dtype] = torch.empty(self._layouts[write.dtype].numel, dtype=write.dtype, device=self.device)
            if write.positions.numel():
                snapshot.index_put_((write.positions,), write.values)
            if write.fresh:
                torch._foreach_copy_([snapshot[o : o + t.numel()] for o, t in write.fresh], [t for _, t in write.fresh])
        self._checksums.update(push.checksums)
        self.generation += 1
