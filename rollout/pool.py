"""RolloutPool: N engine workers as Ray actors behind the Engine interface a trainer uses.

    pool = RolloutPool(load_pool_config("configs/pool_cpu.yaml"))
    pool.generate(prompts, params)       prompts split into N contiguous shards, one actor call each,
                                         outputs back in prompt order (request_id = prompt index)
    pool.apply_weight_update(v, updates) records -> one flat uint8 numpy bucket + a JSON header
                                         (weight_updates.wire) -> ONE ray.put -> two-phase on every worker:
                                         all validate and stage, then all commit or all drop, then publish
    pool.weight_specs(), pool.policy_version, pool.shutdown()

LoRA adapters (`engine.max_loras > 0`; rollout/loras.py is one engine's side):

    pool.load_lora(name, path)           every worker loads the PEFT directory (which each must be able to read);
                                         if any refuses, or reads another rank or modules, the loads that
                                         succeeded are undone: every worker serves the same adapters
    pool.unload_lora(name), pool.list_loras()
    pool.submit / generate(..., SamplingParams(lora=name))
                                         outputs carry the adapter and its version per token, as an engine's
    pool.apply_lora_update(name, updates), pool.lora_specs(name)
                                         an adapter push (what `TrainerBridge(pool, lora=name).push_weights(peft_
                                         model)` sends) in the same two phases as a base push: a record any worker
                                         refuses (a wrong rank, an unknown module) changes no worker; on success
                                         the adapter's version and `policy_version` move by one on every worker

Failures: a worker that dies mid-rollout has its shard re-run on a live worker and is restarted from the
checkpoint, then brought to the pool's weights (a full Dense export from a live worker, applied as a
normal update), so no sample is lost. A weight push that one worker refuses or fails (a worker asleep
at level 2, out of memory, a corrupt copy) leaves every worker on the old weights and version
(`weight_updates.transports.protocol.commit_on_all`); a worker that dies during a push is restarted with
the pool's weights afterwards. A restarted worker gets the pool's adapters back before it serves a request:
each loaded again from its path, in the pool's load order, and brought to its pushed tensors by a full Dense
export of that adapter from a live worker, applied as a push at the adapter's version (see `RolloutPool._restart`).
The pool keeps no copy of any tensor; merged mode (`engine.lora_merged`) is refused, because a live worker's
weights then hold its adapter. A seeded request gives the same tokens on any worker, as on a local
engine, because seeded sampling is batch-invariant. No torch tensor is pickled: weights travel as numpy
bytes plus JSON, samples as plain lists.

Ray is imported inside the functions that need it, so `import rollout` stays free of Ray. This module
does not choose encodings (weight_updates.differ), does not batch requests across calls, and does not read
adapter files itself (each worker does).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rollout.config import EngineConfig, from_mapping, load_yaml
from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rollout.loras import LoraInfo
    from weight_updates.transports.protocol import SendResult

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class WorkerResources:
    """Ray resources of one worker actor."""

    num_cpus: float = 1.0
    """CPUs reserved per worker; also the worker's torch thread count (at least 1)."""
    num_gpus: float = 0.0
    """GPUs per worker (set engine.device to cuda with num_gpus >= 1)."""

    def __post_init__(self) -> None:
        if self.num_cpus <= 0:
            raise ValueError(f"resources.num_cpus must be > 0, got {self.num_cpus}")
        if self.num_gpus < 0:
            raise ValueError(f"resources.num_gpus must be >= 0, got {self.num_gpus}")


