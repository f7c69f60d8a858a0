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
   with ``writable_views`` gets all patches of a dtype in one launch); the dense parameters are first
   copied aside for rollback (one batched copy), unless the receiver was made with
   ``dense_rollback=False`` (or the session, ``receiver.session(dense_rollback=False)``).
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
records are checksummed in one launch per element size on CUDA. Where the target lends its live tensors
(``writable_addresses``, their data pointers without a view per name, or ``writable_views``; on CUDA by
default: ``batched_scatter``) a group goes block by block
(`kernels/patch.py`): two launches per run of one gap dtype and one kind of values decode and read
everything, reading each element's gap and value once and writing its int32 index, old and new value;
the checks and checksum changes are sums over the blocks; writing, rollback and read-back are one launch
each. Elsewhere (the CPU, ``batched_scatter=False``, a target without ``writable_views``) torch ops decode
the group in int64 arrays and old values are gathered and written by one indexing op per patch. On the
host, ``add`` checks each record once and notes what phase 1 needs of it (its parameter's row, its
counts, its place in its group); phase 1 builds every group's metadata from those notes with numpy (a block
group's block table then on the device, from the uploaded counts), against per-parameter arrays that the
receiver builds once, and touches a record only to hand its tensors to the group's concatenations (one cat
per run of one dtype, or one view where the parts lie end to end; parts without data are left out). Host syncs: one after phase 1 (every check of the session
at once), one for the write, one after phase 3. Host metadata travels to the device in one pinned copy
per session.

Device memory a session holds until it ends: the dense payloads (where the transport landed them) and,
with ``dense_rollback``, a copy of every densely updated parameter as it was (its size in bytes); per
patched element its old and new value and, on the block path, a 4-byte index (an 8-byte one, and int64
scratch, on the torch path). The cached checksums live in one device table.
``StagingReceiver`` offers the same sessions for weights it cannot reach (a tensor-parallel engine's, on
several ranks): it checks names, shapes and dtypes, holds the records, and drives the same steps on
``RemoteSessions`` where the weights are (prepare with the records, commit, publish, or rollback).

