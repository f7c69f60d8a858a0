"""The weight-update endpoints of one rank's runner: what `collective_rpc("weight_sync.<method>", ...)` runs.

Two receivers write the same weights. "full" takes records in full checkpoint coordinates (every rank of
a tensor-parallel engine gets every record, and each writes its own shard through
`ShardedCheckpointWeights`; without tensor parallelism, the plain `CheckpointWeights`). "rank_local" takes
records in the rank's own coordinates (each rank maps its own bucket, see
weight_updates/transports/rank_local.py). Each receiver caches checksums in its own coordinates, so an
update through one drops the other's cache, and both follow the engine's policy version, which the
caller passes in. A full-coordinate update is staged (`prepare` -> `commit` -> `publish`, or `rollback`),
one collective RPC per step, so that a tensor-parallel engine's update is undone on every rank when any
rank (or any other engine of a pool) fails; in one process the engine's weight sink uses the "full"
receiver directly. Not here: moving records between processes, the
engine's version bump.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.model_runner import ModelRunner
    from weight_updates import UpdateResult, WeightReceiver


class StagedOnRank:
    """The one staged update session of a rank's endpoint, in the steps the engine drives on every rank (each a
    collective RPC): prepare (validate, nothing written) -> commit (write, verify) -> publish, or rollback at
    any point. Used by `WeightSync` (the base weights) and runner/lora/runtime.py (an adapter slot)."""

    def __init__(self) -> None:
        self._staged = None  # the UpdateSession of `prepare`, until published or rolled back

    def prepare(self, receiver: "WeightReceiver", version: int, records: list, dense_rollback: bool) -> None:
        """Validate `records` against `receiver` and hold them; nothing is written. A session staged before and
        not published is dropped first."""
        self.rollback()
        session = receiver.session(dense_rollback=dense_rollback)
        session.start(version)
        session.add(records)
        session.prepare()
        self._staged = session

    def commit(self) -> None:
        """Write and verify the staged records (a failure writes the old values back and raises)."""
        assert self._staged is not None, "commit() with nothing staged"
        try:
            self._staged.commit()
        except BaseException:
            self._staged = None
            raise

    def publish(self) -> "UpdateResult":
        session, self._staged = self._staged, None
        assert session is not None, "publish() with nothing staged"
        return session.publish()

    def rollback(self) -> str:
        """Drop the staged session, writing back what its commit wrote; what was restored, in words."""
        session, self._staged = self._staged, None
        return "nothing staged" if session is None else session.rollback()


class WeightSync:
    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self._receivers: dict[str, "WeightReceiver"] = {}  # "full" | "rank_local", made on first use
        self._stage = StagedOnRank()  # a full-coordinate update of `prepare`, until published or rolled back

    def receiver(self, path: str, current_version: int) -> "WeightReceiver":
        """The receiver of `path`, at `current_version`; the other path's cached checksums are dropped."""
        from weight_updates import WeightReceiver

        receiver = self._receivers.get(path)
        if receiver is None:
            if path == "full":
                receiver = WeightReceiver(self.runner.weights, version=current_version, dense_rollback=False)
            else:
                from runner.parallel.weights import RankLocalWeights

                # The rollback copy: a peer's failure after this rank wrote must leave this rank unchanged.
                receiver = WeightReceiver(RankLocalWeights(self.runner.model), version=current_version, dense_rollback=True)
            self._receivers[path] = receiver
        receiver.version = current_version
        for other_path, other in self._receivers.items():
            if other_path != path:
                other.invalidate_checksums()
        return receiver

    # A staged update in full coordinates (`StagedOnRank`), one collective RPC per step.
    def prepare(self, version: int, records: list, current_version: int, dense_rollback: bool) -> None:
        """Validate `records` and hold them in a session of this rank; nothing is written."""
        self._stage.prepare(self.receiver("full", current_version), version, records, dense_rollback)

    def commit(self) -> None:
        self._stage.commit()

    def publish(self) -> "UpdateResult":
        return self._stage.publish()

    def rollback(self) -> str:
        return self._stage.rollback()

    def apply_rank_local(self, version: int, handles: list[dict], current_version: int) -> "UpdateResult":
        """Map `handles[rank]` (this rank's bucket) and apply it, voting with the other ranks so that every
        rank publishes `version` or none changes anything."""
        from weight_updates.transports.rank_local import serve_rank_local

        tp = self.runner.tp
        if tp is None:  # one rank has no peer to roll back for: the full-coordinate receiver (no rollback copy)
            return serve_rank_local(self.receiver("full", current_version), version, handles[0],
                                    exchange=lambda value: [value])
        return serve_rank_local(self.receiver("rank_local", current_version), version, handles[tp.rank],
                                exchange=tp.all_gather_json)

    def export(self) -> list | None:
        """Every weight as a full checkpoint-shaped Dense record (under TP assembled with collectives, so every
        rank takes part); rank 0 returns them, other ranks None. In one process they are views of the live
        weights."""
        from weight_updates import Dense

        weights = self.runner.weights
        records = [Dense.of(name, weights.read_checkpoint_tensor(name)) for name in weights.layout]
        return records if self.runner.tp is None or self.runner.tp.rank == 0 else None

    def rank_local_checksums(self) -> dict[str, int]:
        """Checkpoint name -> checksum of this rank's part as it holds it now."""
        from runner.parallel.weights import RankLocalWeights
        from weight_updates.checksum import checksum_tensors

        weights = RankLocalWeights(self.runner.model)
        names = list(weights.layout)
        return dict(zip(names, checksum_tensors([weights.view(n) for n in names]).tolist()))
