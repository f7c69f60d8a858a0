"""Rollout side: versioned, validate-then-apply weight-update sessions.

::

    receiver = WeightReceiver(target, version=0)      # one per engine (rank); keeps checksums
    session = receiver.session()
    session.start(7, expected_names=[...])            # misuse (chunks before start, twice) raises
    session.add(chunk_of_updates)                      # cheap checks now; nothing written
    result = session.finish()                          # validate all -> write -> verify -> version 7

``finish`` runs in three phases and touches the weights only in the second:

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
   checksum). Any failure in 2 or 3 writes the old values back (dense ones only with the rollback copy).

A failed session raises ``WeightUpdateError`` naming the parameter and leaves weights and version as
they were. Without the dense rollback copy, a failure after writing (which phase 1 leaves only to a
faulty target) restores the patches but not the dense parameters; the error says so, and their cached
checksums are dropped, so a later patch of them is checked against the weights as they are. Host syncs: a few per session
(bounds, predicted checksums, verification), none per parameter; the checks over all patches run as a
few batched kernels per dtype, and host metadata travels to the device in one pinned copy per kind.
This module does not move bytes between processes (see ``transports``) and does not decide encodings
(see ``differ``).
"""

import dataclasses
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch

from kernels.common import SIGNED_VIEW, upload
from weight_updates.checksum import checksum_tensor, checksum_tensors, concat_to, patch_checksum_deltas, segment_sums
from weight_updates.encoding import Dense, Patch, Update, apply_bit_deltas, decode_many
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


@dataclass(kw_only=True, slots=True)
class _Staged:
    """One validated record, moved to the target device."""

    update: Update
    indices: torch.Tensor | None  # [num_changed] int64 on device (patch only)
    payload: torch.Tensor  # dense: checkpoint shape; patch: [num_changed]; engine dtype, on device
    old: torch.Tensor | None = None  # the same shape as payload: values before the write


