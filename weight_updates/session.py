"""Rollout side: versioned, validate-then-apply weight-update sessions.

::

    receiver = WeightReceiver(target, version=0)      # one per engine (rank); keeps checksums
    session = receiver.session()
    session.start(7, expected_names=[...])            # misuse (chunks before start, twice) raises
    session.add(chunk_of_updates)                      # cheap checks now; nothing written
    result = session.finish()                          # validate all -> write -> verify -> version 7

``finish`` runs in three phases and touches the weights only in the second. Ranks that must agree
(tensor parallelism, each rank with its own shard) run them one by one and vote in between::

    session.prepare()        # phase 1; then every rank learns whether every rank validated
    session.commit()         # phases 2 and 3; then every rank learns whether every rank verified
    session.publish()        # the version moves (or, where a peer failed, session.rollback())

1. validate: names, shapes, dtypes, index streams and bounds, every announced name present, and
   every checksum *predicted* before writing (dense: checksum of the incoming tensor; patch: the
   parameter's current checksum, cached by the receiver, plus the patch's linear change, see
   ``checksum``). Patches' old values at their indices are gathered here for rollback.
2. write through the target's ``write_dense`` / ``write_patch`` (the fused/sharded mapping is the
   target's; a target with ``write_dense_many`` gets all dense records in one call, and on CUDA a target
   with ``writable_views`` gets all patches of a dtype in one scatter); the dense parameters are first
   copied aside for rollback (one batched copy), unless the receiver was made with
   ``dense_rollback=False``.
3. verify by reading back through ``read_checkpoint_tensor``: dense parameters by a full checksum,
   patches by the exact bits at their indices (together with phase 1 that proves the post-update
   checksum). Any failure in 2 or 3 writes the old values back (dense ones only with the rollback copy),
   and so does ``rollback`` after a successful ``commit``.

A failed session raises ``WeightUpdateError`` naming the parameter and leaves weights and version as
they were. Without the dense rollback copy, a failure after writing (which phase 1 leaves only to a
faulty target) restores the patches but not the dense parameters; the error says so, and their cached
checksums are dropped, so a later patch of them is checked against the weights as they are.

Cost: nothing per parameter on the device. All patches of one dtype are validated as one group (index
streams decoded together, bounds clamped per element so the old values can be gathered before the checks
are read, bit deltas decoded, checksum changes summed per member) in a fixed number of kernels; dense
records are checksummed in one launch per element size on CUDA. Host syncs: one after phase 1 (every
check of the session at once), one for the write, one after phase 3. Host metadata travels to the device
in one pinned copy per session and one per group. The cached checksums live in one device table.
This module does not move bytes between processes (see ``transports``) and does not decide encodings
(see ``differ``).
"""

import contextlib
import dataclasses
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.common import SIGNED_VIEW, device_index, upload
from weight_updates.checksum import checksum_tensors, concat_to, delta_terms
from weight_updates.encoding import (GAP_DTYPES, Dense, Patch, Update, apply_bit_deltas, check_stream_dtypes, decode_streams,
                                     SegmentBounds, segment_sums)
from weight_updates.errors import WeightUpdateError
from weight_updates.target import ParamSpec, WeightTarget

if TYPE_CHECKING:
    from kernels.scatter import TensorTable


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateResult:
    version: int  # the version now held
    num_dense: int
    num_patch: int
    nbytes: int  # payload bytes received
    validate_s: float  # phase 1, including checksum prediction
    apply_s: float  # phase 2
    verify_s: float  # phase 3

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(kw_only=True, slots=True)
class _DenseRecord:
    """One dense record, moved to the target device."""

    update: Dense
    row: int  # position among the session's records
    payload: torch.Tensor  # checkpoint shape, engine dtype, on the target device
    old: torch.Tensor | None = None  # the same shape: values before the write (rollback copy)


# Rows of _PatchGroup.meta, one column per member.
_SIZES, _OVERFLOW, _NUMEL, _ESCAPES, _ROWS = range(5)


