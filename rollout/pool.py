"""RolloutPool: N engine workers as Ray actors behind the Engine interface a trainer uses.

    pool = RolloutPool(load_pool_config("configs/pool_cpu.yaml"))
    pool.generate(prompts, params)       prompts split into N contiguous shards, one actor call each,
                                         outputs back in prompt order (request_id = prompt index)
    pool.apply_weight_update(v, updates) records -> one flat uint8 numpy bucket + a JSON header
                                         (weight_updates.wire) -> ONE ray.put -> two-phase on every worker:
                                         all validate and stage, then all commit or all drop, then publish
    pool.weight_specs(), pool.policy_version, pool.shutdown()

Failures: a worker that dies mid-rollout has its shard re-run on a live worker and is restarted from the
checkpoint, then brought to the pool's weights (a full Dense export from a live worker, applied as a
normal update), so no sample is lost. A weight push that one worker refuses or fails (a worker asleep
at level 2, out of memory, a corrupt copy) leaves every worker on the old weights and version
(`weight_updates.transports.protocol.commit_on_all`); a worker that dies during a push is restarted with
the pool's weights afterwards. A seeded request gives the same tokens on any worker, as on a local
engine, because seeded sampling is batch-invariant. No torch tensor is pickled: weights travel as numpy
bytes plus JSON, samples as plain lists.

Ray is imported inside the functions that need it, so `import rollout` stays free of Ray. This module
does not choose encodings (weight_updates.differ) and does not batch requests across calls.
"""

from __future__ import annotations

import functools
import json
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
    from weight_updates.transports.protocol import SendResult

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
        self.engine_config()  # unknown engine keys and bad values fail here, naming the key
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
        from weight_updates.transports.protocol import answer

        return answer(lambda: self.engine.prepare_weight_update(version, _records(message)))

    def commit_update(self) -> dict:
        from weight_updates.transports.protocol import answer

        return answer(self.engine.commit_weight_update)

    def publish_update(self) -> dict:
        from weight_updates.transports.protocol import answer

        return answer(lambda: self.engine.publish_weight_update().to_json())

    def drop_update(self) -> dict:
        from weight_updates.transports.protocol import answer

        return answer(self.engine.drop_weight_update)

    def export_weights(self) -> dict:
        """Every parameter as Dense records, in the same message format as `apply_update` takes."""
        return _pack(self.engine.export_weights())


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
    sleep / wake_up."""

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
        from ray.exceptions import RayActorError

        from weight_updates import UpdateResult
        from weight_updates.transports.protocol import SendResult, commit_on_all

        if not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version must be an int > the current version {self._version}, got {version!r}")
        started, updates = time.perf_counter(), list(updates)
        ref = ray.put(_pack(updates))
        died: set[int] = set()

        def run(step: str) -> list[dict | None]:
            """`step` on every live worker at once; per worker its answer, None once it died."""
            args = (version, ref) if step == "prepare" else ()
            refs = [None if i in died else getattr(w, f"{step}_update").remote(*args) for i, w in enumerate(self.workers)]
            replies: list[dict | None] = []
            for i, r in enumerate(refs):
                try:
                    replies.append(None if r is None else ray.get(r))
                except RayActorError:
                    died.add(i)
                    replies.append(None)
            return replies

        try:
            published = commit_on_all(version, run)
            self._version = version
        finally:
            if len(died) < len(self.workers):  # restarted after the others published or dropped: they copy the pool's weights
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

    def _restart(self, i: int) -> None:
        """Replace worker i with a fresh actor holding the pool's current weights."""
        import ray

        if self.num_restarts[i] >= self.config.max_restarts:
            raise RuntimeError(f"pool worker {i} died {self.num_restarts[i] + 1} times; giving up")
        self.num_restarts[i] += 1
        ray.kill(self.workers[i])
        worker = self._spawn()
        if self._version > 0:
            donor = self.workers[(i + 1) % len(self.workers)]
            ray.get(worker.apply_update.remote(self._version, donor.export_weights.remote()))
        else:
            ray.get(worker.ready.remote())
        self.workers[i] = worker
