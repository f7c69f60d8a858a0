"""The LoRA adapters of one engine: which name lives in which device slot, loads, unloads, pushes, versions.

    Engine.load_lora(name, path)              a PEFT adapter directory into a free slot (read and validated by the
                                              runner, runner/lora/runtime.py); its version is 0
    Engine.unload_lora(name)                  its slot zeroed and freed; refused while requests of it are unfinished
    Engine.list_loras()                       LoraInfo of each loaded adapter
    Engine.apply_lora_update(name, updates)   Dense / Patch records of its A / B tensors (PEFT names), validated,
                                              written in place into its slot; its version moves by one
    Engine.prepare / commit / publish / drop_lora_update
                                              the same steps one at a time, for peers that must agree (a pool)
    Engine.export_lora(name)                  its A / B tensors as Dense records (to bring a peer to them)
    SamplingParams(lora=name)                 a request of it (`Engine._add` calls `use`)

Identity: every load gets a new load id, so an adapter unloaded and loaded again under the same name (or another
one loaded in a freed slot, which `LoraSlots.load` zeroes first) is a different `LoadedLora`. A request keeps the
one it was added with: its prefix-cache extra key is ("lora", name, load id), so blocks computed under one
adapter are shared only with requests of the same load (base requests keep sharing among themselves), and an
unload waits for no one because it is refused while any unfinished request holds the adapter.

Versions: an adapter's version counts its pushes (0 at load). A push is a weight update of the engine: it runs
between steps (the step in flight is finished first), and on success the engine's `policy_version` moves by one
(so no new request reuses prefix-cache blocks computed before it, as after a base update) and the adapter's
version by one. Staged one step at a time (`prepare_lora_update`: validate, write nothing; `commit_lora_update`:
write and verify; `publish_lora_update`: the versions move; or `drop_lora_update`, which writes back what a commit
wrote), a push holds the engine as a staged base update does: no base update, no other adapter push, no unload of
the adapter and no sleep until it is published or dropped. Each adapter keeps the policy version its every
version started at (`history`), so a token's adapter version follows from the policy version it was sampled under
(`CompletionOutput.lora_versions`).

Merged mode (`EngineConfig.lora_merged`, max_loras=1): the one loaded adapter is folded into the base weights
(runner/lora/merged.py) instead of a slot, and its requests run the plain model path (their slot is -1). The
names, load ids, prefix-cache keys, versions and pushes are as above (a push recomputes the merged weights of the
modules it wrote); in addition, while an adapter is merged the base weights are not served: a base request
(`SamplingParams.lora=None`) and a base weight update (`EngineWeights._begin`) are refused, and a load is refused
while base requests are unfinished or a base update is staged. An unload writes the base back bitwise, so prefix-
cache blocks of base requests from before the merge (keyed without the adapter) are valid again.

Not here: the slots and kernels (runner/lora/, kernels/lora.py), validation of the records (weight_updates/),
the HTTP endpoints (rollout/server.py). Under tensor parallelism every rank holds its shard of each adapter
(runner/lora/runtime.py): loads, unloads and exports are collective RPCs, and a push is checked here against the
full PEFT shapes, then staged, written and published on every rank, one collective RPC a step (as a base update,
rollout/engine_weights.py), so a push any rank refuses or fails changes no rank. Merged mode is one process only.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.engine import Engine
    from weight_updates import Dense, ParamSpec, StagingReceiver, UpdateResult, UpdateSession, WeightReceiver


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraInfo:
    """A loaded adapter, as `Engine.list_loras` reports it."""

    name: str
    """What `SamplingParams.lora` (and the server's `model` field) call it."""
    path: str
    """The adapter directory it was loaded from."""
    slot: int
    """Its device slot (0 .. max_loras - 1); -1 when merged."""
    rank: int
    modules: tuple[str, ...]
    """The checkpoint modules it adapts (q_proj, ...)."""
    version: int
    """0 at load, + 1 per push (`Engine.apply_lora_update`)."""
    merged: bool = False
    """Folded into the base weights (`EngineConfig.lora_merged`) rather than held in a slot."""


@dataclass(eq=False, kw_only=True, slots=True)
class LoadedLora:
    """One load of an adapter (mutable: its version moves with pushes)."""

    name: str
    path: str
    slot: int  # -1: merged into the base weights
    load_id: int  # distinct for every load of this engine
    rank: int
    modules: tuple[str, ...]
    version: int = 0
    # (first policy version, adapter version) of every version, in order; the first is the load's
    history: list[tuple[int, int]] = field(default_factory=list)

    @property
    def cache_key(self) -> tuple:
        return ("lora", self.name, self.load_id)

    def versions_at(self, policy_versions: list[int]) -> list[int]:
        """The adapter's version under each of these policy versions (of tokens it sampled)."""
        history = self.history
        if len(history) == 1:
            return [history[0][1]] * len(policy_versions)
        starts = [start for start, _ in history]
        return [history[max(0, bisect.bisect_right(starts, v) - 1)][1] for v in policy_versions]

    def info(self) -> LoraInfo:
        return LoraInfo(name=self.name, path=self.path, slot=self.slot, rank=self.rank, modules=self.modules,
                        version=self.version, merged=self.slot < 0)


class EngineLoras:
    """The adapters of an engine with `EngineConfig.max_loras` slots, or with its one adapter merged into the base
    weights (`merged`; see the module docstring). Built before the KV cache is sized: in merged mode the base copy
    it allocates is then counted."""

    def __init__(self, engine: "Engine", max_loras: int, *, merged: bool = False) -> None:
        self._engine = engine
        self.max_loras = max_loras
        self.loaded: dict[str, LoadedLora] = {}  # by name, in load order
        self._load_ids = itertools.count()
        self._receivers: dict[int, "WeightReceiver | StagingReceiver"] = {}  # load id -> the receiver of its pushes
        self.staged: tuple[LoadedLora, "UpdateSession"] | None = None  # a push prepared, until published or dropped
        self.merged = None  # runner.lora.merged.MergedLora in merged mode
        if merged:
            from runner.lora.merged import MergedLora

            assert max_loras == 1, max_loras
            self.merged = MergedLora(engine.runner.weights, engine.model_config,
                                     target_modules=engine.config.lora_target_modules)

    def check_request(self, name: str | None) -> None:
        """ValueError (naming SamplingParams.lora) unless a request of adapter `name` (None: the base) may be
        added now."""
        if name is not None:
            self.get(name, "SamplingParams.lora")
        elif self.merged is not None and self.loaded:
            raise ValueError(f"SamplingParams.lora=None asks for the base model, whose weights are not served while "
                             f"adapter {self._merged_name()!r} is merged into them (EngineConfig.lora_merged): name "
                             f"the adapter, or unload it first")

    def check_base_update(self) -> None:
        """ValueError unless the base weights may be updated now (not while an adapter is merged into them, nor
        while an adapter push is staged)."""
        from weight_updates import WeightUpdateError

        if self.staged is not None:
            raise WeightUpdateError(f"a base weight update while a push of LoRA adapter {self.staged[0].name!r} is "
                                    f"staged ({self.staged[1].state}): publish or drop it first")
        if self.merged is not None and self.loaded:
            raise WeightUpdateError(f"a base weight update while adapter {self._merged_name()!r} is merged into the "
                                    f"base weights (EngineConfig.lora_merged) would mix the two: unload it first "
                                    f"(push the adapter with apply_lora_update)")

    def _merged_name(self) -> str:
        return next(iter(self.loaded))

    def get(self, name: str, field_name: str = "lora") -> LoadedLora:
        """The loaded adapter `name`; a ValueError naming `field_name` when there is none."""
        lora = self.loaded.get(name)
        if lora is None:
            loaded = f"loaded: {sorted(self.loaded)}" if self.loaded else "none is loaded"
            raise ValueError(f"{field_name}: no LoRA adapter named {name!r} is loaded ({loaded})")
        return lora

    def load(self, name: str, path: str) -> LoraInfo:
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if name in self.loaded:
            raise ValueError(f"lora_name: an adapter named {name!r} is loaded already; unload it first")
        if self.merged is not None:
            return self._load_merged(name, str(path))
        used = {lora.slot for lora in self.loaded.values()}
        free = [slot for slot in range(self.max_loras) if slot not in used]
        if not free:
            raise ValueError(f"all EngineConfig.max_loras={self.max_loras} adapter slots are in use "
                             f"({sorted(self.loaded)}): unload one first")
        e = self._engine
        rank, modules = e.collective_rpc("lora.load", free[0], name, str(path))[0]  # finishes the step in flight
        lora = LoadedLora(name=name, path=str(path), slot=free[0], load_id=next(self._load_ids), rank=rank,
                          modules=tuple(modules), history=[(e.policy_version, 0)])
        self.loaded[name] = lora
        return lora.info()

    def _load_merged(self, name: str, path: str) -> LoraInfo:
        e = self._engine
        if self.loaded:
            raise ValueError(f"lora_name: adapter {self._merged_name()!r} is merged (EngineConfig.lora_merged holds "
                             f"one adapter at a time): unload it first")
        e._sleep.check_awake("load_lora (merged into the weights)", "weights")
        if e._weights.staged is not None:
            raise ValueError("load_lora while a base weight update is staged: publish or drop it first (merged "
                             "mode writes the base weights)")
        e._drain()  # a request that ends in the step in flight no longer needs the base weights
        base = sum(1 for req in e.scheduler.requests.values() if req.lora is None)
        if base:
            raise ValueError(f"lora_name: merging {name!r} into the base weights (EngineConfig.lora_merged) while "
                             f"{base} base request(s) (SamplingParams.lora=None) are unfinished: finish or abort "
                             f"them first")
        from runner.lora.adapters import read_adapter

        rank, modules = self.merged.load(read_adapter(path, e.model_config, name=name))
        lora = LoadedLora(name=name, path=path, slot=-1, load_id=next(self._load_ids), rank=rank,
                          modules=tuple(modules), history=[(e.policy_version, 0)])
        self.loaded[name] = lora
        return lora.info()

    def unload(self, name: str) -> None:
        lora = self.get(name, "lora_name")
        if self.staged is not None and self.staged[0] is lora:
            raise ValueError(f"lora_name: a push of adapter {name!r} is staged ({self.staged[1].state}): publish or "
                             f"drop it first")
        e = self._engine
        e._drain()  # a request that ends in the step in flight no longer holds the adapter
        users = sum(1 for req in e.scheduler.requests.values() if req.lora is lora)
        if users:
            raise ValueError(f"lora_name: adapter {name!r} is used by {users} unfinished request(s); finish or abort "
                             f"them first")
        if self.merged is not None:
            e._sleep.check_awake("unload_lora (merged into the weights)", "weights")
            self.merged.clear()
        else:
            e.collective_rpc("lora.clear", lora.slot)
        del self.loaded[name]
        self._receivers.pop(lora.load_id, None)

    def specs(self, name: str) -> dict[str, "ParamSpec"]:
        """PEFT tensor name -> (shape, dtype) of every tensor a push to `name` may carry."""
        return dict(self._target(self.get(name)).checkpoint_specs())

    def export(self, name: str) -> list["Dense"]:
        """Every A / B tensor of adapter `name` as a Dense record (copies, PEFT names)."""
        lora = self.get(name)
        if self.merged is None:
            return self._engine.collective_rpc("lora.export", lora.slot)[0]
        from weight_updates import Dense

        target = self.merged.target()
        return [Dense.of(n, target.read_checkpoint_tensor(n).clone()) for n in target.checkpoint_specs()]

    def apply(self, name: str, updates, version: int | None) -> "UpdateResult":
        self.prepare(name, updates, version)
        self.commit()
        return self.publish()

    def prepare(self, name: str, updates, version: int | None) -> None:
        """Validate a push to adapter `name` and stage it (nothing written); raises, staging nothing, if refused."""
        from weight_updates import WeightUpdateError

        lora = self.get(name)
        if self.staged is not None:
            raise WeightUpdateError(f"a push of LoRA adapter {self.staged[0].name!r} is staged already "
                                    f"({self.staged[1].state}): publish or drop it first")
        e = self._engine
        if e._weights.staged is not None:
            raise WeightUpdateError("a LoRA update while a base weight update is staged: publish or drop it first")
        e._drain()  # tokens of the step in flight were sampled with the old adapter
        if self.merged is not None:
            e._sleep.check_awake("apply_lora_update (merged into the weights)", "weights")
        session = self._receiver(lora).session(dense_rollback=True)  # an adapter's few MB: always undoable
        session.start(lora.version + 1 if version is None else version)
        session.add(updates)
        session.prepare()
        self.staged = (lora, session)

    def commit(self) -> None:
        """Write and verify the staged push (a failure writes the old values back and unstages it)."""
        _, session = self._staged_in("commit_lora_update", "prepared")
        try:
            session.commit()
        except BaseException:
            self.staged = None
            raise
        finally:
            if self.merged is not None:  # what the commit wrote (or wrote back after a failed read-back)
                self.merged.fold_written()

    def publish(self) -> "UpdateResult":
        """Make the committed push current: the adapter's version and the engine's policy version move."""
        lora, session = self._staged_in("publish_lora_update", "committed")
        self.staged = None
        result = session.publish()
        e = self._engine
        policy_version = e.policy_version + 1
        lora.version = result.version
        lora.history.append((policy_version, result.version))
        e.scheduler.on_weights_updated(policy_version)
        return result

    def drop(self) -> str:
        """Unstage the push, writing back what its commit wrote; what was restored, in words."""
        if self.staged is None:
            return "nothing staged"
        (_, session), self.staged = self.staged, None
        restored = session.rollback()
        if self.merged is not None:
            self.merged.fold_written()
        return restored

    def _staged_in(self, call: str, state: str) -> tuple[LoadedLora, "UpdateSession"]:
        if self.staged is None or self.staged[1].state != state:
            from weight_updates import WeightUpdateError

            held = "nothing is staged" if self.staged is None else f"the staged push is {self.staged[1].state}"
            raise WeightUpdateError(f"{call}() needs a staged LoRA push that is {state}; {held}")
        return self.staged

    def _target(self, lora: LoadedLora):
        """Rank 0's weight-update target of `lora` (full PEFT names and shapes; its reads are collectives under
        tensor parallelism, so only its specs are used here then)."""
        return self.merged.target() if self.merged is not None else self._engine.runner.lora.target(lora.slot)

    def _receiver(self, lora: LoadedLora) -> "WeightReceiver | StagingReceiver":
        receiver = self._receivers.get(lora.load_id)
        if receiver is None:
            e = self._engine
            if e.config.tensor_parallel_size > 1:  # checked here, staged on every rank
                from rollout.engine_weights import EveryRank
                from weight_updates import StagingReceiver

                remote = EveryRank(e, "lora", (lora.slot,), lambda: lora.version)
                receiver = StagingReceiver(self._target(lora).checkpoint_specs(), remote, version=lora.version,
                                           device=e.runner.device)
            else:
                from weight_updates import WeightReceiver

                receiver = WeightReceiver(self._target(lora), version=lora.version)
            self._receivers[lora.load_id] = receiver
        return receiver

    def release(self) -> None:
        """Free what the adapters hold outside the runner (merged mode's base copy); the engine closes."""
        if self.merged is not None:
            self.merged.release()
        self._receivers.clear()
