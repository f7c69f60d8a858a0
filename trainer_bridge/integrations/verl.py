"""verl rollout plugin: this engine as verl's `actor_rollout_ref.rollout.name=rollout_engine`.

verl (0.9.x) loads third-party rollout engines as plugins. Importing this module registers two classes:

    RolloutReplicaRegistry "rollout_engine" -> EngineReplica        the driver side: launches the server actors
    get_rollout_class("rollout_engine")     -> EngineServerAdapter  the trainer side: resume / release /
                                                                    update_weights from each trainer rank

verl imports it by itself through the `verl.plugins` entry point this distribution declares (pyproject.toml),
unless `VERL_USE_EXTERNAL_PLUGINS=none`. Each replica is one Ray actor, `EngineServer`, holding an `AsyncEngine`
(tensor parallelism inside the actor, `tensor_model_parallel_size` ranks), named
`rollout_engine_server_{replica_rank}_0` as verl's server adapters look servers up. It answers what verl's agent
loop (`LLMServerClient.generate`), its replica and its checkpoint manager call: `generate(prompt_ids,
sampling_params, request_id, ...) -> TokenOutput`, `wake_up`, `sleep`, `abort_all_requests`, `resume_generation`,
`clear_kv_cache`, `release_kv_cache`, `resume_kv_cache`, `set_global_steps`, `wait_for_requests_to_drain`.

Weights: `EngineServerAdapter.update_weights(weights)` takes verl's generator of (Hugging Face name, tensor),
encodes it against the previous push with a `WeightDiffer` (Dense the first time, sparse patches after), and sends
the records to the server actor as one flat uint8 bucket with a JSON header (`weight_updates.wire`; no pickled
tensor), where one validate-then-apply session of the engine's weight sink applies them: a refused push leaves the
engine's weights and `policy_version` as they were, and the differ's snapshot too. Engine settings come from the
rollout config (dtype, max_model_len, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, prefix
caching, enforce_eager, seed, tensor_model_parallel_size) and any `EngineConfig` field from
`rollout.engine_kwargs.rollout_engine`.

Routing replay (R3, verl's `rollout.enable_rollout_routing_replay`): every request asks for its routed experts and
`TokenOutput.routed_experts` carries them as vLLM's server does, an int32 numpy array [prompt + response - 1,
num_moe_layers, top_k] (each input position's experts; verl's agent loops slice it to the sequence); refused at
start-up for a dense model.

Not here: multimodal inputs, LoRA adapters, `repetition_penalty != 1`, prompt logprobs, replicas
over several nodes, data or pipeline parallel rollout, the delta checkpoint-engine wire format, an HTTP address
(the replica's `server_address` is an id for verl's load balancer; agent loops that speak OpenAI over HTTP to it
do not work). Importing this module imports verl and Ray; nothing else in the project imports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from verl.workers.rollout import base as _verl_rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from rollout.config import EngineConfig, from_mapping
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NAME = "rollout_engine"
"""The value of verl's `actor_rollout_ref.rollout.name` (and the key of `rollout.engine_kwargs`) for this engine."""

_STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted"}  # finish_reason -> verl's stop_reason


def server_name(replica_rank: int, prefix: str = f"{NAME}_") -> str:
    """The Ray actor name of a replica's server: what verl's server adapters pass to `ray.get_actor`."""
    return f"{prefix}server_{replica_rank}_0"


# ---- verl's sampling_params dict -> SamplingParams ----------------------------------------------------------------
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos"}
_HANDLED_KEYS = {"logprobs", "repetition_penalty", "max_tokens", "max_new_tokens"}  # turned into fields by hand


def sampling_params_from_verl(params: dict[str, Any], *, max_tokens: int, return_routed_experts: bool = False) -> SamplingParams:
    """The SamplingParams of one verl `generate` call. `params` is what the agent loop sends (temperature, top_p,
    top_k with -1 for all, repetition_penalty, logprobs as a bool, optionally stop_token_ids, seed, ...) without
    the length keys, which the caller turned into `max_tokens`. ValueError names a key this engine does not offer."""
    fields: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": bool(params.get("logprobs", False)),
                              "return_routed_experts": return_routed_experts}
    for key, value in params.items():
        if key == "logprobs":
            continue
        if key == "repetition_penalty":
            if value not in (None, 1, 1.0):
                raise ValueError(f"sampling_params.repetition_penalty must be 1.0 with {NAME}, got {value!r}")
            continue
        if key not in _SAMPLING_KEYS:
            raise ValueError(f"sampling_params.{key} is not supported by {NAME} (supported: "
                             f"{sorted(_SAMPLING_KEYS | _HANDLED_KEYS)})")
        if value is not None:
            fields[key] = list(value) if key in ("stop", "stop_token_ids") else value
    if fields.get("top_k") == -1:
        fields["top_k"] = 0
    return SamplingParams(**fields)


