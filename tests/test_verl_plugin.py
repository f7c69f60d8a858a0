"""The verl rollout plugin (trainer_bridge/integrations/verl.py) against verl's own classes.

Skipped where verl (0.9.x) cannot be imported. Under Ray on the CPU, one replica launched as verl launches it,
driven through verl's `LLMServerClient` and load balancer the way its agent loop drives a server: greedy and seeded
generation equal a local engine's, abort_all_requests returns the partial tokens and holds (or rejects) new
requests until resume_generation, sleep frees the engine until wake_up; the trainer-side server adapter's
`update_weights` leaves the engine's weights bitwise equal to the pushed ones, the second push as a patch.
One combined Ray test, because Ray start-up and the actor dominate the cost.
"""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl.workers.rollout.replica", reason="verl is not installed")

from rollout import EngineConfig, SamplingParams  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from runner.testing import write_random_checkpoint  # noqa: E402
from trainer_bridge.integrations import verl as plugin  # noqa: E402
from weight_updates import Dense  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_registered_with_verl_under_its_name_and_entry_point():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert get_rollout_replica_class(plugin.NAME) is plugin.EngineReplica
    assert get_rollout_class(plugin.NAME, "async") is plugin.EngineServerAdapter
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
    assert entry_points == {plugin.NAME: "trainer_bridge.integrations.verl"}


def test_sampling_params_from_verls_dict():
    sp = plugin.sampling_params_from_verl(
        {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
         "stop_token_ids": (5, 6)}, max_tokens=12)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.logprobs) == (0.7, 0.9, 0, True)
    assert (sp.stop_token_ids, sp.max_tokens) == ([5, 6], 12)
    assert plugin.sampling_params_from_verl({"logprobs": False}, max_tokens=3).logprobs is False
    with pytest.raises(ValueError, match="repetition_penalty"):
        plugin.sampling_params_from_verl({"repetition_penalty": 1.1}, max_tokens=3)
    with pytest.raises(ValueError, match="sampling_params.presence_penalty"):
        plugin.sampling_params_from_verl({"presence_penalty": 0.5}, max_tokens=3)