@dataclass(kw_only=True, slots=True)
class _PatchGroup:
    """The session's patches of one engine dtype, validated, read and written together: a fixed number of
    kernels whatever the number of members. Gather / scatter is one launch (`kernels/scatter.py`, through a
    pointer table built once per session) on CUDA when the target lends its live tensors, else one
    indexing op per member."""

    members: list[Patch]  # bit-delta patches first, then by gap dtype: few runs of equal dtypes to concatenate
    sizes: list[int]  # [k] changed elements per member
    meta: torch.Tensor  # [5, k] int64 on the device: sizes, overflow counts, numels, escape counts, record rows
    indices: torch.Tensor  # [n] int64: the members' flat indices, concatenated (clamped into bounds)
    segment: torch.Tensor  # [n] int64: which member each element belongs to
    table: "TensorTable | None"  # the members' live contiguous tensors (kernels.scatter), or None
    checks: torch.Tensor | None = None  # [k, 4] int64: malformed, negative gap, last index, escape mismatch
    predicted: torch.Tensor | None = None  # [k] int64 checksums after the patch, predicted before writing
    old: torch.Tensor | None = None  # [n] values before the write
    new: torch.Tensor | None = None  # [n] values to write

    def gather(self, target: WeightTarget) -> torch.Tensor:
        if self.table is not None:
            from kernels.scatter import gather_many

            return gather_many(self.table, self.indices, self.segment)
        return torch.cat([target.read_checkpoint_tensor(p.name).reshape(-1).index_select(0, idx)
                          for p, idx in zip(self.members, self.indices.split(self.sizes))])

    def scatter(self, target: WeightTarget, values: torch.Tensor) -> None:
        if self.table is not None:
            from kernels.scatter import scatter_many

            scatter_many(self.table, self.indices, self.segment, values)
            return
        for p, idx, v in zip(self.members, self.indices.split(self.sizes), values.split(self.sizes)):
            target.write_patch(p.name, idx, v)

    def member_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-member sums of ``values``: [n] -> [k], or [c, n] -> [k, c] (int64)."""
        return segment_sums(values, self.meta[_SIZES])


@dataclass(kw_only=True, slots=True)
class _Prepared:
    """What phase 1 leaves for writing, verifying, publishing or rolling back."""

    records: list[Update]  # in the order received
    dense: list[_DenseRecord]
    groups: list[_PatchGroup]
    expected: torch.Tensor  # [R] int64 on the device: the sender's checksums
    table_rows: torch.Tensor  # [R] int64: the records' rows of the receiver's checksum table
    dense_rows: torch.Tensor  # [num dense] int64: the dense records' positions among the records
    times: list[float]  # perf_counter at the start and end of phase 1, then after phases 2 and 3


class WeightReceiver:
    """Holds the policy version of one target and the checksums of its parameters.

    With ``trust_cached_checksums`` (the default) a parameter's checksum is computed once and then
    carried forward by each verified session, so a patch is checked in O(changed) work. That is
    exact as long as every write goes through a session: call ``invalidate_checksums`` after
    writing weights any other way (a stale cache could hide a base mismatch). With it off, every
    patched parameter is checksummed in full before the patch (O(numel), on the target's device).

    ``dense_rollback`` (default True) copies every densely updated parameter aside before writing, so
    that a failed read-back can restore it; False saves that copy's time and memory (the size of the
    dense update) at the cost described in the module docstring.

    ``batched_scatter`` (default: on CUDA) reads and writes all patches of a dtype in one Triton launch
    each (`kernels/scatter.py`) when the target lends its live tensors (``writable_views``); off, or for a
    target that does not lend them, each patch goes through ``read_checkpoint_tensor`` / ``write_patch``.
    """

    def __init__(self, target: WeightTarget, *, version: int = 0, trust_cached_checksums: bool = True,
                 dense_rollback: bool = True, batched_scatter: bool | None = None) -> None:
        self.target = target
        self.trust_cached_checksums = trust_cached_checksums
        self.dense_rollback = dense_rollback
        self.batched_scatter = target.device.type == "cuda" if batched_scatter is None else batched_scatter
        self.specs: dict[str, ParamSpec] = dict(target.checkpoint_specs())
        self.version = version
        self._row = {name: i for i, name in enumerate(self.specs)}  # checkpoint name -> row of the table
        self._table = torch.zeros(len(self.specs), dtype=torch.int64, device=target.device)  # [num params] checksums
        self._known: set[str] = set()  # names whose table row holds their current checksum
        self._active: UpdateSession | None = None

    def session(self) -> "UpdateSession":
        return UpdateSession(self)

    def apply(self, version: int, updates: Iterable[Update], *, expected_names: Collection[str] | None = None) -> UpdateResult:
        """start -> one chunk -> finish."""
        session = self.session()
        session.start(version, expected_names=expected_names)
        session.add(updates)
        return session.finish()

    def invalidate_checksums(self, names: Iterable[str] | None = None) -> None:
        self._known.difference_update(list(self._known) if names is None else names)

    def has_checksum(self, name: str) -> bool:
        """Whether the checksum of ``name`` is cached (carried forward by sessions)."""
        return name in self._known

    def current_checksum(self, name: str, *, refresh: bool = False) -> torch.Tensor:
        """0-dim int64 checksum of the parameter as the target holds it now."""
        self._ensure_checksums([name], refresh=refresh)
        return self._table[self._row[name]].clone()

    def _ensure_checksums(self, names: list[str], *, refresh: bool) -> None:
        """Fill the table rows of ``names`` that are not known (all of them with ``refresh``): on CUDA one
        checksum launch per element size for all of them."""
        missing = [n for n in names if refresh or n not in self._known]
        if missing:
            rows = upload(torch.tensor([self._row[n] for n in missing], dtype=torch.int64), self._table.device)
            self._table[rows] = checksum_tensors([self.target.read_checkpoint_tensor(n) for n in missing])
            self._known.update(missing)


class UpdateSession:
    """One update: ``start(version)`` -> ``add(chunk)``* -> ``finish()``. Single use.

    ``finish`` is ``prepare`` -> ``commit`` -> ``publish``. Ranks that must agree (tensor parallelism)
    call the three themselves and vote between them: ``prepare`` validates and writes nothing, ``commit``
    writes and verifies but keeps the receiver's version, and a rank whose peer failed calls ``rollback``
    instead of ``publish``.
    """

    def __init__(self, receiver: WeightReceiver) -> None:
        self._receiver = receiver
        self._state = "new"  # new -> started -> prepared -> committed -> finished; any -> failed
        self._version = -1
        self._expected: frozenset[str] | None = None
        self._updates: dict[str, Update] = {}
        self._prepared: _Prepared | None = None  # set by prepare, dropped when the session ends

    @property
    def state(self) -> str:
        return self._state

    def start(self, version: int, *, expected_names: Collection[str] | None = None) -> None:
        """Open the session for ``version`` (> the receiver's). ``expected_names``: the parameters
        the sender announced; ``prepare`` fails if any did not arrive."""
        self._expect("start", "new")
        receiver = self._receiver
        if receiver._active is not None:
            raise WeightUpdateError("another session is open on this receiver")
        if not isinstance(version, int) or isinstance(version, bool) or version <= receiver.version:
            raise WeightUpdateError(f"version must be an int > the current version {receiver.version}, got {version!r}")
        if expected_names is not None:
            unknown = sorted(set(expected_names) - receiver.specs.keys())
            if unknown:
                raise WeightUpdateError(f"announced unknown parameters {unknown[:5]}")
            self._expected = frozenset(expected_names)
        self._version = version
        self._state = "started"
        receiver._active = self

    def add(self, updates: Iterable[Update]) -> None:
        """Receive a chunk. Checks names, shapes and dtypes now; writes nothing."""
        self._expect("add", "started")
        try:
            for update in updates:
                self._check_record(update)
                self._updates[update.name] = update
        except WeightUpdateError:
            self.abort()
            raise

    def abort(self) -> None:
        """End the session without touching the weights (a transport gave up, or a peer rejected it
        before anything was written). After ``commit`` use ``rollback``."""
        assert self._state != "committed", "abort() after commit(): rollback() writes the old values back"
        self._end()

    def finish(self) -> UpdateResult:
        """Validate everything, write, verify; on success the receiver holds the new version."""
        self._expect("finish", "started")
        self.prepare()
        self.commit()
        return self.publish()

    def prepare(self) -> None:
        """Phase 1: validate every record and predict every checksum; writes nothing. Raises
        WeightUpdateError, and the session is over; on success ``commit`` or ``abort`` follows."""
        self._expect("prepare", "started")
        with self._ending_on_error():
            self._prepared = self._validate()
        self._state = "prepared"

    def commit(self) -> None:
        """Phases 2 and 3: write, read back and verify. A failure writes the old values back (dense ones
        only with the rollback copy) and raises WeightUpdateError. The version changes at ``publish``."""
        self._expect("commit", "prepared")
        with self._ending_on_error():
            self._write()
            self._verify()
        self._state = "committed"

    def publish(self) -> UpdateResult:
        """The receiver takes the new version and the verified checksums; the session is finished."""
        self._expect("publish", "committed")
        receiver, p = self._receiver, self._prepared
        receiver._table[p.table_rows] = p.expected
        receiver._known.update(u.name for u in p.records)
        receiver.version = self._version
        num_dense = len(p.dense)
        result = UpdateResult(
            version=self._version,
            num_dense=num_dense,
            num_patch=len(p.records) - num_dense,
            nbytes=sum(u.nbytes for u in p.records),
            validate_s=p.times[1] - p.times[0],
            apply_s=p.times[2] - p.times[1],
            verify_s=p.times[3] - p.times[2],
        )
        self._end("finished")
        return result

    def rollback(self) -> str:
        """End the session with the weights as they were before it (a peer failed): after ``commit``
        the old values are written back, before it nothing was written. Returns what was restored, in
        words for an error message."""
        assert self._state != "finished", "rollback() after publish()"
        what = "nothing written"
        if self._state == "committed":
            p = self._prepared
            self._rollback(p.dense, p.groups)
            what = self._restored_what(p.dense)
        self._end()
        return what

    # ---------------------------------------------------------------------------------------------

    def _expect(self, call: str, state: str) -> None:
        if self._state != state:
            raise WeightUpdateError(f"{call}() on a session that is {self._state}")

    def _end(self, state: str = "failed") -> None:
        if self._state in ("started", "prepared", "committed"):
            self._receiver._active = None
        if self._state != "finished":
            self._state = state
        self._prepared = None  # drops the staged payloads and the rollback copies

    @contextlib.contextmanager
    def _ending_on_error(self):
        try:
            yield
        except BaseException:
            self._end()
            raise

    def _check_record(self, update: Update) -> None:
        specs = self._receiver.specs
        if not isinstance(update, (Dense, Patch)):
            raise WeightUpdateError(f"not an update record: {type(update).__name__}")
        spec = specs.get(update.name)
        if spec is None:
            raise WeightUpdateError(f"unknown parameter {update.name!r}")
        if self._expected is not None and update.name not in self._expected:
            raise WeightUpdateError(f"{update.name}: not among the parameters announced at start")
        if update.name in self._updates:
            raise WeightUpdateError(f"{update.name}: sent twice in one session")
        payload = update.tensor if isinstance(update, Dense) else update.values
        if payload.dtype != spec.dtype and not (isinstance(update, Patch) and update.is_delta):
            raise WeightUpdateError(f"{update.name}: dtype {payload.dtype} != engine dtype {spec.dtype}")
        if isinstance(update, Dense):
            if tuple(payload.shape) != spec.shape:
                raise WeightUpdateError(f"{update.name}: shape {tuple(payload.shape)} != checkpoint shape {spec.shape}")
        elif payload.dim() != 1 or payload.numel() != update.indices.num_indices:
            raise WeightUpdateError(f"{update.name}: {update.indices.num_indices} indices but values of shape {tuple(payload.shape)}")
        elif update.indices.num_indices > spec.numel:
            raise WeightUpdateError(f"{update.name}: {update.indices.num_indices} indices for {spec.numel} elements")
        elif update.is_delta and (update.escapes is None or update.escapes.dtype != spec.dtype or update.escapes.dim() != 1):
            raise WeightUpdateError(f"{update.name}: a bit-delta patch needs 1-D escape values of dtype {spec.dtype}")

    def _validate(self) -> "_Prepared":
        """Phase 1: stage on device, decode and check index streams, predict checksums; one host sync."""
        receiver, target = self._receiver, self._receiver.target
        device = target.device
        missing = sorted((self._expected or frozenset()) - self._updates.keys())
        if missing:
            raise WeightUpdateError(f"stream cut short: {len(missing)} announced parameters never arrived, e.g. {missing[:5]}")
        t0 = time.perf_counter()
        records = list(self._updates.values())
        here = device_index(device)
        dense = [_DenseRecord(update=u, row=i, payload=u.tensor if u.tensor.get_device() == here else u.tensor.to(device, non_blocking=True))
                 for i, u in enumerate(records) if isinstance(u, Dense)]
        table_rows = [receiver._row[u.name] for u in records]
        meta = upload(torch.tensor([*(u.checksum for u in records), *table_rows, *(d.row for d in dense)], dtype=torch.int64), device)
        num = len(records)
        expected, table_rows_d, dense_rows = meta[:num], meta[num : 2 * num], meta[2 * num :]  # [R], [R], [num dense]
        groups = self._patch_groups([(i, u) for i, u in enumerate(records) if isinstance(u, Patch)], table_rows_d, device)
        predicted = torch.zeros(num, dtype=torch.int64, device=device)  # [R]
        if dense:
            predicted[dense_rows] = checksum_tensors([d.payload for d in dense])
        for g in groups:
            predicted[g.meta[_ROWS]] = g.predicted
        self._check_all(records, groups, predicted, expected)
        return _Prepared(records=records, dense=dense, groups=groups, expected=expected, table_rows=table_rows_d,
                         dense_rows=dense_rows, times=[t0, time.perf_counter()])

    def _write(self) -> None:
        """Phase 2: write, keeping old values for rollback; on failure restore and raise."""
        receiver, target, p = self._receiver, self._receiver.target, self._prepared
        dense = p.dense
        written: list[_DenseRecord] = []
        written_groups: list[_PatchGroup] = []
        try:
            if dense and receiver.dense_rollback:
                current = [target.read_checkpoint_tensor(d.update.name) for d in dense]
                olds = [torch.empty_like(t) for t in current]
                torch._foreach_copy_(olds, current)
                for d, old in zip(dense, olds):
                    d.old = old
            write_many = getattr(target, "write_dense_many", None)
            if dense and write_many is not None:
                written += dense  # a failed batched write may have written any of them
                write_many([(d.update.name, d.payload) for d in dense])
            else:
                for d in dense:
                    written.append(d)
                    target.write_dense(d.update.name, d.payload)
            for g in p.groups:
                written_groups.append(g)
                g.scatter(target, g.new)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
        except Exception as e:
            self._rollback(written, written_groups)
            raise WeightUpdateError(f"target write failed, {self._restored_what(dense)}: {e}") from e
        p.times.append(time.perf_counter())

    def _verify(self) -> None:
        """Phase 3: read back and verify; one host sync (a second one only to name what failed). On failure
        restore and raise."""
        target, p = self._receiver.target, self._prepared
        try:
            failed = torch.zeros(len(p.records), dtype=torch.bool, device=target.device)  # [R]
            if p.dense:
                got = checksum_tensors([target.read_checkpoint_tensor(d.update.name) for d in p.dense])
                failed[p.dense_rows] = got != p.expected[p.dense_rows]
            mismatches = []  # per group: [n] bool, read-back bits != sent bits
            for g in p.groups:
                int_dtype = SIGNED_VIEW[g.new.element_size()]
                mismatches.append(torch.ne(g.gather(target).view(int_dtype), g.new.view(int_dtype)))
            flags = torch.cat([failed, *(m.any()[None] for m in mismatches)]).tolist()  # [R + groups]
            for g, m, bad_group in zip(p.groups, mismatches, flags[len(p.records):]):
                if bad_group:  # which members: per-member sums, only when some bit did not hold
                    failed[g.meta[_ROWS]] = g.member_sums(m.to(torch.int64)) > 0
            flags = failed.tolist() if any(flags[len(p.records):]) else flags
            bad = [u.name for u, f in zip(p.records, flags) if f]
        except Exception as e:
            self._rollback(p.dense, p.groups)
            raise WeightUpdateError(f"read-back failed, {self._restored_what(p.dense)}: {e}") from e
        if bad:
            self._rollback(p.dense, p.groups)
            raise WeightUpdateError(f"verification after write failed for {bad[:5]}: the target did not hold the sent bits; "
                                    f"{self._restored_what(p.dense)}")
        p.times.append(time.perf_counter())

    def _patch_groups(self, patches: list[tuple[int, Patch]], table_rows: torch.Tensor, device: torch.device) -> list[_PatchGroup]:
        """One group per engine dtype, each decoded, gathered and checked in a fixed number of kernels.
        Nothing is synchronised or written: every check lands in ``_PatchGroup.checks``."""
        receiver = self._receiver
        check_stream_dtypes([p.indices for _, p in patches])
        by_dtype: dict[torch.dtype, list[tuple[int, Patch]]] = {}
        for row, p in patches:
            by_dtype.setdefault(receiver.specs[p.name].dtype, []).append((row, p))
        receiver._ensure_checksums([p.name for _, p in patches], refresh=not receiver.trust_cached_checksums)
        lend = getattr(receiver.target, "writable_views", None) if receiver.batched_scatter else None
        return [self._patch_group(sorted(members, key=_patch_order), dtype, table_rows, device, lend) for dtype, members in by_dtype.items()]

    def _patch_group(self, members: list[tuple[int, Patch]], dtype: torch.dtype, table_rows: torch.Tensor, device: torch.device,
                     lend) -> _PatchGroup:
        """``members``: (record row, patch) in ``_patch_order``; ``table_rows``: [R] the records' rows of the
        receiver's checksum table; ``lend``: the target's ``writable_views`` or None."""
        receiver = self._receiver
        patches, streams, sizes, columns = [], [], [], []  # columns: the rows of ``meta``, one member at a time
        delta_values, plain_values, escape_values = [], [], []
        for row, p in members:  # one pass over the members
            indices, is_delta = p.indices, p.is_delta
            num = indices.num_indices
            patches.append(p)
            streams.append(indices)
            sizes.append(num)
            columns.append((num, indices.overflow.numel(), receiver.specs[p.name].numel,
                            p.escapes.numel() if is_delta else 0, row))
            if is_delta:
                delta_values.append(p.values)
                escape_values.append(p.escapes)
            else:
                plain_values.append(p.values)
        total = sum(sizes)
        meta = upload(torch.tensor(columns, dtype=torch.int64).t().contiguous(), device)  # [5, k]
        decoded = decode_streams(streams, meta[_SIZES], device)
        sums = decoded.sums  # [k, 4]
        # Clamped into each member's bounds, the indices are safe to read through even before the checks
        # are known; where the checks pass, clamping changed nothing.
        limit = (meta[_NUMEL] - 1)[decoded.segment]  # [n]
        indices = torch.minimum(decoded.indices.clamp_(min=0), limit)
        views = None if lend is None else lend([p.name for p in patches])
        table = None
        if views is not None:
            from kernels.scatter import TensorTable

            table = TensorTable.of(views)
        group = _PatchGroup(members=patches, sizes=sizes, meta=meta, indices=indices, segment=decoded.segment, table=table)
        group.old = group.gather(receiver.target)  # [n]
        delta_members = len(delta_values)  # they come first
        num_delta = sum(sizes[:delta_members])
        deltas = concat_to(delta_values, torch.int8, device)  # [num delta]
        plain = concat_to(plain_values, dtype, device)  # [n - num delta]
        escape_counts = torch.zeros(len(patches), dtype=torch.int64, device=device)  # [k] escaped delta bytes
        if num_delta:
            escapes = concat_to(escape_values, dtype, device)  # [num escapes]
            escape_scan = torch.cumsum(deltas == 0, 0)  # [num delta]
            decoded_deltas = apply_bit_deltas(group.old[:num_delta], deltas, escapes, escape_scan)
            group.new = decoded_deltas if num_delta == total else torch.cat([decoded_deltas, plain])
            escape_counts[:delta_members] = SegmentBounds(meta[_SIZES][:delta_members]).totals(escape_scan)
        else:
            group.new = plain
        base = receiver._table[table_rows[meta[_ROWS]]]  # [k] checksums before the patch
        group.predicted = base + group.member_sums(delta_terms(group.old, group.new, indices))
        malformed = (sums[:, 1] != meta[_OVERFLOW]) | (sums[:, 2] > 0)
        group.checks = torch.stack([malformed.to(torch.int64), (sums[:, 3] > 0).to(torch.int64), sums[:, 0] - 1,
                                    (escape_counts != meta[_ESCAPES]).to(torch.int64)], 1)
        return group

    def _check_all(self, records: list[Update], groups: list[_PatchGroup], predicted: torch.Tensor, expected: torch.Tensor) -> None:
        """Raise for the first bad index stream (in the order sent), else for checksums that do not match
        their prediction. One host sync reads one flag for every check of the session; only when it is set
        are the per-record values read to name what failed."""
        flags = [(g.checks[:, [0, 1, 3]] != 0).any(1) | (g.checks[:, 2] >= g.meta[_NUMEL]) for g in groups]  # [k] each
        if not torch.cat([*flags, predicted != expected]).any().item():
            return
        values = torch.cat([*(g.checks.reshape(-1) for g in groups), predicted]).tolist()
        streams, at = {}, 0
        for g in groups:
            for p in g.members:
                streams[p.name] = values[at : at + 4]
                at += 4
        for u in records:
            if not isinstance(u, Patch):
                continue
            malformed, negative, last, escapes = streams[u.name]
            if malformed:
                raise WeightUpdateError(f"{u.name}: malformed index stream (escape count != overflow count, or an overflow gap < 1)")
            if negative:
                raise WeightUpdateError(f"{u.name}: malformed index stream (a gap < 1: indices must be strictly increasing)")
            numel = self._receiver.specs[u.name].numel
            if last >= numel:
                raise WeightUpdateError(f"{u.name}: flat index {last} out of bounds for {numel} elements")
            if escapes:
                raise WeightUpdateError(f"{u.name}: the escaped deltas do not match its {u.escapes.numel()} escape values")
        bad = [(u, got) for u, got in zip(records, values[at:]) if got != u.checksum]
        if bad:
            u, got = bad[0]
            kind = "the incoming tensor" if isinstance(u, Dense) else "the current weights with the patch applied"
            raise WeightUpdateError(
                f"checksum mismatch for {len(bad)} parameters, first {u.name}: sender says {u.checksum}, "
                f"{kind} give {got} (corrupt data, or a patch against a different base version)"
            )

    def _restored_what(self, dense: list[_DenseRecord]) -> str:
        if not dense or self._receiver.dense_rollback:
            return "weights restored"
        self._receiver.invalidate_checksums([d.update.name for d in dense])
        return (f"patches undone, but the {len(dense)} dense parameters were written without a rollback copy "
                "(dense_rollback=False) and may hold new values: push them densely again")

    def _rollback(self, dense: list[_DenseRecord], groups: list[_PatchGroup]) -> None:
        target = self._receiver.target
        for g in groups:
            g.scatter(target, g.old)  # members not yet written get their current values back: a no-op
        for d in reversed(dense):
            if d.old is not None:  # None: dense_rollback=False
                target.write_dense(d.update.name, d.old)


def _patch_order(member: tuple[int, Patch]) -> tuple[bool, int]:
    """Bit-delta patches first, then by gap dtype: the group's payloads and gap streams concatenate in a
    few runs of one dtype each."""
    p = member[1]
    return not p.is_delta, GAP_DTYPES.index(p.indices.gaps.dtype)


def apply_update(target: WeightTarget, version: int, updates: Iterable[Update], *, current_version: int = 0) -> UpdateResult:
    """One-shot session on a target without a long-lived receiver (no checksum cache)."""
    return WeightReceiver(target, version=current_version).apply(version, updates)