# ---- records <-> one Ray-friendly message --------------------------------------------------------------------------
def pack_records(updates) -> dict:
    """Dense / Patch records -> {"header": JSON str, "data": uint8 numpy array}: what crosses to the server actor."""
    from weight_updates.wire import plan_bucket, write_bucket

    plan = plan_bucket(list(updates))
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    write_bucket(plan, buf)
    return {"header": json.dumps(plan.header), "data": buf.numpy()}


def unpack_records(message: dict) -> list:
    """The records of a `pack_records` message, as views into its (read-only) array."""
    from weight_updates.wire import read_bucket

    with warnings.catch_warnings():  # the object store's array is read-only; an update only reads it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(message["data"])
    return read_bucket(json.loads(message["header"]), data)


# ---- the server actor ----------------------------------------------------------------------------------------------
class EngineServer:
    """The body of a replica's Ray actor: one AsyncEngine, with the calls verl makes on a rollout server."""

    def __init__(self, engine_config: dict, *, rollout_mode: str, replica_rank: int, prompt_length: int,
                 response_length: int, free_cache_engine: bool = True, num_threads: int | None = None,
                 routing_replay: bool = False) -> None:
        from rollout.async_engine import AsyncEngine

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.engine = AsyncEngine(from_mapping(EngineConfig, engine_config, f"rollout.engine_kwargs.{NAME}"))
        if routing_replay and self.engine.engine.routed_experts_shape is None:
            self.engine.close()
            raise ValueError(f"rollout.enable_rollout_routing_replay: {NAME} returns routed experts for MoE models "
                             "only (with EngineConfig.enable_return_routed_experts on); this model has none")
        self.routing_replay = routing_replay  # every request returns its routed experts (TokenOutput.routed_experts)
        self.rollout_mode = RolloutMode(rollout_mode)
        self.replica_rank = replica_rank
        self.prompt_length, self.response_length = prompt_length, response_length
        self.free_cache_engine = free_cache_engine
        self.global_steps: int | None = None  # the trainer step of the weights (verl's staleness bookkeeping)
        self._inflight: set[str] = set()  # request ids of generate calls not yet returned
        self._open = asyncio.Event()  # set: requests are admitted; cleared by abort_all_requests
        self._open.set()
        self._rejecting = False  # while closed: fail new requests at once instead of holding them

    # ---- token in, token out ----------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: dict | None = None, priority: int = 0) -> TokenOutput:
        """One completion of `prompt_ids`, as vLLM's server answers it: `log_probs` when sampling_params asked for
        `logprobs`, stop_reason "completed" (EOS, stop token, length) or "aborted" (by `abort_all_requests`: the
        tokens so far, which verl's partial-rollout client resumes from). A request that arrives while generation is
        paused waits for `resume_generation` (or is answered "aborted" at once if the pause rejects requests)."""
        for name, value in (("image_data", image_data), ("video_data", video_data), ("audio_data", audio_data)):
            if value is not None:
                raise ValueError(f"{name}: {NAME} serves text-only models")
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs: {NAME} serves text-only models")
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens", None)
        if max_tokens is None:
            max_tokens = params.pop("max_new_tokens", None)
        params.pop("max_new_tokens", None)
        if max_tokens is None:  # verl's default: the response budget, within prompt + response length
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        room = self.engine.engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len="
                             f"{self.engine.engine.max_model_len}")
        sampling = sampling_params_from_verl(params, max_tokens=max(1, min(int(max_tokens), room)),
                                             return_routed_experts=self.routing_replay)

        while not self._open.is_set():
            if self._rejecting:
                return self._aborted()
            await self._open.wait()
        rid = str(request_id)
        self._inflight.add(rid)
        try:
            out = await self.engine.generate(prompt_ids, sampling, request_id=rid)
        finally:
            self._inflight.discard(rid)
        sample = out.outputs[0]
        extra = {"global_steps": self.global_steps, "num_cached_tokens": out.num_cached_prompt_tokens,
                 "policy_versions": list(sample.policy_versions)}
        routed = None if sample.routed_experts is None else np.asarray(sample.routed_experts, dtype=np.int32)
        return TokenOutput(token_ids=list(sample.token_ids), log_probs=list(sample.logprobs) if sampling.logprobs else None,
                           routed_experts=routed, stop_reason=_STOP_REASONS.get(sample.finish_reason, sample.finish_reason),
                           num_preempted=sample.num_preemptions, extra_fields=extra)

    def _aborted(self) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                           extra_fields={"global_steps": self.global_steps})

    # ---- pause / resume (partial rollouts, weight syncs) ----------------------------------------------------------
    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Close the gate, abort every running request (each `generate` returns its tokens so far, "aborted") and
        wait until all have returned; new requests wait for `resume_generation` (`reject_request`: are answered
        "aborted" at once). Returns {"aborted_count", "request_ids"}."""
        self._open.clear()
        self._rejecting = reject_request
        aborted = sorted(self._inflight)
        while self._inflight:  # a request admitted just before the gate closed may reach the engine after an abort
            for rid in list(self._inflight):
                await self.engine.abort(rid)
            await asyncio.sleep(0.01)
        if reset_prefix_cache:
            await self.clear_kv_cache()
        return {"aborted_count": len(aborted), "request_ids": aborted}

    async def resume_generation(self) -> None:
        """Open the gate again: waiting and new requests are admitted."""
        self._rejecting = False
        self._open.set()

    async def wait_for_requests_to_drain(self) -> None:
        while self._inflight:
            await asyncio.sleep(0.01)

    # ---- memory ------------------------------------------------------------------------------------------------
    async def sleep(self) -> None:
        """Free device memory for the trainer: hybrid mode frees the KV cache and moves the weights to host memory
        (`Engine.sleep(2)`), colocated mode frees the KV cache (level 1); standalone servers do not sleep."""
        if not self.free_cache_engine or self.rollout_mode == RolloutMode.STANDALONE:
            return
        level = 2 if self.rollout_mode == RolloutMode.HYBRID else 1
        await self.engine.call(lambda e: e.sleep(level))  # a no-op if what it frees is freed already

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` freed (`tags`: "weights" and/or "kv_cache"; default both); the prefix cache
        comes back empty."""
        if self.rollout_mode == RolloutMode.STANDALONE:
            return
        await self.engine.call(lambda e: e.wake_up(None if tags is None else list(tags)))

    async def clear_kv_cache(self) -> None:
        """Forget the prefix cache (no new request reuses a block computed before)."""
        await self.engine.call(lambda e: e.kv_manager.reset_prefix_cache())

    async def release_kv_cache(self) -> None:
        """Free the KV cache only (the weights stay on the device) for the length of a weight sync."""
        if self.free_cache_engine and self.rollout_mode != RolloutMode.COLOCATED:
            await self.engine.call(lambda e: e.sleep(1))

    async def resume_kv_cache(self) -> None:
        if self.free_cache_engine and self.rollout_mode != RolloutMode.COLOCATED:
            await self.engine.call(lambda e: e.wake_up(["kv_cache"]))

    # ---- weights -------------------------------------------------------------------------------------------------
    async def weight_specs(self) -> dict[str, tuple[list[int], str]]:
        """Checkpoint name -> (shape, dtype name) of every tensor a push may carry."""
        specs = await self.engine.call(lambda e: e.weight_specs())
        return {n: (list(s.shape), str(s.dtype).removeprefix("torch.")) for n, s in specs.items()}

    async def policy_version(self) -> int:
        return await self.engine.call(lambda e: e.policy_version)

    async def update_weights(self, version: int, message: dict, global_steps: int | None = None) -> dict:
        """Apply one push (a `pack_records` message) as one session of the engine's weight sink, between steps;
        returns its UpdateResult as JSON. A refused push raises and leaves weights, version and global_steps."""
        records = unpack_records(message)
        result = await self.engine.call(lambda e: e.apply_weight_update(version, records))
        if global_steps is not None:
            self.global_steps = global_steps
        return result.to_json()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps


# ---- the replica (driver side) ---------------------------------------------------------------------------------------
def _engine_config(config, model_config, *, on_gpu: bool) -> dict:
    """EngineConfig fields of a replica: the rollout config's, then `engine_kwargs.rollout_engine` on top."""
    model = getattr(model_config, "local_path", None) or getattr(model_config, "path", None)
    if not model:
        raise ValueError("actor_rollout_ref.model.path must name the Hugging Face model directory")
    fields: dict[str, Any] = {
        "model": str(model),
        "max_model_len": config.max_model_len or config.prompt_length + config.response_length,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "seed": config.seed,
        "tensor_parallel_size": config.tensor_model_parallel_size,
        "dtype": config.dtype,
        "device": "cuda" if on_gpu else "cpu",
    }
    fields.update(dict((config.engine_kwargs or {}).get(NAME) or {}))
    return fields


class EngineReplica(RolloutReplica):
    """One rollout replica of this engine: a single `EngineServer` actor (verl's `RolloutReplica`).

    In hybrid and colocated mode the actor is placed on the node of the replica's workers with their GPUs visible
    (`CUDA_VISIBLE_DEVICES`), as verl's vLLM replica places its server; without workers (a CPU run) it takes one CPU.
    """

    async def launch_servers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        from verl.plugin.platform import get_platform
        from verl.utils.device import get_resource_name

        if self.nnodes != 1:
            raise ValueError(f"{NAME}: a replica spans one node (tensor_model_parallel_size <= gpus per node); "
                             f"this one needs {self.nnodes}")
        if self.config.data_parallel_size != 1 or self.config.pipeline_model_parallel_size != 1:
            raise ValueError(f"{NAME}: data_parallel_size and pipeline_model_parallel_size must be 1 "
                             "(run more replicas instead)")
        repo_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
        options: dict[str, Any] = {"num_cpus": 1}
        if self.workers:
            resource = get_resource_name()
            node_id, devices = zip(*await asyncio.gather(*[
                w.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(),
                                                    ray.get_runtime_context().get_accelerator_ids()[resource][0]))
                for w in self.workers]))
            # the workers' GPUs, visible to an actor that reserves none (Ray would hide them), as verl's vLLM server
            env.update({var: "1" for var in get_platform().ray_noset_envvars()})
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            options = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id[0], soft=False)}
        if self.is_reward_model or self.is_teacher_model:
            raise ValueError(f"{NAME} serves the policy rollout only, not reward or teacher models")
        name = server_name(self.replica_rank) + self.name_suffix
        server = ray.remote(EngineServer).options(
            name=name, max_concurrency=self.max_concurrency, runtime_env={"env_vars": env}, **options,
        ).remote(
            _engine_config(self.config, self.model_config, on_gpu=bool(self.workers)),
            rollout_mode=self.rollout_mode.value, replica_rank=self.replica_rank,
            prompt_length=self.config.prompt_length, response_length=self.config.response_length,
            free_cache_engine=self.config.free_cache_engine, num_threads=None if self.workers else 1,
            routing_replay=bool(getattr(self.config, "enable_rollout_routing_replay", False)),
        )
        await server.policy_version.remote()  # the engine is loaded (or its error raises here)
        self.servers = [server]
        self._server_handle = server
        self._server_address = name