This module does not move bytes between processes (see ``transports``) and does not decide encodings
(see ``differ``).
"""

import contextlib
import dataclasses
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kernels.common import SIGNED_VIEW, device_index, upload
from weight_updates.checksum import checksum_tensors, concat_to, delta_terms
from weight_updates.encoding import (GAP_DTYPES, DecodedStreams, Dense, Patch, Update, apply_bit_deltas, check_stream_dtypes,
                                     decode_streams, segment_sums)
from weight_updates.errors import WeightUpdateError
from weight_updates.target import ParamSpec, WeightTarget


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

    @classmethod
    def from_json(cls, data: dict) -> "UpdateResult":
        """The inverse of ``to_json`` (a peer's answer); WeightUpdateError for a malformed one."""
        try:
            return cls(**data)
        except TypeError as e:
            raise WeightUpdateError(f"malformed update result {data!r}: {e}") from None


@dataclass(kw_only=True, slots=True)
class _DenseRecord:
    """One dense record, moved to the target device."""

    update: Dense
    row: int  # position among the session's records
    payload: torch.Tensor  # checkpoint shape, engine dtype, on the target device
    old: torch.Tensor | None = None  # the same shape: values before the write (rollback copy)


# Rows of _PatchGroup.meta, one column per member.
_META_ROWS = 6
_SIZES, _OVERFLOW, _NUMEL, _ESCAPES, _ROWS, _TABLE = range(_META_ROWS)
_GAP_RANK = {dtype: i for i, dtype in enumerate(GAP_DTYPES)}  # gap dtype -> its place in the members' order


@dataclass(frozen=True, kw_only=True, slots=True)
class _GroupPlan:
    """A _PatchGroup's host side: its members in order and their metadata, before anything is on the device."""

    dtype: torch.dtype  # the members' engine dtype
    members: list[Patch]  # bit-delta patches first, then by gap dtype: few runs of equal dtypes to concatenate
    num_delta: int  # how many members are bit-delta patches
    runs: list[tuple[int, int]]  # [start, stop) of each run of members with one gap dtype and one kind of values
    columns: np.ndarray  # [_META_ROWS, k] int64: the rows of the group's meta
    held: list[torch.Tensor] | None = None  # tensors holding the members' live storage where the target lends it (block path)
    blocks: tuple[np.ndarray, np.ndarray] | None = None  # with held: ([k] blocks per member, [k] live data pointers)


def _fault_flag(faults: torch.Tensor, numels: torch.Tensor) -> torch.Tensor:
    """[k] bool from ``faults`` [k, 5] (last index, then four counts that must be 0) and ``numels`` [k]."""
    return (faults[:, 1:] != 0).any(1) | (faults[:, 0] >= numels)


@dataclass(kw_only=True, slots=True)
class _PatchGroup:
    """The session's patches of one engine dtype, validated, read and written together with torch ops: a fixed
    number of kernels whatever the number of members for the checks, one indexing op per member to read or
    write (the path for targets that do not lend their live tensors, and for the CPU)."""

    members: list[Patch]  # bit-delta patches first, then by gap dtype: few runs of equal dtypes to concatenate
    sizes: list[int]  # [k] changed elements per member
    meta: torch.Tensor  # [6, k] int64 on the device: sizes, overflow counts, numels, escape counts, record rows, table rows
    streams: DecodedStreams  # the members' index streams, decoded; ``streams.indices`` clamped into bounds
    checks: torch.Tensor | None = None  # [k, 3] int64: last index, escape count != overflow count, escape mismatch
    predicted: torch.Tensor | None = None  # [k] int64 checksums after the patch, predicted before writing
    old: torch.Tensor | None = None  # [n] values before the write
    new: torch.Tensor | None = None  # [n] values to write

    def gather(self, target: WeightTarget) -> torch.Tensor:
        return torch.cat([torch.take(target.read_checkpoint_tensor(p.name), idx)
                          for p, idx in zip(self.members, self.streams.indices.split(self.sizes))])

    def scatter(self, target: WeightTarget, values: torch.Tensor) -> None:
        for p, idx, v in zip(self.members, self.streams.indices.split(self.sizes), values.split(self.sizes)):
            target.write_patch(p.name, idx, v)

    def member_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-member sums [k] of ``values`` [n] (int64)."""
        return self.streams.bounds.totals(torch.cumsum(values, 0))

    def fault_flag(self) -> torch.Tensor:
        """[1] bool: whether any member's stream or bounds check failed."""
        return (_fault_flag(self.checks, self.meta[_NUMEL]).any() | self.streams.bad.any())[None]

    def faults(self) -> torch.Tensor:
        """[k, 5] int64 per member: last index, escape count != overflow count, escape mismatch, escaped gaps < 1,
        other gaps < 1."""
        return torch.cat([self.checks, self.streams.faults()], 1)

    def read_back(self, target: WeightTarget) -> torch.Tensor:
        """[n] bool: where the target's bits differ from ``new``."""
        int_dtype = SIGNED_VIEW[self.new.element_size()]
        return torch.ne(self.gather(target).view(int_dtype), self.new.view(int_dtype))

    def mismatched(self, read: torch.Tensor) -> torch.Tensor:
        """[k] bool from ``read_back``'s result: the members with a differing element."""
        return self.member_sums(read.to(torch.int64)) > 0


@dataclass(kw_only=True, slots=True)
class _BlockPatchGroup:
    """The session's patches of one engine dtype where the target lends its live tensors: decoded, checked,
    read and written block by block (`kernels/patch.py`; on CUDA, or on the CPU under the Triton interpreter).
    Per run of members with one gap dtype and one kind of values, two launches decode everything; per group
    about twenty small ops over the blocks (not the elements) turn the blocks' sums into per-member checks
    and checksum changes; reading, writing and comparing are one launch each."""

    members: list[Patch]  # as in _PatchGroup
    meta: torch.Tensor  # [6, k] int64 on the device, as in _PatchGroup
    table: torch.Tensor  # [B, kernels.patch.NCOL] int64 on the device: the blocks
    blocks: torch.Tensor  # [k] int64 on the device: blocks per member
    held: list[torch.Tensor]  # tensors holding the members' live storage, whose addresses ``table`` holds (kept alive here)
    indices: torch.Tensor  # [n] int32 flat indices, clamped into each member's bounds
    faults_: torch.Tensor  # [k, 5] int64, as _PatchGroup.faults
    predicted: torch.Tensor  # [k] int64 checksums after the patch, predicted before writing
    old: torch.Tensor  # [n] values before the write
    new: torch.Tensor  # [n] values to write

    def scatter(self, target: WeightTarget, values: torch.Tensor) -> None:
        from kernels.patch import SCATTER, block_access

        block_access(self.table, SCATTER, self.indices, values)

    def fault_flag(self) -> torch.Tensor:
        return _fault_flag(self.faults_, self.meta[_NUMEL]).any()[None]

    def faults(self) -> torch.Tensor:
        return self.faults_

    def read_back(self, target: WeightTarget) -> torch.Tensor:
        """[B] int32: per block, the elements where the target's bits differ from ``new``."""
        from kernels.patch import COMPARE, block_access

        return block_access(self.table, COMPARE, self.indices, self.new)

    def mismatched(self, read: torch.Tensor) -> torch.Tensor:
        return segment_sums(read.to(torch.int64), self.blocks) > 0


@dataclass(kw_only=True, slots=True)
class _Prepared:
    """What phase 1 leaves for writing, verifying, publishing or rolling back."""

    records: list[Update]  # in the order received
    rows: np.ndarray  # [R] int64 on the host: the records' rows of the receiver's arrays
    dense: list[_DenseRecord]
    groups: list["_PatchGroup | _BlockPatchGroup"]
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
    dense update) at the cost described in the module docstring. A session may override it
    (``session(dense_rollback=...)``): an engine that applies updates on its own skips the copy, and the
    same engine keeps it when it stages an update that a peer's failure may make it undo.

    ``batched_scatter`` (default: on CUDA) decodes, reads and writes all patches of a dtype block by block in
    a few Triton launches (`kernels/patch.py`) when the target lends its live tensors (``writable_views``);
    off, or for a target that does not lend them, torch ops decode them and each patch goes through
    ``read_checkpoint_tensor`` / ``write_patch``.
    """

    def __init__(self, target: WeightTarget, *, version: int = 0, trust_cached_checksums: bool = True,
                 dense_rollback: bool = True, batched_scatter: bool | None = None) -> None:
        self.target = target
        self.trust_cached_checksums = trust_cached_checksums
        self.dense_rollback = dense_rollback
        self.batched_scatter = target.device.type == "cuda" if batched_scatter is None else batched_scatter
        self.specs: dict[str, ParamSpec] = dict(target.checkpoint_specs())
        self.version = version
        # What sessions look up per record, built once: a parameter's row indexes the arrays below.
        self._names = list(self.specs)  # row -> checkpoint name
        self._row = {name: i for i, name in enumerate(self._names)}  # checkpoint name -> row
        self._dtypes = [spec.dtype for spec in self.specs.values()]  # row -> engine dtype
        self._numels = np.array([spec.numel for spec in self.specs.values()], dtype=np.int64)  # [num params]
        self._table = torch.zeros(len(self.specs), dtype=torch.int64, device=target.device)  # [num params] checksums
        self._known = np.zeros(len(self.specs), dtype=bool)  # [num params] whether the table row is current
        self._active: UpdateSession | None = None

    @property
    def device(self) -> torch.device:
        """Where the target's weights live (where a transport should land what it receives)."""
        return self.target.device

    def session(self, *, dense_rollback: bool | None = None) -> "UpdateSession":
        """A new session; ``dense_rollback`` overrides the receiver's for this session (None: the receiver's)."""
        return UpdateSession(self, dense_rollback=self.dense_rollback if dense_rollback is None else dense_rollback)

    def apply(self, version: int, updates: Iterable[Update], *, expected_names: Collection[str] | None = None) -> UpdateResult:
        """start -> one chunk -> finish."""
        session = self.session()
        session.start(version, expected_names=expected_names)
        session.add(updates)
        return session.finish()

    def invalidate_checksums(self, names: Iterable[str] | None = None) -> None:
        if names is None:
            self._known[:] = False
        else:
            self._known[[self._row[n] for n in names if n in self._row]] = False

    def has_checksum(self, name: str) -> bool:
        """Whether the checksum of ``name`` is cached (carried forward by sessions)."""
        return name in self._row and bool(self._known[self._row[name]])

    def current_checksum(self, name: str, *, refresh: bool = False) -> torch.Tensor:
        """0-dim int64 checksum of the parameter as the target holds it now."""
        row = self._row[name]
        self._ensure_checksums(np.array([row], dtype=np.int64), refresh=refresh)
        return self._table[row].clone()

    def _ensure_checksums(self, rows: np.ndarray, *, refresh: bool) -> None:
        """Fill the table ``rows`` ([k] int64, distinct) that are not known (all of them with ``refresh``): on
        CUDA one checksum launch per element size for all of them."""
        missing = rows if refresh else rows[~self._known[rows]]
        if missing.size:
            sums = checksum_tensors([self.target.read_checkpoint_tensor(self._names[r]) for r in missing.tolist()])
            self._table[upload(torch.from_numpy(missing), self._table.device)] = sums
            self._known[missing] = True