@dataclass(kw_only=True, slots=True)
class PoolConfig:
    """A pool of engine workers (the schema of configs/pool_*.yaml)."""

    model: str
    """Hugging Face model directory every worker loads (a training config may override it)."""
    num_workers: int = 2
    resources: WorkerResources = field(default_factory=WorkerResources)
    engine: dict[str, Any] = field(default_factory=dict)
    """EngineConfig fields other than `model`, the same for every worker."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """SamplingParams defaults for `generate` calls that pass none."""
    ray_num_cpus: int | None = None
    """CPUs for `ray.init` when this pool starts Ray (None: Ray's default). Ignored if Ray is running."""
    max_restarts: int = 3
    """Restarts per worker before a failure is raised instead of retried."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {self.num_workers!r}")
        if "model" in self.engine:
            raise ValueError("engine.model: set the top-level `model` key instead")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if isinstance(self.resources, dict):
            self.resources = from_mapping(WorkerResources, self.resources, "resources")
        if self.engine_config().lora_merged:  # unknown engine keys and bad values fail here, naming the key
            raise ValueError("engine.lora_merged is not offered by RolloutPool (a restarted worker copies a live "
                             "worker's weights, which then hold the merged adapter): use adapter slots (max_loras)")
        self.default_sampling()

    def engine_config(self) -> EngineConfig:
        return from_mapping(EngineConfig, {"model": self.model, **self.engine}, "engine")

    def default_sampling(self) -> SamplingParams:
        return from_mapping(SamplingParams, self.sampling, "sampling")


def load_pool_config(path: str | Path, *, model: str | None = None) -> PoolConfig:
    """PoolConfig from YAML; `model` replaces the file's model (e.g. a model the training run just built)."""
    data = load_yaml(path)
    if model is not None:
        data = {**data, "model": model}
    return from_mapping(PoolConfig, data, str(path))


class _EngineWorker:
    """The body of one Ray actor: an Engine plus byte-level weight updates."""

    def __init__(self, engine_config: dict, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)
        from rollout.engine import Engine

        self.engine = Engine(from_mapping(EngineConfig, engine_config, "engine"))

    def ready(self) -> int:
        return os.getpid()

    def weight_specs(self) -> dict[str, tuple[list[int], str]]:
        return {n: (list(s.shape), str(s.dtype).removeprefix("torch.")) for n, s in self.engine.weight_specs().items()}

    def routed_experts_shape(self) -> tuple[int, int] | None:
        return self.engine.routed_experts_shape

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        return self.engine.generate(prompts, params)

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.engine.wake_up(tags)

    def apply_update(self, version: int, message: dict) -> dict:
        """message = {"header": JSON str, "data": uint8 numpy array}; returns the UpdateResult as JSON. For a
        restarted worker catching up; pushes go through the two phases below."""
        return self.engine.apply_weight_update(version, _records(message)).to_json()

    # The two phases of a push (weight_updates.transports.protocol.commit_on_all); each returns an `answer`.
    def prepare_update(self, version: int, message: dict) -> dict:
        return _answer(lambda: self.engine.prepare_weight_update(version, _records(message)))

    def commit_update(self) -> dict:
        return _answer(self.engine.commit_weight_update)

    def publish_update(self) -> dict:
        return _answer(lambda: self.engine.publish_weight_update().to_json())

    def drop_update(self) -> dict:
        return _answer(self.engine.drop_weight_update)

    def export_weights(self) -> dict:
        """Every parameter as Dense records, in the same message format as `apply_update` takes."""
        return _pack(self.engine.export_weights())

    def policy_version(self) -> int:
        return self.engine.policy_version

    # LoRA adapters. Loads, unloads and the phases of a push return an `answer`, so the pool hears every worker.
    def list_loras(self) -> list:
        return self.engine.list_loras()

    def load_lora(self, name: str, path: str) -> dict:
        return _answer(self.engine.load_lora, name, path)

    def unload_lora(self, name: str) -> dict:
        return _answer(self.engine.unload_lora, name)

    def lora_specs(self, name: str) -> dict[str, tuple[list[int], str]]:
        specs = self.engine.lora_specs(name)
        return {n: (list(s.shape), str(s.dtype).removeprefix("torch.")) for n, s in specs.items()}

    def apply_lora_update(self, name: str, version: int, message: dict) -> dict:
        """For a restarted worker catching up (pushes go through the phases below); the UpdateResult as JSON."""
        return self.engine.apply_lora_update(name, _records(message), version).to_json()

    def prepare_lora_update(self, name: str, version: int, message: dict) -> dict:
        return _answer(lambda: self.engine.prepare_lora_update(name, _records(message), version))

    def commit_lora_update(self) -> dict:
        return _answer(self.engine.commit_lora_update)

    def publish_lora_update(self) -> dict:
        return _answer(lambda: self.engine.publish_lora_update().to_json())

    def drop_lora_update(self) -> dict:
        return _answer(self.engine.drop_lora_update)

    def export_lora(self, name: str) -> dict:
        """Adapter `name`'s A / B tensors as Dense records, in the message format `apply_lora_update` takes."""
        return _pack(self.engine.export_lora(name))


def _answer(call, *args) -> dict:
    """A worker's reply to a step the pool drives on every worker: `weight_updates.transports.protocol.answer`, the
    result or the error as text, so the pool hears every worker."""
    from weight_updates.transports.protocol import answer

    return answer(call, *args)


def _records(message: dict) -> list:
    """The records of a message made by `_pack`: views into its (read-only) array."""
    import torch

    from weight_updates.wire import read_bucket

    with warnings.catch_warnings():  # the object store's array is read-only; an update only reads it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(message["data"])
    return read_bucket(json.loads(message["header"]), data)


def _pack(updates) -> dict:
    """Records -> {"header": JSON str, "data": uint8 numpy array} (no pickled tensors)."""
    import torch

    from weight_updates.wire import plan_bucket, write_bucket

    plan = plan_bucket(updates)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    write_bucket(plan, buf)
    return {"header": json.dumps(plan.header), "data": buf.numpy()}


@dataclass(kw_only=True, slots=True)
class _Shard:
    start: int  # index of the shard's first prompt in the call
    prompts: list
    params: list[SamplingParams]
    worker: int = -1
    ref: Any = None  # the in-flight ObjectRef


@dataclass(kw_only=True, slots=True)
class PendingRollout:
    """Shards in flight (from `submit`); `collect` turns them into outputs."""

    num_prompts: int
    shards: list[_Shard]


class RolloutPool:
    """Engine workers as Ray actors; offers generate / weight_specs / apply_weight_update / policy_version /
    sleep / wake_up, and the LoRA calls load_lora / unload_lora / list_loras / lora_specs / apply_lora_update."""

    def __init__(self, config: PoolConfig) -> None:
        import ray

        self.config = config
        self._started_ray = False
        if not ray.is_initialized():
            ray.init(num_cpus=config.ray_num_cpus, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        repo_root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
        self._actor_cls = ray.remote(_EngineWorker).options(
            num_cpus=config.resources.num_cpus, num_gpus=config.resources.num_gpus,
            runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}},
        )
        self._engine_dict = {"model": config.model, **config.engine}
        self.workers = [self._spawn() for _ in range(config.num_workers)]
        ray.get([w.ready.remote() for w in self.workers])
        self._version = 0
        self._base_updated = False  # whether a base push happened (a restarted worker then copies the weights)
        self._loras: dict[str, "LoraInfo"] = {}  # what every worker serves, in load order; versions as pushed
        self.num_restarts = [0] * config.num_workers
        self._specs = None

    def _spawn(self):
        return self._actor_cls.remote(self._engine_dict, max(1, int(self.config.resources.num_cpus)))

    # ---- the Engine interface ---------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @functools.cached_property
    def routed_experts_shape(self) -> tuple[int, int] | None:
        """(num_moe_layers, top_k) of the workers' MoE model (routing replay), None for a dense model (asked once)."""
        import ray

        shape = ray.get(self.workers[0].routed_experts_shape.remote())
        return None if shape is None else tuple(shape)

    def weight_specs(self) -> dict:
        import ray
        import torch

        from weight_updates import ParamSpec

        if self._specs is None:
            raw = ray.get(self.workers[0].weight_specs.remote())
            self._specs = {n: ParamSpec(tuple(shape), getattr(torch, dtype)) for n, (shape, dtype) in raw.items()}
        return self._specs

    def generate(
        self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
        min_finished_prompts: int | None = None,
    ) -> list[RequestOutput]:
        """Like Engine.generate. Early stopping (`min_finished_prompts`) is not offered across workers."""
        if min_finished_prompts is not None:
            raise ValueError("min_finished_prompts is not supported by RolloutPool; use a local Engine")
        return self.collect(self.submit(prompts, params))

    def submit(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None) -> PendingRollout:
        """Start a rollout without waiting (see `collect`)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if any(isinstance(p, dict) and "prompt_embeds" in p for p in prompts):  # Ray would pickle the tensors
            raise ValueError("prompt_embeds: not through a RolloutPool (tensors do not travel to its workers); "
                             "use a local Engine")
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.config.default_sampling()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for p in params:  # refused here, before any shard is sent
            if p.lora is not None:
                self._lora(p.lora, "SamplingParams.lora")
        size = -(-len(prompts) // len(self.workers)) if prompts else 1
        shards = [
            _Shard(start=s, prompts=prompts[s : s + size], params=params[s : s + size])
            for s in range(0, len(prompts), size)
        ]
        for i, shard in enumerate(shards):
            self._dispatch(shard, i % len(self.workers))
        return PendingRollout(num_prompts=len(prompts), shards=shards)

    def collect(self, pending: PendingRollout) -> list[RequestOutput]:
        """Wait for every shard; a shard whose worker died is re-run elsewhere and the worker restarted."""
        import ray
        from ray.exceptions import RayActorError

        results: list[RequestOutput | None] = [None] * pending.num_prompts
        waiting = {shard.ref: shard for shard in pending.shards}
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1)
            shard = waiting.pop(done[0])
            try:
                outs = ray.get(done[0])
            except RayActorError:
                dead = shard.worker
                self._restart(dead)
                self._dispatch(shard, (dead + 1) % len(self.workers))
                waiting[shard.ref] = shard
                continue
            for k, out in enumerate(outs):
                out.request_id = str(shard.start + k)
                results[shard.start + k] = out
        assert all(r is not None for r in results)
        return results

    def apply_weight_update(self, version: int, updates) -> "SendResult":
        """Send one update to every worker as one Ray object, in two phases: every worker validates and stages
        it (`Engine.prepare_weight_update`), then all commit it (write, verify) or all drop it, then all publish.
        Returns a `SendResult` with every worker's UpdateResult.

        Raises a WeightUpdateError (a ValueError) naming the workers that refused or failed it; every worker
        then holds the weights and version it had, and so does the pool. A worker that dies during the push
        takes no part in it and is restarted afterwards with the pool's weights.
        """
        import ray

        from weight_updates import UpdateResult
        from weight_updates.transports.protocol import SendResult, commit_on_all

        if not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version must be an int > the current version {self._version}, got {version!r}")
        started, updates = time.perf_counter(), list(updates)
        ref = ray.put(_pack(updates))
        died: set[int] = set()

        def run(step: str) -> list[dict | None]:
            return self._ask(f"{step}_update", *((version, ref) if step == "prepare" else ()), died=died)

        try:
            published = commit_on_all(version, run)
            self._version = version
            self._base_updated = True
        finally:
            if len(died) < len(self.workers):  # restarted after the others published or dropped: they copy the pool's weights
                for i in sorted(died):
                    self._restart(i)
        received = [UpdateResult.from_json(r["result"]) for r in published if r is not None]
        return SendResult.of(version, updates, started, num_receivers=len(received), received=received)

    # ---- LoRA adapters -------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> "LoraInfo":
        """`Engine.load_lora(name, path)` on every worker, all or none. Every worker reads `path` itself (a directory
        each can read: shared storage across nodes), and must keep being able to: a restarted worker reads it again.
        A relative `path` is made absolute here. If any worker refuses (a ValueError naming the field: a full
        `max_loras`, a rank above `max_lora_rank`, a missing file) or reads another rank or modules than the others,
        the loads that succeeded are unloaded again and a ValueError names each refusing worker; no worker then
        serves `name`. Returns worker 0's LoraInfo (its `slot` is that worker's). A worker that dies meanwhile is
        restarted with the pool's adapters."""
        self._check_loras_on("load_lora")
        if name in self._loras:
            raise ValueError(f"lora_name: an adapter named {name!r} is loaded already; unload it first")
        path = os.path.abspath(path)  # the workers' working directory need not be this process's
        died: set[int] = set()
        replies = self._ask("load_lora", name, path, died=died)
        if len(died) == len(self.workers):
            raise RuntimeError(f"every pool worker is gone (at load_lora of {name!r})")
        loaded = {i: r["result"] for i, r in enumerate(replies) if r is not None and r["ok"]}
        errors = [None if r is None or r["ok"] else str(r["error"]) for r in replies]
        if loaded and not any(errors):  # one adapter everywhere: the same files behind `path` on every worker
            first, info = next(iter(loaded.items()))
            errors = [None if got is None or (got.rank, got.modules) == (info.rank, info.modules) else
                      f"read rank {got.rank} on {list(got.modules)} from {path} where worker {first} read rank "
                      f"{info.rank} on {list(info.modules)}: the path must hold one adapter for every worker"
                      for got in map(loaded.get, range(len(self.workers)))]
        restart = set(died)
        try:
            if any(errors):
                undo = self._ask("unload_lora", name, skip=set(range(len(self.workers))) - loaded.keys(), died=died)
                restart |= died | {i for i, r in enumerate(undo) if r is not None and not r["ok"]}  # to the pool's set
                raise ValueError(f"load_lora({name!r}, {path!r}) refused, loaded on no worker: "
                                 + "; ".join(f"worker {i}: {e}" for i, e in enumerate(errors) if e))
            self._loras[name] = info
        finally:
            for i in sorted(restart):
                self._restart(i)
        return info

    def unload_lora(self, name: str) -> None:
        """`Engine.unload_lora(name)` on every worker. Refused (ValueError, nothing changed) when the pool has no such
        adapter or every worker refuses; a worker that refuses while others unloaded (unfinished requests left by a
        failed generate) is restarted, which brings it to the pool's adapters without `name`. Collect every rollout
        that uses the adapter first: a shard re-run after a worker died would no longer find it."""
        self._lora(name, "lora_name")
        died: set[int] = set()
        replies = self._ask("unload_lora", name, died=died)
        if len(died) == len(self.workers):
            raise RuntimeError(f"every pool worker is gone (at unload_lora of {name!r})")
        refused = {i: str(r["error"]) for i, r in enumerate(replies) if r is not None and not r["ok"]}
        restart = set(died)
        try:
            if len(refused) == len(self.workers) - len(died) and refused:
                raise ValueError(f"unload_lora({name!r}) refused by every worker, unloaded nowhere: "
                                 + "; ".join(f"worker {i}: {e}" for i, e in refused.items()))
            del self._loras[name]
            restart |= refused.keys()
            for i, e in refused.items():
                logger.warning("pool worker %d refused unload_lora(%r) (%s): restarting it without the adapter", i,
                               name, e)
        finally:
            for i in sorted(restart):
                self._restart(i)

    def list_loras(self) -> list["LoraInfo"]:
        """The adapters every worker serves, in load order, with their versions (`slot`: worker 0's at the load)."""
        return list(self._loras.values())

    def lora_specs(self, name: str) -> dict:
        """PEFT tensor name -> ParamSpec of every tensor a push to adapter `name` may carry (`Engine.lora_specs`)."""
        import ray
        import torch

        from weight_updates import ParamSpec

        self._lora(name, "lora")
        raw = ray.get(self.workers[0].lora_specs.remote(name))
        return {n: ParamSpec(tuple(shape), getattr(torch, dtype)) for n, (shape, dtype) in raw.items()}

    def apply_lora_update(self, name: str, updates, version: int | None = None) -> "SendResult":
        """Push Dense / Patch records of adapter `name`'s A / B tensors (PEFT names, `lora_specs`) to every worker as
        one Ray object, in the two phases of `apply_weight_update`: every worker validates and stages it
        (`Engine.prepare_lora_update`), then all commit it or all drop it, then all publish. `version`, the adapter's
        new version, defaults to its current one + 1; on success every worker's adapter holds it and every worker's
        `policy_version` (and the pool's) moves by one. Returns a `SendResult` whose `version` is the adapter's.

        Raises a WeightUpdateError (a ValueError) naming the adapter and each worker that refused or failed it (a
        wrong rank or shape, an unknown module); every worker then holds the adapter's tensors and versions it had.
        A worker that dies during the push is restarted afterwards with the pool's adapters."""
        import dataclasses

        import ray

        from weight_updates import UpdateResult, WeightUpdateError
        from weight_updates.transports.protocol import SendResult, commit_on_all

        info = self._lora(name, "lora")
        version = info.version + 1 if version is None else version
        if not isinstance(version, int) or isinstance(version, bool) or version <= info.version:
            raise ValueError(f"version must be an int > LoRA adapter {name!r}'s current version {info.version}, got "
                             f"{version!r}")
        started, updates = time.perf_counter(), list(updates)
        ref = ray.put(_pack(updates))
        died: set[int] = set()

        def run(step: str) -> list[dict | None]:
            return self._ask(f"{step}_lora_update", *((name, version, ref) if step == "prepare" else ()), died=died)

        try:
            try:
                published = commit_on_all(version, run)
            except WeightUpdateError as e:
                raise WeightUpdateError(f"LoRA adapter {name!r}: {e}") from None
            self._loras[name] = dataclasses.replace(info, version=version)
            self._version += 1
        finally:
            if len(died) < len(self.workers):
                for i in sorted(died):
                    self._restart(i)
        received = [UpdateResult.from_json(r["result"]) for r in published if r is not None]
        return SendResult.of(version, updates, started, num_receivers=len(received), received=received)

    def sleep(self, level: int = 1) -> None:
        """`Engine.sleep(level)` on every worker: free their KV caches (and at level 2 their weights)."""
        import ray

        ray.get([w.sleep.remote(level) for w in self.workers])

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """`Engine.wake_up(tags)` on every worker."""
        import ray

        ray.get([w.wake_up.remote(None if tags is None else list(tags)) for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._started_ray:
            ray.shutdown()

    # ---- helpers ------------------------------------------------------------------------------------
    def _dispatch(self, shard: _Shard, worker: int) -> None:
        shard.worker = worker
        shard.ref = self.workers[worker].generate.remote(shard.prompts, shard.params)

    def _ask(self, method: str, *args, died: set[int], skip: set[int] = frozenset()) -> list[dict | None]:
        """`method(*args)` on every worker not in `died` or `skip`, all at once; per worker its reply, None for one
        not asked or gone (a worker that dies now is added to `died`)."""
        import ray
        from ray.exceptions import RayActorError

        refs = [None if i in died or i in skip else getattr(w, method).remote(*args)
                for i, w in enumerate(self.workers)]
        replies: list[dict | None] = []
        for i, r in enumerate(refs):
            try:
                replies.append(None if r is None else ray.get(r))
            except RayActorError:
                died.add(i)
                replies.append(None)
        return replies

    def _check_loras_on(self, field_name: str) -> None:
        if not self.config.engine_config().max_loras:
            raise ValueError(f"{field_name}: this pool's workers serve no LoRA adapters (engine.max_loras is 0)")

    def _lora(self, name: str, field_name: str) -> "LoraInfo":
        """The pool's adapter `name`; a ValueError naming `field_name` when there is none."""
        info = self._loras.get(name)
        if info is None:
            self._check_loras_on(field_name)
            loaded = f"loaded: {list(self._loras)}" if self._loras else "none is loaded"
            raise ValueError(f"{field_name}: no LoRA adapter named {name!r} is loaded in the pool ({loaded})")
        return info

    def _restart(self, i: int) -> None:
        """Replace worker i with a fresh actor holding the pool's current weights and adapters.

        A live worker (the next one) is the donor. The base: its full Dense export, once a base push happened.
        The adapters: each loaded again from its path, in the pool's load order; one pushed since its load then
        gets the donor's export of its A / B tensors as a push at its version (so its tensors and version are the
        donor's, whatever the files on disk hold now), and one never pushed is compared with the donor's bit for
        bit (files changed on disk since the load: RuntimeError). Re-reading the path and copying a live worker
        keeps the pool free of tensor copies, as for the base weights. Versions: each adapter push moves the policy
        version by one, so the base goes first at the pool's version less the pushes restored after it (with no
        records when the base was never pushed), and the worker ends at the pool's version."""
        import numpy as np
        import ray

        if self.num_restarts[i] >= self.config.max_restarts:
            raise RuntimeError(f"pool worker {i} died {self.num_restarts[i] + 1} times; giving up")
        self.num_restarts[i] += 1
        ray.kill(self.workers[i])
        worker = self._spawn()
        donor = self.workers[(i + 1) % len(self.workers)]
        base_version = self._version - sum(info.version > 0 for info in self._loras.values())
        if base_version > 0:  # > 0 whenever a base push happened (each push raised the version past the ones before)
            weights = donor.export_weights.remote() if self._base_updated else _pack([])
            ray.get(worker.apply_update.remote(base_version, weights))
        else:
            ray.get(worker.ready.remote())
        for info in self._loras.values():
            reply = ray.get(worker.load_lora.remote(info.name, info.path))
            if not reply["ok"]:
                raise RuntimeError(f"pool worker {i} was restarted but cannot load LoRA adapter {info.name!r} again "
                                   f"from {info.path}: {reply['error']}")
            if info.version > 0:
                ray.get(worker.apply_lora_update.remote(info.name, info.version, donor.export_lora.remote(info.name)))
                continue
            mine, theirs = ray.get([worker.export_lora.remote(info.name), donor.export_lora.remote(info.name)])
            if mine["header"] != theirs["header"] or not np.array_equal(mine["data"], theirs["data"]):
                raise RuntimeError(f"pool worker {i} was restarted, but LoRA adapter {info.name!r} read again from "
                                   f"{info.path} differs from what the other workers hold (its files changed since "
                                   f"the load): unload it and load it again")
        assert ray.get(worker.policy_version.remote()) == self._version, (i, self._version)
        self.workers[i] = worker