# ---- the trainer-side server adapter ---------------------------------------------------------------------------------
class EngineServerAdapter(BaseRollout):
    """verl's `BaseRollout` for this engine, one per trainer rank: rank 0 of each replica's ranks talks to the
    replica's server actor; the other ranks take part in the weight generator (whose gathers are collectives)
    and send nothing."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        per_replica = self.config.tensor_model_parallel_size
        self.replica_rank = rank // per_replica if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % per_replica
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle = None
        self.differ = None  # WeightDiffer over the server's weight specs, built at the first push
        self.last_push: dict | None = None  # the statistics of the last push (bytes, encodings, seconds, version)

    def _server(self):
        import ray

        if self.server_handle is None:
            self.server_handle = ray.get_actor(server_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._server().wake_up.remote(tags=list(tags))

    async def release(self) -> None:
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._server().sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: int | None = None,
                             peft_config=None, **kwargs) -> None:
        """Push `weights` ((name, tensor) pairs, a generator or an async generator, Hugging Face names) to the
        replica's engine: Dense for tensors without a snapshot, sparse patches against the last successful push
        otherwise; the engine's `policy_version` moves by one and its `global_steps` becomes `global_steps`.
        Raises (the server's WeightUpdateError) on a refused push; nothing changed then."""
        from weight_updates import ParamSpec, WeightDiffer

        if wire_format != "named_tensors":
            raise ValueError(f"wire_format={wire_format!r}: {NAME} takes named_tensors (its own sparse encoding)")
        if peft_config is not None:
            raise ValueError(f"{NAME} does not serve LoRA adapters: merge them (actor_rollout_ref.model.lora.merge=True)")
        if not self.is_leader_rank:
            async for _ in _aiter(weights):
                pass
            return
        server = self._server()
        if self.differ is None:
            specs = await server.weight_specs.remote()
            self.differ = WeightDiffer({n: ParamSpec(tuple(s), getattr(torch, d)) for n, (s, d) in specs.items()})
        t0 = time.perf_counter()
        named = {}
        async for name, tensor in _aiter(weights):  # copied at once: a sender may reuse its buffers
            spec = self.differ.specs.get(name)
            dtype = spec.dtype if spec is not None else tensor.dtype  # an unknown name: the differ refuses it
            named[name] = tensor.detach().to(device=self.differ.device, dtype=dtype, copy=True)
        push = self.differ.encode(named)
        message = pack_records(push.updates)
        t1 = time.perf_counter()
        version = await server.policy_version.remote() + 1
        await server.update_weights.remote(version, message, global_steps)
        self.differ.commit(push)
        self.last_push = {"version": version, **push.stats.to_json(), "encode_s": t1 - t0,
                          "apply_s": time.perf_counter() - t1}


async def _aiter(weights):
    """(name, tensor) pairs of a generator, an iterable or an async generator."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def register() -> None:
    """Make `rollout.name=rollout_engine` resolve to this module's replica and server adapter."""
    RolloutReplicaRegistry.register(NAME, lambda: EngineReplica)
    _verl_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.EngineServerAdapter"


register()