class UpdateSession:
    """One update: ``start(version)`` -> ``add(chunk)``* -> ``finish()``. Single use.

    ``finish`` is ``prepare`` -> ``commit`` -> ``publish``. Ranks that must agree (tensor parallelism)
    call the three themselves and vote between them: ``prepare`` validates and writes nothing, ``commit``
    writes and verifies but keeps the receiver's version, and a rank whose peer failed calls ``rollback``
    instead of ``publish``.
    """

    def __init__(self, receiver: WeightReceiver, *, dense_rollback: bool = True) -> None:
        self._receiver = receiver
        self._dense_rollback = dense_rollback  # copy dense parameters aside before writing (see WeightReceiver)
        self._state = "new"  # new -> started -> prepared -> committed -> finished; any -> failed
        self._version = -1
        self._expected: frozenset[str] | None = None
        self._updates: dict[str, Update] = {}
        # What phase 1 needs of each record, noted by ``add`` (a record's position is its place in ``_updates``):
        self._rows: list[int] = []  # per record: its parameter's row of the receiver's arrays
        self._checksums: list[int] = []  # per record: the sender's checksum
        self._dense_at: list[int] = []  # the dense records' positions
        self._patch_at: list[int] = []  # the patches' positions; a patch's number is its place here
        self._patch_counts: list[int] = []  # per patch, in turn: its indices, overflow values, escapes
        self._runs: dict[tuple[bool, int, torch.dtype], list[int]] = {}  # (plain values, gap rank, engine dtype) -> patch numbers
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
        """Receive a chunk. Checks names, shapes and dtypes (of index streams too) now; writes nothing."""
        self._expect("add", "started")
        try:
            for update in updates:
                self._note(update)
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
        receiver._known[p.rows] = True
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

    def _check_arrived(self) -> None:
        """Raise unless every parameter announced at ``start`` arrived."""
        missing = sorted((self._expected or frozenset()) - self._updates.keys())
        if missing:
            raise WeightUpdateError(f"stream cut short: {len(missing)} announced parameters never arrived, e.g. {missing[:5]}")

    def _note(self, update: Update) -> None:
        """Check what a record allows without reading its data (name, shapes, dtypes, counts) and note what
        phase 1 needs of it; raise WeightUpdateError for a record that cannot be applied."""
        receiver = self._receiver
        if not isinstance(update, (Dense, Patch)):
            raise WeightUpdateError(f"not an update record: {type(update).__name__}")
        name = update.name
        row = receiver._row.get(name)
        if row is None:
            raise WeightUpdateError(f"unknown parameter {name!r}")
        if self._expected is not None and name not in self._expected:
            raise WeightUpdateError(f"{name}: not among the parameters announced at start")
        if name in self._updates:
            raise WeightUpdateError(f"{name}: sent twice in one session")
        dtype, at = receiver._dtypes[row], len(self._rows)
        if isinstance(update, Dense):
            payload = update.tensor
            if payload.dtype != dtype:
                raise WeightUpdateError(f"{name}: dtype {payload.dtype} != engine dtype {dtype}")
            shape = receiver.specs[name].shape
            if tuple(payload.shape) != shape:
                raise WeightUpdateError(f"{name}: shape {tuple(payload.shape)} != checkpoint shape {shape}")
            self._dense_at.append(at)
        else:
            indices, payload, escapes = update.indices, update.values, update.escapes
            num, is_delta = indices.gaps.numel(), update.is_delta
            if payload.dtype != dtype and not is_delta:
                raise WeightUpdateError(f"{name}: dtype {payload.dtype} != engine dtype {dtype}")
            if payload.dim() != 1 or payload.numel() != num:
                raise WeightUpdateError(f"{name}: {num} indices but values of shape {tuple(payload.shape)}")
            if num > receiver._numels[row]:
                raise WeightUpdateError(f"{name}: {num} indices for {receiver._numels[row]} elements")
            if is_delta and (escapes is None or escapes.dtype != dtype or escapes.dim() != 1):
                raise WeightUpdateError(f"{name}: a bit-delta patch needs 1-D escape values of dtype {dtype}")
            check_stream_dtypes((indices,))
            self._patch_counts += (num, indices.overflow.numel(), escapes.numel() if is_delta else 0)
            self._runs.setdefault((not is_delta, _GAP_RANK[indices.gaps.dtype], dtype), []).append(len(self._patch_at))
            self._patch_at.append(at)
        self._rows.append(row)
        self._checksums.append(update.checksum)
        self._updates[name] = update

    def _validate(self) -> "_Prepared":
        """Phase 1: stage on device, decode and check index streams, predict checksums; one host sync."""
        receiver, target = self._receiver, self._receiver.target
        device = target.device
        self._check_arrived()
        t0 = time.perf_counter()
        records = list(self._updates.values())
        rows = np.array(self._rows, dtype=np.int64)  # [R] the records' rows of the receiver's arrays
        here = device_index(device)
        dense = []
        for i in self._dense_at:
            tensor = records[i].tensor
            payload = tensor if tensor.get_device() == here else tensor.to(device, non_blocking=True)
            dense.append(_DenseRecord(update=records[i], row=i, payload=payload))
        lend = self._lender(target) if receiver.batched_scatter else None
        plans = self._plan_groups(records, rows, lend)
        # Every host-side number of the session in one copy: checksums, table rows, dense positions, group columns
        # and, for block groups, their blocks per member and live data pointers.
        num = len(records)
        host = np.concatenate([np.array(self._checksums, dtype=np.int64), rows, np.array(self._dense_at, dtype=np.int64),
                               *(part.reshape(-1) for plan in plans for part in (plan.columns, *(plan.blocks or ())))])
        meta = upload(torch.from_numpy(host), device)
        expected, table_rows, dense_rows = meta[:num], meta[num : 2 * num], meta[2 * num : 2 * num + len(dense)]  # [R], [R], [num dense]
        receiver._ensure_checksums(rows[self._patch_at], refresh=not receiver.trust_cached_checksums)
        groups, at = [], 2 * num + len(dense)
        for plan in plans:
            k = len(plan.members)
            columns = meta[at : at + _META_ROWS * k].view(_META_ROWS, k)
            at += _META_ROWS * k
            if plan.blocks is None:
                groups.append(self._patch_group(plan, columns, device))
                continue
            from kernels.patch import block_table

            blocks, addrs = meta[at : at + k], meta[at + k : at + 2 * k]  # [k], [k]
            at += 2 * k
            table = block_table(columns[_SIZES], columns[_NUMEL], addrs, columns[_OVERFLOW], columns[_ESCAPES], blocks,
                                int(plan.blocks[0].sum()))
            groups.append(self._block_group(plan, columns, table, blocks, device))
        predicted = torch.zeros(num, dtype=torch.int64, device=device)  # [R]
        if dense:
            predicted[dense_rows] = checksum_tensors([d.payload for d in dense])
        for g in groups:
            predicted[g.meta[_ROWS]] = g.predicted
        self._check_all(records, groups, predicted, expected)
        return _Prepared(records=records, rows=rows, dense=dense, groups=groups, expected=expected, table_rows=table_rows,
                         dense_rows=dense_rows, times=[t0, time.perf_counter()])

    def _write(self) -> None:
        """Phase 2: write, keeping old values for rollback; on failure restore and raise."""
        target, p = self._receiver.target, self._prepared
        dense = p.dense
        written: list[_DenseRecord] = []
        written_groups: list[_PatchGroup | _BlockPatchGroup] = []
        try:
            if dense and self._dense_rollback:
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
            reads = [g.read_back(target) for g in p.groups]  # per group: where read-back bits != sent bits
            flags = torch.cat([failed, *(m.any()[None] for m in reads)]).tolist()  # [R + groups]
            for g, m, bad_group in zip(p.groups, reads, flags[len(p.records):]):
                if bad_group:  # which members: per-member sums, only when some bit did not hold
                    failed[g.meta[_ROWS]] = g.mismatched(m)
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

    def _plan_groups(self, records: list[Update], rows: np.ndarray, lend) -> list[_GroupPlan]:
        """One plan per engine dtype of the patches (``rows``: [R] every record's row of the receiver's arrays),
        from what ``add`` noted: nothing per member but picking it out of ``records`` (and, where ``lend``, the
        target's ``writable_views``, gives the members' live tensors, reading their addresses)."""
        receiver = self._receiver
        order: dict[torch.dtype, list[int]] = {}  # engine dtype -> its patches' numbers, in member order
        num_delta: dict[torch.dtype, int] = {}
        runs: dict[torch.dtype, list[tuple[int, int]]] = {}
        for (plain, _, dtype), run in sorted(self._runs.items(), key=lambda item: item[0][:2]):
            numbers = order.setdefault(dtype, [])
            runs.setdefault(dtype, []).append((len(numbers), len(numbers) + len(run)))
            numbers.extend(run)
            num_delta[dtype] = num_delta.get(dtype, 0) + (0 if plain else len(run))
        counts = np.array(self._patch_counts, dtype=np.int64).reshape(-1, 3)  # [P, 3]: indices, overflow values, escapes
        patch_at = np.array(self._patch_at, dtype=np.int64)  # [P]
        plans = []
        for dtype, numbers in order.items():
            at = patch_at[numbers]  # [k] the members' positions among the records
            columns = np.empty((_META_ROWS, len(numbers)), dtype=np.int64)
            columns[[_SIZES, _OVERFLOW, _ESCAPES]] = counts[numbers].T
            columns[_NUMEL] = receiver._numels[rows[at]]
            columns[_ROWS] = at
            columns[_TABLE] = rows[at]
            members = [records[i] for i in at.tolist()]
            lent = None if lend is None else lend([p.name for p in members], dtype)
            held = blocks = None
            if lent is not None:
                from kernels.patch import blocks_per_patch

                held, addresses = lent
                blocks = (blocks_per_patch(columns[_SIZES]), addresses)
            plans.append(_GroupPlan(dtype=dtype, members=members, num_delta=num_delta[dtype], runs=runs[dtype], columns=columns,
                                    held=held, blocks=blocks))
        return plans

    def _lender(self, target: WeightTarget):
        """What lends a group's live tensors to the block path: ``lend(names, dtype)`` -> (tensors holding them, kept
        alive while they are written; [k] int64 data pointers) or None; from the target's ``writable_addresses``
        (no view per name) or ``writable_views``. None: the target lends nothing."""
        here = device_index(target.device)
        fast = getattr(target, "writable_addresses", None)
        if fast is not None:
            def lend(names: list[str], dtype: torch.dtype):
                lent = fast(names)
                assert lent is None or all(t.get_device() == here and t.dtype == dtype for t in lent[0]), \
                    f"writable_addresses must lend {dtype} tensors on the target's device"
                return lent
            return lend
        views_of = getattr(target, "writable_views", None)
        if views_of is None:
            return None

        def lend_views(names: list[str], dtype: torch.dtype):
            views = views_of(names)
            return None if views is None else (views, self._addresses(views, dtype))
        return lend_views

    def _addresses(self, views: list[torch.Tensor], dtype: torch.dtype) -> np.ndarray:
        """[k] int64 data pointers of the live tensors a target lent, checked: contiguous, ``dtype``, on its device."""
        here = device_index(self._receiver.target.device)
        for t in views:
            assert t.get_device() == here and t.dtype == dtype and t.is_contiguous(), \
                f"writable_views must be contiguous {dtype} tensors on the target's device, got {t.dtype} {tuple(t.shape)}"
        return np.array([t.data_ptr() for t in views], dtype=np.int64)

    def _patch_group(self, plan: _GroupPlan, meta: torch.Tensor, device: torch.device) -> _PatchGroup:
        """The torch path. ``meta``: ``plan.columns`` on the device."""
        receiver = self._receiver
        members, num_delta, columns = plan.members, plan.num_delta, plan.columns

        def holding(column: int, start: int, stop: int) -> list[Patch]:
            """The members in [start, stop) whose ``column`` count is not 0: the parts to concatenate."""
            return [members[i] for i in (start + np.flatnonzero(columns[column, start:stop])).tolist()]

        k = len(members)
        streams = decode_streams(concat_to([p.indices.gaps for p in holding(_SIZES, 0, k)], torch.int64, device),
                                 concat_to([p.indices.overflow for p in holding(_OVERFLOW, 0, k)], torch.int64, device), meta[_SIZES])
        # Clamped into each member's bounds, the indices are safe to read through even before the checks
        # are known; where the checks pass, clamping changed nothing.
        limit = meta[_NUMEL] - 1  # [k]
        indices = streams.indices.clamp_(min=limit.new_zeros(()), max=limit.index_select(0, streams.segment))  # [n]
        sizes = columns[_SIZES].tolist()
        group = _PatchGroup(members=members, sizes=sizes, meta=meta, streams=streams)
        group.old = group.gather(receiver.target)  # [n]
        num_delta_elements = sum(sizes[:num_delta])  # the delta members come first
        deltas = concat_to([p.values for p in holding(_SIZES, 0, num_delta)], torch.int8, device)  # [num delta]
        plain = concat_to([p.values for p in holding(_SIZES, num_delta, k)], plan.dtype, device)  # [n - num delta]
        if num_delta_elements:
            escapes = concat_to([p.escapes for p in holding(_ESCAPES, 0, num_delta)], plan.dtype, device)  # [num escapes]
            escaped = deltas == 0  # [num delta]
            # over all n elements (the plain members' escape nothing), to be read at the members' bounds
            escape_scan = torch.cumsum(torch.nn.functional.pad(escaped, (0, indices.numel() - num_delta_elements)), 0)  # [n]
            decoded_deltas = apply_bit_deltas(group.old[:num_delta_elements], deltas, escapes, escaped, escape_scan[:num_delta_elements])
            group.new = decoded_deltas if num_delta_elements == indices.numel() else torch.cat([decoded_deltas, plain])
            escape_counts = streams.bounds.totals(escape_scan)  # [k] escaped delta bytes
        else:
            group.new = plain
            escape_counts = torch.zeros(k, dtype=torch.int64, device=device)
        base = receiver._table.index_select(0, meta[_TABLE])  # [k] checksums before the patch
        terms = delta_terms(group.old, group.new, indices, bound=int(columns[_NUMEL].max()))  # [n]
        group.predicted = base + group.member_sums(terms)
        sums = streams.sums  # [k, 2]
        group.checks = torch.stack([sums[:, 0] - 1, (sums[:, 1] != meta[_OVERFLOW]).to(torch.int64),
                                    (escape_counts != meta[_ESCAPES]).to(torch.int64)], 1)
        return group

    def _block_group(self, plan: _GroupPlan, meta: torch.Tensor, table: torch.Tensor, blocks: torch.Tensor,
                     device: torch.device) -> _BlockPatchGroup:
        """The block path (`kernels/patch.py`). ``meta``: ``plan.columns``, ``table``: the members' block table and
        ``blocks``: ``plan.blocks[0]``, on the device."""
        from kernels.patch import block_counts, block_starts, decode

        members, columns, k = plan.members, plan.columns, len(plan.members)
        sizes = columns[_SIZES]
        elem_start = np.concatenate([[0], np.cumsum(sizes)])  # [k + 1]
        block_start = np.concatenate([[0], np.cumsum(plan.blocks[0])])  # [k + 1]

        def holding(column: int, start: int, stop: int) -> list[Patch]:
            """The members in [start, stop) whose ``column`` count is not 0: the parts to concatenate."""
            return [members[i] for i in (start + np.flatnonzero(columns[column, start:stop])).tolist()]

        overflow = concat_to([p.indices.overflow for p in holding(_OVERFLOW, 0, k)], torch.int32, device)  # [e]
        overflow_scan = torch.nn.functional.pad(torch.cumsum(overflow, 0, dtype=torch.int64), (1, 0))  # [e + 1]
        spare_overflow = torch.nn.functional.pad(overflow, (0, 1), value=1)  # [e + 1]: loads stay in range
        escapes = concat_to([p.escapes for p in holding(_ESCAPES, 0, plan.num_delta)], plan.dtype, device)
        spare_escapes = torch.cat([escapes, escapes.new_zeros(1)])  # [escapes + 1]
        counts = torch.zeros(table.shape[0], 4, dtype=torch.int64, device=device)  # [B, 4]
        runs = []  # per run holding elements: its blocks, gaps, values, whether deltas, first element
        for lo, hi in plan.runs:
            parts = holding(_SIZES, lo, hi)
            if not parts:
                continue
            delta = lo < plan.num_delta
            gaps = concat_to([p.indices.gaps for p in parts], parts[0].indices.gaps.dtype, device)
            values = concat_to([p.values for p in parts], torch.int8 if delta else plan.dtype, device)
            run = (range(int(block_start[lo]), int(block_start[hi])), gaps, values, delta, int(elem_start[lo]))
            block_counts(table, run[0], gaps, values if delta else None, run[4], counts)
            runs.append(run)
        block_starts(table, counts, overflow_scan)
        n = int(elem_start[-1])
        indices = torch.empty(n, dtype=torch.int32, device=device)
        old, new = (torch.empty(n, dtype=plan.dtype, device=device) for _ in range(2))
        terms = torch.zeros(table.shape[0], dtype=torch.int64, device=device)  # [B] checksum change per block
        for block_range, gaps, values, delta, shift in runs:
            decode(table, block_range, gaps, spare_overflow, values, spare_escapes if delta else None, shift, indices, old, new,
                   terms, max_numel=int(columns[_NUMEL].max()))
        # per member: gap sum (last index + 1), escaped gaps, gaps < 0, escaped deltas, checksum change
        sums = segment_sums(torch.cat([counts.t(), terms[None]]), blocks)  # [k, 5]
        bad_overflow = segment_sums((overflow < 1).to(torch.int64), meta[_OVERFLOW])  # [k]
        faults = torch.stack([sums[:, 0] - 1, (sums[:, 1] != meta[_OVERFLOW]).to(torch.int64),
                              (sums[:, 3] != meta[_ESCAPES]).to(torch.int64), bad_overflow, sums[:, 2]], 1)
        predicted = self._receiver._table.index_select(0, meta[_TABLE]) + sums[:, 4]
        return _BlockPatchGroup(members=members, meta=meta, table=table, blocks=blocks, held=plan.held, indices=indices,
                                faults_=faults, predicted=predicted, old=old, new=new)

    def _check_all(self, records: list[Update], groups: list["_PatchGroup | _BlockPatchGroup"], predicted: torch.Tensor,
                   expected: torch.Tensor) -> None:
        """Raise for the first bad index stream (in the order sent), else for checksums that do not match
        their prediction. One host sync reads one flag for every check of the session; only when it is set
        are the per-record values read to name what failed."""
        if not torch.cat([*(g.fault_flag() for g in groups), predicted != expected]).any().item():
            return
        values = torch.cat([*(g.faults().reshape(-1) for g in groups), predicted]).tolist()
        streams, at = {}, 0
        for g in groups:
            for p in g.members:
                streams[p.name] = values[at : at + 5]
                at += 5
        for u in records:
            if not isinstance(u, Patch):
                continue
            last, uneven, escapes, bad_escaped, bad_other = streams[u.name]
            if uneven or bad_escaped:
                raise WeightUpdateError(f"{u.name}: malformed index stream (escape count != overflow count, or an overflow gap < 1)")
            if bad_other:
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
        if not dense or self._dense_rollback:
            return "weights restored"
        self._receiver.invalidate_checksums([d.update.name for d in dense])
        return (f"patches undone, but the {len(dense)} dense parameters were written without a rollback copy "
                "(dense_rollback=False) and may hold new values: push them densely again")

    def _rollback(self, dense: list[_DenseRecord], groups: list["_PatchGroup | _BlockPatchGroup"]) -> None:
        target = self._receiver.target
        for g in groups:
            g.scatter(target, g.old)  # members not yet written get their current values back: a no-op
        for d in reversed(dense):
            if d.old is not None:  # None: dense_rollback=False
                target.write_dense(d.update.name, d.old)