def _exported(server) -> dict[str, torch.Tensor]:
    """The server engine's weights, as it holds them (through the actor's own process)."""
    import ray

    message = ray.get(server.__ray_call__.remote(lambda s: plugin.pack_records(s.engine.engine.export_weights())))
    return {r.name: r.tensor.clone() for r in plugin.unpack_records(message)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_server_answers_verls_agent_loop_and_takes_sparse_pushes(tmp_path):
    ray = pytest.importorskip("ray")
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import get_router_handle

    torch.set_num_threads(1)
    model_dir = write_random_checkpoint(
        tmp_path / "model", seed=0, std=0.02, vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=1)
    engine_kwargs = {"dtype": "float32", "num_kv_blocks": 96, "max_num_seqs": 8}
    config = RolloutConfig(name=plugin.NAME, tensor_model_parallel_size=1, prompt_length=16, response_length=400,
                           max_num_seqs=8, engine_kwargs={plugin.NAME: engine_kwargs})
    model_config = SimpleNamespace(path=str(model_dir))  # the fields of verl's HFModelConfig the plugin reads
    local = Engine(EngineConfig(model=str(model_dir), max_model_len=416, **engine_kwargs))
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, "max_tokens": 8}
    client_config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": plugin.NAME, "full_determinism": False}}})

    def local_tokens(prompt, **fields):
        return local.generate([prompt], SamplingParams(**fields))[0].outputs[0]

    async def scenario():
        replica = plugin.EngineReplica(replica_rank=0, config=config, model_config=model_config, gpus_per_node=1)
        replica.rollout_mode = RolloutMode.HYBRID  # a CPU run has no worker group: no GPUs to place the actor on
        await replica.launch_servers()
        server = replica.server_handle
        assert ray.get_actor(plugin.server_name(0)) is not None
        balancer = get_router_handle(servers={replica.server_address: server})
        client = LLMServerClient(config=client_config, load_balancer_handle=balancer)

        async def generate(prompt, params, rid="r"):
            return await client.generate(rid, prompt_ids=prompt, sampling_params=dict(params))

        # generate, as the agent loop sends it: greedy and seeded equal the local engine's
        outs = await asyncio.gather(*(generate(p, greedy, f"g{i}") for i, p in enumerate(prompts)))
        for p, out in zip(prompts, outs):
            ref = local_tokens(p, temperature=0, max_tokens=8)
            assert out.token_ids == ref.token_ids and out.stop_reason == "completed"
            assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(ref.logprobs), atol=1e-5)
            assert out.extra_fields["policy_versions"] == [0] * len(out.token_ids)
        seeded = await generate(prompts[0], {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 3,
                                             "logprobs": False, "max_tokens": 8})
        assert seeded.token_ids == local_tokens(prompts[0], seed=3, max_tokens=8).token_ids
        assert seeded.log_probs is None
        default_len = await generate(prompts[1], {"temperature": 0, "ignore_eos": True})  # no max_tokens: response_length
        assert len(default_len.token_ids) == 400

        # abort_all_requests mid-generation: the partial tokens come back "aborted"; new requests wait for resume
        long = {"temperature": 0, "ignore_eos": True, "logprobs": True, "max_tokens": 400}
        running = asyncio.ensure_future(generate(prompts[2], long))
        while not await server.__ray_call__.remote(lambda s: bool(s._inflight)):
            await asyncio.sleep(0.005)
        aborted = await replica.abort_all_requests()
        partial = await running
        assert partial.stop_reason == "aborted" and len(partial.token_ids) < 400
        ref = local_tokens(prompts[2], temperature=0, ignore_eos=True, max_tokens=400)
        assert partial.token_ids == ref.token_ids[: len(partial.token_ids)]
        assert aborted is None  # RolloutReplica.abort_all_requests gathers and returns nothing
        parked = asyncio.ensure_future(generate(prompts[0], greedy))
        await asyncio.sleep(0.5)
        assert not parked.done()
        await replica.resume_generation()
        assert (await parked).token_ids == outs[0].token_ids
        await replica.abort_all_requests(reject_request=True)
        rejected = await generate(prompts[0], greedy)
        assert rejected.stop_reason == "aborted" and rejected.token_ids == []
        await replica.resume_generation()

        # sleep (hybrid: KV cache and weights freed) refuses generation until wake_up
        before = _exported(server)
        await replica.sleep()
        with pytest.raises(Exception, match="sleeps"):
            await generate(prompts[0], greedy)

        # the trainer side: verl's naive sync is resume(weights) -> update_weights -> resume(kv_cache)
        adapter = plugin.EngineServerAdapter(config=config, model_config=model_config, device_mesh=None)
        pushed = {n: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for n, t in before.items()}
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(iter(pushed.items()), global_steps=1, peft_config=None, base_sync_done=True)
        first = adapter.last_push
        assert (first["version"], first["num_dense"], first["num_patch"]) == (1, len(pushed), 0)
        held = _exported(server)
        assert all(torch.equal(_bits(held[n]), _bits(pushed[n])) for n in pushed)

        name = "model.layers.0.mlp.down_proj.weight"
        pushed[name] = pushed[name].clone()
        pushed[name].view(-1)[:40] += 0.5

        async def stream():  # the checkpoint engine hands over an async generator
            for item in pushed.items():
                yield item

        await adapter.update_weights(stream(), global_steps=2)
        second = adapter.last_push
        # every tensor is a patch (those without changes empty ones)
        assert (second["version"], second["num_dense"], second["num_patch"]) == (2, 0, len(pushed))
        assert second["bytes"] < second["dense_bytes"] / 10
        held = _exported(server)
        assert all(torch.equal(_bits(held[n]), _bits(pushed[n])) for n in pushed)

        with pytest.raises(ValueError, match="unknown parameter"):  # refused before anything is sent
            await adapter.update_weights(iter([("no.such.weight", torch.zeros(2))]), global_steps=3)
        assert await server.policy_version.remote() == 2

        # a push the engine refuses (its weights sleep) changes nothing, the adapter's snapshot included: the next
        # push is diffed against push 2 again, so the elements changed since then all arrive
        await adapter.resume(tags=["kv_cache"])
        await replica.sleep()
        pushed[name].view(-1)[40:80] -= 0.25
        with pytest.raises(ValueError, match="sleeps"):
            await adapter.update_weights(iter(pushed.items()), global_steps=3)
        assert await server.policy_version.remote() == 2
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(iter(pushed.items()), global_steps=3)
        assert (adapter.last_push["version"], adapter.last_push["num_dense"]) == (3, 0)
        held = _exported(server)
        assert all(torch.equal(_bits(held[n]), _bits(pushed[n])) for n in pushed)
        await adapter.resume(tags=["kv_cache"])

        after = await generate(prompts[0], greedy)
        assert after.extra_fields["global_steps"] == 3
        assert after.extra_fields["policy_versions"] == [3] * len(after.token_ids)
        return after, pushed

    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        after, pushed = asyncio.run(scenario())
        # the server generates as a fresh engine holding the pushed weights does
        local.apply_weight_update(1, [Dense.of(n, t) for n, t in pushed.items()])
        assert after.token_ids == local_tokens(prompts[0], temperature=0, max_tokens=8).token_ids
    finally:
        ray.shutdown()
        local.close()


def test_routing_replay_returns_the_experts_of_every_input_position(ckpt_factory):
    """With verl's rollout.enable_rollout_routing_replay the server's TokenOutput carries routed_experts as vLLM's
    does: int32 [prompt + response - 1, MoE layers, top_k], the same experts a local engine reports for the same
    seeded request. A dense model is refused at start-up, naming the flag."""
    import numpy as np

    path = ckpt_factory("qwen3_moe")
    server = plugin.EngineServer({"model": str(path), "max_num_seqs": 4}, rollout_mode="hybrid", replica_rank=0,
                                 prompt_length=16, response_length=6, routing_replay=True)
    prompt = [3, 9, 27, 31, 5]
    try:
        out = asyncio.run(server.generate(prompt, {"temperature": 1.0, "seed": 3, "logprobs": True}, "r0"))
    finally:
        server.engine.close()
    engine = Engine(EngineConfig(model=str(path), max_num_seqs=4))
    ref = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=True,
                                                   return_routed_experts=True))[0].outputs[0]
    shape = engine.routed_experts_shape
    engine.close()
    assert out.token_ids == list(ref.token_ids)
    assert out.routed_experts.dtype == np.int32
    assert out.routed_experts.shape == (len(prompt) + len(out.token_ids) - 1, *shape)
    assert np.array_equal(out.routed_experts, np.asarray(ref.routed_experts))
    with pytest.raises(ValueError, match="enable_rollout_routing_replay"):
        plugin.EngineServer({"model": str(ckpt_factory("llama"))}, rollout_mode="hybrid", replica_rank=0,
                            prompt_length=16, response_length=6, routing_replay=True)
