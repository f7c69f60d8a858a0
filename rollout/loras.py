"""The LoRA adapters of one engine: which name lives in which device slot, loads, unloads, pushes, versions.

    Engine.load_lora(name, path)              a PEFT adapter directory into a free slot (read and validated by the
                                              runner, runner/lora/runtime.py); its version is 0
    Engine.unload_lora(name)                  its slot zeroed and freed; refused while requests of it are unfinished
    Engine.list_loras()                       LoraInfo of each loaded adapter
    Engine.apply_lora_update(name, updates)   Dense / Patch records of its A / B tensors (PEFT names), validated,
                                              written in place into its slot; its version moves by one
    SamplingParams(lora=name)                 a request of it (`Engine._add` calls `use`)

Identity: every load gets a new load id, so an adapter unloaded and loaded again under the same name (or another
one loaded in a freed slot, which `LoraSlots.load` zeroes first) is a different `LoadedLora`. A request keeps the
one it was added with: its prefix-cache extra key is ("lora", name, load id), so blocks computed under one
adapter are shared only with requests of the same load (base requests keep sharing among themselves), and an
unload waits for no one because it is refused while any unfinished request holds the adapter.

Versions: an adapter's version counts its pushes (0 at load). A push is a weight update of the engine: it runs
between steps (the step in flight is finished first), and on success the engine's `policy_version` moves by one
(so no new request reuses prefix-cache blocks computed before it, as after a base update) and the adapter's
version by one. Each adapter keeps the policy version its every version started at (`history`), so a token's
adapter version follows from the policy version it was sampled under (`CompletionOutput.lora_versions`).

Not here: the slots and kernels (runner/lora/, kernels/lora.py), validation of the records (weight_updates/),
the HTTP endpoints (rollout/server.py). One process only: the engine refuses LoRA under tensor parallelism.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.engine import Engine
    from weight_updates import ParamSpec, UpdateResult, WeightReceiver


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraInfo:
    """A loaded adapter, as `Engine.list_loras` reports it."""

    name: str
    """What `SamplingParams.lora` (and the server's `model` field) call it."""
    path: str
    """The adapter directory it was loaded from."""
    slot: int
    """Its device slot (0 .. max_loras - 1)."""
    rank: int
    modules: tuple[str, ...]
    """The checkpoint modules it adapts (q_proj, ...)."""
    version: int
    """0 at load, + 1 per push (`Engine.apply_lora_update`)."""


@dataclass(eq=False, kw_only=True, slots=True)
class LoadedLora:
    """One load of an adapter (mutable: its version moves with pushes)."""

    name: str
    path: str
    slot: int
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
                        version=self.version)


class EngineLoras:
    """The adapters of an engine with `EngineConfig.max_loras` slots (see the module docstring)."""

    def __init__(self, engine: "Engine", max_loras: int) -> None:
        self._engine = engine
        self.max_loras = max_loras
        self.loaded: dict[str, LoadedLora] = {}  # by name, in load order
        self._load_ids = itertools.count()
        self._receivers: dict[int, "WeightReceiver"] = {}  # load id -> the receiver of its pushes

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

    def unload(self, name: str) -> None:
        lora = self.get(name, "lora_name")
        e = self._engine
        e._drain()  # a request that ends in the step in flight no longer holds the adapter
        users = sum(1 for req in e.scheduler.requests.values() if req.lora is lora)
        if users:
            raise ValueError(f"lora_name: adapter {name!r} is used by {users} unfinished request(s); finish or abort "
                             f"them first")
        e.collective_rpc("lora.clear", lora.slot)
        del self.loaded[name]
        self._receivers.pop(lora.load_id, None)

    def specs(self, name: str) -> dict[str, "ParamSpec"]:
        """PEFT tensor name -> (shape, dtype) of every tensor a push to `name` may carry."""
        return dict(self._receiver(self.get(name)).specs)

    def apply(self, name: str, updates, version: int | None) -> "UpdateResult":
        lora = self.get(name)
        e = self._engine
        if e._weights.staged is not None:
            raise ValueError("a LoRA update while a base weight update is staged: publish or drop it first")
        e._drain()  # tokens of the step in flight were sampled with the old adapter
        session = self._receiver(lora).session()
        session.start(lora.version + 1 if version is None else version)
        session.add(updates)
        session.prepare()
        session.commit()
        result = session.publish()
        policy_version = e.policy_version + 1
        lora.version = result.version
        lora.history.append((policy_version, result.version))
        e.scheduler.on_weights_updated(policy_version)
        return result

    def _receiver(self, lora: LoadedLora) -> "WeightReceiver":
        receiver = self._receivers.get(lora.load_id)
        if receiver is None:
            from weight_updates import WeightReceiver

            target = self._engine.runner.lora.target(lora.slot)
            receiver = self._receivers[lora.load_id] = WeightReceiver(target, version=lora.version)
        return receiver