def apply_update(target: WeightTarget, version: int, updates: Iterable[Update], *, current_version: int = 0) -> UpdateResult:
    """One-shot session on a target without a long-lived receiver (no checksum cache)."""
    return WeightReceiver(target, version=current_version).apply(version, updates)


class _SpecsOnly:
    """A target that only says what it accepts: the checks of a ``StagingReceiver`` read no weights."""

    def __init__(self, specs: Mapping[str, ParamSpec]) -> None:
        self._specs = dict(specs)

    def checkpoint_specs(self) -> Mapping[str, ParamSpec]:
        return self._specs

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class RemoteSessions(Protocol):
    """Sessions where the weights are (every rank of a tensor-parallel engine), driven step by step."""

    def prepare(self, version: int, records: list[Update], dense_rollback: bool | None) -> None:
        """Validate and hold the records everywhere; nothing written. Raises if any place refused them."""
        ...

    def commit(self) -> None:
        """Write and verify everywhere. Raises if any place failed (that place has restored itself)."""
        ...

    def publish(self) -> UpdateResult:
        ...

    def rollback(self) -> str:
        """Drop the sessions everywhere, writing back what a commit wrote; what was restored, in words."""
        ...


class StagingReceiver:
    """A receiver for weights it cannot reach itself (a tensor-parallel engine's, spread over its ranks).

    Its sessions take the calls and states of an ``UpdateSession``. ``start`` and ``add`` check each record
    as a ``WeightReceiver``'s do, against ``specs`` (names, shapes, dtypes, counts: nothing that reads tensor
    data), and hold the records; ``prepare`` checks that every announced name arrived and hands the records
    to ``remote.prepare`` (validated where the weights are, nothing written); ``commit``, ``publish`` and
    ``rollback`` are the remote sessions' own, so a rollback after commit restores the weights everywhere
    (given the remote sessions' rollback copy: ``dense_rollback``). ``device``: where a transport should land
    the records (the weights' first device).
    """

    def __init__(self, specs: Mapping[str, ParamSpec], remote: RemoteSessions, *, version: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self._checks = WeightReceiver(_SpecsOnly(specs), version=version)
        self._remote = remote
        self._device = torch.device(device)

    @property
    def version(self) -> int:
        return self._checks.version

    @version.setter
    def version(self, version: int) -> None:
        self._checks.version = version

    @property
    def device(self) -> torch.device:
        return self._device

    def session(self, *, dense_rollback: bool | None = None) -> "StagedSession":
        """A new session; ``dense_rollback`` is passed on to the remote sessions."""
        return StagedSession(self, dense_rollback)


class StagedSession:
    """One update through a ``StagingReceiver``: ``start`` -> ``add``* -> ``prepare`` -> ``commit`` -> ``publish``
    (``finish`` runs the last three), as an ``UpdateSession``."""

    def __init__(self, receiver: StagingReceiver, dense_rollback: bool | None) -> None:
        self._receiver = receiver
        self._remote = receiver._remote
        self._dense_rollback = dense_rollback
        self._checks = receiver._checks.session()  # checks and holds the records; never prepared
        self._state = "new"  # new -> started -> prepared -> committed -> finished; any -> failed

    @property
    def state(self) -> str:
        return self._state

    def start(self, version: int, *, expected_names: Collection[str] | None = None) -> None:
        self._expect("start", "new")
        self._checks.start(version, expected_names=expected_names)
        self._state = "started"

    def add(self, updates: Iterable[Update]) -> None:
        self._expect("add", "started")
        with self._ending_on_error():
            self._checks.add(updates)

    def finish(self) -> UpdateResult:
        self._expect("finish", "started")
        self.prepare()
        self.commit()
        return self.publish()

    def prepare(self) -> None:
        self._expect("prepare", "started")
        with self._ending_on_error():
            self._checks._check_arrived()
            version, records = self._checks._version, list(self._checks._updates.values())
            self._checks.abort()  # the records now live in the remote sessions
            self._remote_step(self._remote.prepare, version, records, self._dense_rollback)
        self._version = version
        self._state = "prepared"

    def commit(self) -> None:
        self._expect("commit", "prepared")
        with self._ending_on_error():
            self._remote_step(self._remote.commit)
        self._state = "committed"

    def publish(self) -> UpdateResult:
        self._expect("publish", "committed")
        with self._ending_on_error():
            result = self._remote.publish()
        assert result.version == self._version
        self._receiver.version = result.version
        self._end("finished")
        return result

    def abort(self) -> None:
        if self._state in ("prepared", "committed"):
            self._remote.rollback()
        self._end()

    def rollback(self) -> str:
        assert self._state != "finished", "rollback() after publish()"
        what = self._remote.rollback() if self._state in ("prepared", "committed") else "nothing written"
        self._end()
        return what

    def _remote_step(self, step, *args) -> None:
        """One step on the remote sessions; if it fails anywhere, every remote session is dropped (places that
        succeeded roll back too) and the error raised."""
        try:
            step(*args)
        except BaseException:
            self._remote.rollback()
            raise

    def _expect(self, call: str, state: str) -> None:
        if self._state != state:
            raise WeightUpdateError(f"{call}() on a session that is {self._state}")

    def _end(self, state: str = "failed") -> None:
        if self._checks.state == "started":
            self._checks.abort()  # frees the receiver and drops the records
        if self._state != "finished":
            self._state = state

    @contextlib.contextmanager
    def _ending_on_error(self):
        try:
            yield
        except BaseException:
            self._end()
            raise
