"""The weight side of one engine: what transports receive into, staged updates, reloads, rank-local pushes.

    Engine.weight_sink()                  the sink every transport's receiver writes into (rollout/weight_sink.py)
    Engine.apply_weight_update(v, recs)   one session of the sink: prepare, commit, publish
    Engine.prepare / commit / publish / drop_weight_update
                                          the same steps one at a time, for peers that must agree (a pool)
    Engine.load_weights(path)             a checkpoint directory as one dense update
    Engine.update_weights_rank_local(v, handles)
                                          every rank maps its own bucket (weight_updates/transports/rank_local.py)

Every path starts by finishing the step in flight and checking that the weights are on the device, and
moves `policy_version` once, at publish. In one process the sink's receiver is the runner's own
(`runner.weight_sync`); under tensor parallelism it is a `StagingReceiver` that checks the records on
rank 0 and drives one staged session per rank through `collective_rpc` (`EveryRank`), so an update any
rank refuses or fails is dropped, and restored, on every rank. Not here: validation and writing
(weight_updates/, runner/weight_sync.py), the wire (weight_updates/transports/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from rollout.engine import Engine
    from rollout.weight_sink import EngineSink, EngineSession
    from weight_updates import Dense, UpdateResult


class EveryRank:
    """`weight_updates.RemoteSessions` over every rank of a tensor-parallel engine: one collective RPC per
    step on the runner's `endpoint` (`runner.weight_sync` for the base weights; `runner.lora`, with the
    adapter's slot as `key`, for an adapter, rollout/loras.py), whose `prepare(*key, version, records,
    current_version, dense_rollback)` stages the records at the version `current_version()` gives; each rank
    holds its own staged session."""

    def __init__(self, engine: "Engine", endpoint: str = "weight_sync", key: tuple = (),
                 current_version: "Callable[[], int] | None" = None) -> None:
        self._engine, self._endpoint, self._key = engine, endpoint, key
        self._current = current_version or (lambda: engine.policy_version)

    def prepare(self, version: int, records: list, dense_rollback: bool | None) -> None:
        self._engine.collective_rpc(f"{self._endpoint}.prepare", *self._key, version, records, self._current(),
                                    bool(dense_rollback))

    def commit(self) -> None:
        self._engine.collective_rpc(f"{self._endpoint}.commit")

    def publish(self) -> "UpdateResult":
        return self._engine.collective_rpc(f"{self._endpoint}.publish")[0]

    def rollback(self) -> str:
        outcomes = self._engine.collective_rpc(f"{self._endpoint}.rollback")
        if len(set(outcomes)) == 1:
            return outcomes[0]
        return "; ".join(f"rank {rank}: {what}" for rank, what in enumerate(outcomes))


class EngineWeights:
    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self._sink: "EngineSink | None" = None  # made on first use
        self.staged: "EngineSession | None" = None  # the session of `prepare`, until published or dropped

    def sink(self) -> "EngineSink":
        if self._sink is None:
            from rollout.weight_sink import EngineSink

            e = self._engine
            if e.config.tensor_parallel_size > 1:
                from weight_updates import StagingReceiver

                receiver = StagingReceiver(self.specs(), EveryRank(e), version=e.policy_version, device=e.runner.device)
            else:
                receiver = e.runner.weight_sync.receiver("full", e.policy_version)
            self._sink = EngineSink(receiver, begin=self._begin, publish=e.scheduler.on_weights_updated,
                                    device=e.runner.device)
        return self._sink

    def specs(self) -> dict:
        return self._engine.runner.weights.checkpoint_specs()

    def export(self) -> list["Dense"]:
        self._engine._sleep.check_awake("export_weights", "weights")
        return self._engine.collective_rpc("weight_sync.export")[0]

    def apply(self, version: int, updates) -> "UpdateResult":
        session = self._stage(version, updates, dense_rollback=False)
        session.commit()
        return session.publish()

    def prepare(self, version: int, updates) -> None:
        if self.staged is not None:
            from weight_updates import WeightUpdateError

            raise WeightUpdateError(f"an update is staged already ({self.staged.state}): publish or drop it first")
        self.staged = self._stage(version, updates, dense_rollback=True)

    def commit(self) -> None:
        session = self._staged_in("commit_weight_update", "prepared")
        try:
            session.commit()
        except BaseException:
            self.staged = None
            raise

    def publish(self) -> "UpdateResult":
        session = self._staged_in("publish_weight_update", "committed")
        self.staged = None
        return session.publish()

    def drop(self) -> str:
        session, self.staged = self.staged, None
        return "nothing staged" if session is None else session.rollback()

    def load(self, path: str, version: int | None) -> "UpdateResult":
        from runner.loader import checkpoint_tensors
        from weight_updates import Dense

        e = self._engine
        specs = self.specs()
        records = []
        for file, name, lazy in checkpoint_tensors(path, e.model_config.tie_word_embeddings):
            spec = specs.get(name)
            if spec is None:
                raise ValueError(f"{file}: tensor {name!r} is not a weight of this engine's model")
            tensor = lazy[:]
            if not tensor.is_floating_point():
                raise ValueError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, not a float dtype")
            records.append(Dense.of(name, tensor.to(spec.dtype) if tensor.dtype != spec.dtype else tensor))
        if not records:
            raise ValueError(f"{path}: no weights of this engine's model")
        return self.apply(e.policy_version + 1 if version is None else version, records)

    def rank_local_layouts(self) -> list[dict]:
        e = self._engine
        if e.config.tensor_parallel_size > 1:
            return list(e.runner.weights.rank_layouts)
        return [dict(e.runner.weights.layout)]

    def rank_local_checksums(self) -> list[dict[str, int]]:
        self._engine._sleep.check_awake("rank_local_checksums", "weights")
        return self._engine.collective_rpc("weight_sync.rank_local_checksums")

    def update_rank_local(self, version: int, handles: Sequence[dict]) -> "UpdateResult":
        e = self._engine
        if len(handles) != e.config.tensor_parallel_size:
            raise ValueError(f"{len(handles)} handles for tensor_parallel_size={e.config.tensor_parallel_size}")
        if e.config.tensor_parallel_size == 1:
            from weight_updates.transports.rank_local import serve_rank_local

            return serve_rank_local(self.sink(), version, handles[0], exchange=lambda value: [value])
        current = self._begin()
        result = e.collective_rpc("weight_sync.apply_rank_local", version, list(handles), current)[0]
        e.scheduler.on_weights_updated(result.version)
        return result

    # ---- helpers ------------------------------------------------------------------------------------------
    def _stage(self, version: int, updates, *, dense_rollback: bool) -> "EngineSession":
        """A session of the sink that validated `updates` (start, add, prepare); it raises having staged nothing."""
        session = self.sink().session(dense_rollback=dense_rollback)
        session.start(version)
        session.add(updates)
        session.prepare()
        return session

    def _staged_in(self, call: str, state: str) -> "EngineSession":
        if self.staged is None or self.staged.state != state:
            from weight_updates import WeightUpdateError

            held = "nothing is staged" if self.staged is None else f"the staged update is {self.staged.state}"
            raise WeightUpdateError(f"{call}() needs a staged update that is {state}; {held}")
        return self.staged

    def _begin(self) -> int:
        """Ready the engine for a write: finish the step in flight (its tokens belong to the old weights) and
        check that the weights are on the device. Returns the current policy version."""
        from weight_updates import WeightUpdateError

        e = self._engine
        e._drain()
        try:
            e._sleep.check_awake("weight update", "weights")
        except ValueError as err:
            raise WeightUpdateError(str(err)) from None
        if e._loras is not None:
            e._loras.check_base_update()  # not while a LoRA adapter is merged into the base weights
        return e.policy_version