@dataclass(kw_only=True, slots=True)
class _PatchGroup:
    """The session's patches of one dtype, read and written together: one batched gather / scatter
    (`kernels/scatter.py`) on CUDA when the target lends its live tensors, else per patch."""

    members: list[_Staged]
    indices: torch.Tensor  # [n] int64: the members' flat indices, concatenated
    segment: torch.Tensor  # [n] int64: which member each element belongs to
    sizes: list[int]  # elements per member
    views: list[torch.Tensor] | None  # the members' live contiguous tensors, or None
    old: torch.Tensor | None = None  # [n] values before the write
    new: torch.Tensor | None = None  # [n] values to write

    def gather(self, target: WeightTarget) -> torch.Tensor:
        if self.views is not None:
            from kernels.scatter import gather_many

            return gather_many(self.views, self.indices, self.segment)
        return torch.cat([target.read_checkpoint_tensor(s.update.name).reshape(-1).index_select(0, s.indices)
                          for s in self.members])

    def scatter(self, target: WeightTarget, values: torch.Tensor) -> None:
        if self.views is not None:
            from kernels.scatter import scatter_many

            scatter_many(self.views, self.indices, self.segment, values)
            return
        for s, v in zip(self.members, values.split(self.sizes)):
            target.write_patch(s.update.name, s.indices, v)


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
    """

    def __init__(self, target: WeightTarget, *, version: int = 0, trust_cached_checksums: bool = True,
                 dense_rollback: bool = True) -> None:
        self.target = target
        self.trust_cached_checksums = trust_cached_checksums
        self.dense_rollback = dense_rollback
        self.specs: dict[str, ParamSpec] = dict(target.checkpoint_specs())
        self.version = version
        self._checksums: dict[str, torch.Tensor] = {}  # name -> 0-dim int64 on target.device
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
        for name in list(self._checksums) if names is None else names:
            self._checksums.pop(name, None)

    def current_checksum(self, name: str, *, refresh: bool = False) -> torch.Tensor:
        """0-dim int64 checksum of the parameter as the target holds it now."""
        if refresh or name not in self._checksums:
            self._checksums[name] = checksum_tensor(self.target.read_checkpoint_tensor(name))
        return self._checksums[name]


class UpdateSession:
    """One update: ``start(version)`` -> ``add(chunk)``* -> ``finish()``. Single use."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self._receiver = receiver
        self._state = "new"  # new -> started -> finished | failed
        self._version = -1
        self._expected: frozenset[str] | None = None
        self._updates: dict[str, Update] = {}

    @property
    def state(self) -> str:
        return self._state

    def start(self, version: int, *, expected_names: Collection[str] | None = None) -> None:
        """Open the session for ``version`` (> the receiver's). ``expected_names``: the parameters
        the sender announced; ``finish`` fails if any did not arrive."""
        if self._state != "new":
            raise WeightUpdateError(f"start() on a session that is {self._state}")
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
        if self._state != "started":
            raise WeightUpdateError(f"add() on a session that is {self._state}")
        try:
            for update in updates:
                self._check_record(update)
                self._updates[update.name] = update
        except WeightUpdateError:
            self.abort()
            raise

    def abort(self) -> None:
        """End the session without touching the weights (a transport gave up)."""
        if self._state == "started":
            self._receiver._active = None
        if self._state in ("new", "started"):
            self._state = "failed"

    def finish(self) -> UpdateResult:
        """Validate everything, write, verify; on success the receiver holds the new version."""
        if self._state != "started":
            raise WeightUpdateError(f"finish() on a session that is {self._state}")
        try:
            return self._finish()
        finally:
            if self._state == "started":
                self._state = "failed"
            self._receiver._active = None

    # ---------------------------------------------------------------------------------------------

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
        elif update.is_delta and (update.escapes is None or update.escapes.dtype != spec.dtype or update.escapes.dim() != 1):
            raise WeightUpdateError(f"{update.name}: a bit-delta patch needs 1-D escape values of dtype {spec.dtype}")

    def _finish(self) -> UpdateResult:
        receiver, target = self._receiver, self._receiver.target
        device = target.device
        missing = sorted((self._expected or frozenset()) - self._updates.keys())
        if missing:
            raise WeightUpdateError(f"stream cut short: {len(missing)} announced parameters never arrived, e.g. {missing[:5]}")

        # Phase 1: stage on device, check bounds, predict checksums.
        t0 = time.perf_counter()
        updates = list(self._updates.values())
        staged = [_Staged(update=u, indices=None, payload=p) for u, p in zip(updates, _stage_payloads(updates, device))]
        patches = [s for s in staged if isinstance(s.update, Patch)]
        groups: list[_PatchGroup] = []
        if patches:
            self._check_patch_streams(patches, device)
            groups = self._patch_groups(patches, device)
            for g in groups:
                self._stage_group(g, device)
        expected = upload(torch.tensor([s.update.checksum for s in staged], dtype=torch.int64), device)  # [num records]
        self._check_predicted_checksums(staged, patches, expected)
        t1 = time.perf_counter()

        # Phase 2: write, keeping old values for rollback.
        dense = [s for s in staged if s.indices is None]
        written: list[_Staged] = []
        try:
            if dense and receiver.dense_rollback:
                current = [target.read_checkpoint_tensor(s.update.name) for s in dense]
                olds = [torch.empty_like(t) for t in current]
                torch._foreach_copy_(olds, current)
                for s, old in zip(dense, olds):
                    s.old = old
            write_many = getattr(target, "write_dense_many", None)
            if dense and write_many is not None:
                written += dense  # a failed batched write may have written any of them
                write_many([(s.update.name, s.payload) for s in dense])
            else:
                for s in dense:
                    written.append(s)
                    target.write_dense(s.update.name, s.payload)
            for g in groups:
                written += g.members
                g.scatter(target, g.new)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as e:
            self._rollback(written, groups)
            raise WeightUpdateError(f"target write failed, {self._restored_what(dense)}: {e}") from e
        t2 = time.perf_counter()

        # Phase 3: read back and verify.
        failed = torch.zeros(len(staged), dtype=torch.bool, device=device)  # [num records]
        if dense:
            rows = self._rows(staged, dense=True)
            got = checksum_tensors([target.read_checkpoint_tensor(s.update.name) for s in dense])
            failed[rows] = got != expected[rows]
        row_of = {id(s): i for i, s in enumerate(staged)}
        for g in groups:
            int_dtype = SIGNED_VIEW[g.new.element_size()]
            differ = torch.ne(g.gather(target).view(int_dtype), g.new.view(int_dtype)).to(torch.int64)  # [n]
            rows = upload(torch.tensor([row_of[id(s)] for s in g.members], dtype=torch.int64), device)
            failed[rows] = segment_sums(differ, g.sizes) > 0
        bad = [s.update.name for s, f in zip(staged, failed.tolist()) if f]
        if bad:
            self._rollback(staged, groups)
            raise WeightUpdateError(f"verification after write failed for {bad[:5]}: the target did not hold the sent bits; "
                                    f"{self._restored_what(dense)}")
        t3 = time.perf_counter()

        for s, check in zip(staged, expected.unbind()):
            receiver._checksums[s.update.name] = check
        receiver.version = self._version
        self._state = "finished"
        num_dense = sum(s.indices is None for s in staged)
        return UpdateResult(
            version=self._version,
            num_dense=num_dense,
            num_patch=len(staged) - num_dense,
            nbytes=sum(s.update.nbytes for s in staged),
            validate_s=t1 - t0,
            apply_s=t2 - t1,
            verify_s=t3 - t2,
        )

    def _check_patch_streams(self, patches: list[_Staged], device: torch.device) -> None:
        """Decode every patch's index stream; check streams, bounds and escape counts in one host sync."""
        all_indices, malformed, last = decode_many([s.update.indices for s in patches], device)
        for s, indices in zip(patches, all_indices):
            s.indices = indices
        bad_escapes = torch.zeros(len(patches), dtype=torch.int64, device=device)  # [num patches]
        delta_rows = [i for i, s in enumerate(patches) if s.update.is_delta]
        if delta_rows:
            escaped = (torch.cat([patches[i].payload for i in delta_rows]) == 0).to(torch.int64)
            counts = segment_sums(escaped, [patches[i].payload.numel() for i in delta_rows])
            wanted = torch.tensor([patches[i].update.escapes.numel() for i in delta_rows], dtype=torch.int64)
            bad_escapes[upload(torch.tensor(delta_rows), device)] = (counts != upload(wanted, device)).to(torch.int64)
        checks = torch.stack([malformed.to(torch.int64), last, bad_escapes], dim=1).tolist()
        for s, (bad, idx, escapes) in zip(patches, checks):
            name = s.update.name
            if bad:
                raise WeightUpdateError(f"{name}: malformed index stream (escape count != overflow count, or an overflow gap < 1)")
            numel = self._receiver.specs[name].numel
            if idx >= numel:
                raise WeightUpdateError(f"{name}: flat index {idx} out of bounds for {numel} elements")
            if escapes:
                raise WeightUpdateError(f"{name}: the escaped deltas do not match its {s.update.escapes.numel()} escape values")

    def _patch_groups(self, patches: list[_Staged], device: torch.device) -> list[_PatchGroup]:
        target = self._receiver.target
        by_dtype: dict[torch.dtype, list[_Staged]] = {}
        for s in patches:
            by_dtype.setdefault(self._receiver.specs[s.update.name].dtype, []).append(s)
        lend = getattr(target, "writable_views", None) if device.type == "cuda" else None
        groups = []
        for members in by_dtype.values():
            sizes = [s.indices.numel() for s in members]
            counts = upload(torch.tensor(sizes, dtype=torch.int64), device)
            segment = torch.repeat_interleave(torch.arange(len(members), device=device), counts, output_size=sum(sizes))  # [n]
            groups.append(_PatchGroup(
                members=members, indices=torch.cat([s.indices for s in members]), segment=segment, sizes=sizes,
                views=None if lend is None else lend([s.update.name for s in members]),
            ))
        return groups

    def _stage_group(self, g: _PatchGroup, device: torch.device) -> None:
        """Gather the group's current values; turn bit deltas into new values (all of the group's at once)."""
        g.old = g.gather(self._receiver.target)
        olds = g.old.split(g.sizes)
        news = [s.payload for s in g.members]
        deltas = [j for j, s in enumerate(g.members) if s.update.is_delta]
        if deltas:
            decoded = apply_bit_deltas(torch.cat([olds[j] for j in deltas]), torch.cat([news[j] for j in deltas]),
                                       concat_to([g.members[j].update.escapes for j in deltas], g.old.dtype, device), checked=True)
            for j, values in zip(deltas, decoded.split([g.sizes[j] for j in deltas])):
                news[j] = values
        g.new = torch.cat(news)
        for s, old, new in zip(g.members, olds, g.new.split(g.sizes)):
            s.old, s.payload = old, new

    @staticmethod
    def _rows(staged: list[_Staged], *, dense: bool) -> torch.Tensor:
        """int64 rows of ``staged`` that are dense records (or patches), on the target device."""
        rows = [i for i, s in enumerate(staged) if (s.indices is None) == dense]
        return upload(torch.tensor(rows, dtype=torch.int64), staged[0].payload.device)

    def _restored_what(self, dense: list[_Staged]) -> str:
        if not dense or self._receiver.dense_rollback:
            return "weights restored"
        self._receiver.invalidate_checksums([s.update.name for s in dense])
        return (f"patches undone, but the {len(dense)} dense parameters were written without a rollback copy "
                "(dense_rollback=False) and may hold new values: push them densely again")

    def _check_predicted_checksums(self, staged: list[_Staged], patches: list[_Staged], expected: torch.Tensor) -> None:
        """Raise unless every record's post-update checksum, predicted before writing, is ``expected``.

        Dense: the checksum of the incoming tensor. Patch: the parameter's current checksum plus
        the patch's change (all patches in a few kernels). One host sync.
        """
        if not staged:
            return
        receiver = self._receiver
        predicted = torch.zeros(len(staged), dtype=torch.int64, device=expected.device)  # [num records]
        if len(patches) < len(staged):
            predicted[self._rows(staged, dense=True)] = checksum_tensors([s.payload for s in staged if s.indices is None])
        if patches:
            refresh = not receiver.trust_cached_checksums
            bases = torch.stack([receiver.current_checksum(s.update.name, refresh=refresh) for s in patches])  # [num patches]
            deltas = patch_checksum_deltas([s.old for s in patches], [s.payload for s in patches], [s.indices for s in patches])
            predicted[self._rows(staged, dense=False)] = bases + deltas
        got = predicted.tolist()
        bad = [(s, g) for s, g in zip(staged, got) if g != s.update.checksum]
        if bad:
            s, g = bad[0]
            kind = "the incoming tensor" if s.indices is None else "the current weights with the patch applied"
            raise WeightUpdateError(
                f"checksum mismatch for {len(bad)} parameters, first {s.update.name}: sender says {s.update.checksum}, "
                f"{kind} give {g} (corrupt data, or a patch against a different base version)"
            )

    def _rollback(self, written: list[_Staged], groups: list[_PatchGroup]) -> None:
        target = self._receiver.target
        touched = {id(s) for s in written}
        for g in groups:
            if any(id(s) in touched for s in g.members):
                g.scatter(target, g.old)  # unwritten members get their current values back: a no-op
        for s in reversed(written):
            if s.indices is None and s.old is not None:  # None: dense_rollback=False
                target.write_dense(s.update.name, s.old)


def _stage_payloads(updates: list[Update], device: torch.device) -> list[torch.Tensor]:
    """Every record's payload (dense tensor or patch values) on ``device``. Host patch values bound for CUDA
    (many small tensors) travel in one pinned copy per dtype, not one pageable copy each; dense tensors are
    large enough to move one by one."""
    payloads = [u.tensor if isinstance(u, Dense) else u.values for u in updates]
    out = list(payloads)
    if device.type == "cuda":
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (u, p) in enumerate(zip(updates, payloads)):
            if isinstance(u, Patch) and p.device.type == "cpu":
                by_dtype.setdefault(p.dtype, []).append(i)
        for dtype, members in by_dtype.items():
            flat = concat_to([payloads[i].reshape(-1) for i in members], dtype, device)
            for i, part in zip(members, flat.split([payloads[i].numel() for i in members])):
                out[i] = part.view(payloads[i].shape)
    return [p if p.device == device else p.to(device, non_blocking=True) for p in out]


def apply_update(target: WeightTarget, version: int, updates: Iterable[Update], *, current_version: int = 0) -> UpdateResult:
    """One-shot session on a target without a long-lived receiver (no checksum cache)."""
    return WeightReceiver(target, version=current_version).apply(version, updates)
