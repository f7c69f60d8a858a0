"""Tensor parallelism on the CPU with 2 gloo ranks: sharded layouts, logits, seeded tokens, batch-sharded
sampling memory, weight updates, worker shutdown. Each TP engine spawns one worker process."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import TP_MODEL, sampler_peaks, tp_config, update_records
from rollout import Engine, SamplingParams
from runner.model_config import ModelConfig
from runner.models.llama import DecoderForCausalLM
from runner.parallel.layers import head_partition
from runner.parallel.weights import local_flat_indices
from runner.testing import write_random_checkpoint
from weight_updates import Patch

# kv heads (1) < ranks (2): replicated kv heads; tied embeddings: a vocab-parallel LM head over the embedding
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
PARAMS = [
    SamplingParams(n=2, max_tokens=6, seed=1, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    SamplingParams(top_k=8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, top_logprobs=2),
    SamplingParams(temperature=0.7, min_p=0.05, seed=4, max_tokens=4, ignore_eos=True),
]  # 5 sampling rows: an odd batch, so batch-sharded sampling pads


@pytest.fixture(scope="module")
def engine_1(tp_model_dir, single_thread):
    return Engine(tp_config(tp_model_dir))


@pytest.fixture(scope="module")
def engine_tp(tp_model_dir, single_thread):
    engine = Engine(tp_config(tp_model_dir, tensor_parallel_size=2))
    yield engine
    if engine.runner is not None:
        engine.close()


@pytest.fixture(scope="module")
def engine_ag(tp_model_dir, single_thread):
    engine = Engine(tp_config(tp_model_dir, tensor_parallel_size=2, tp_sampling="allgather"))
    yield engine
    if engine.runner is not None:
        engine.close()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# ---- layouts (no processes) ------------------------------------------------------------------------------
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_sharded_layouts_cover_every_checkpoint_coordinate(num_kv_heads):
    cfg = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **TP_MODEL, "num_hidden_layers": 1,
                                 "num_key_value_heads": num_kv_heads})
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
        rank_params = [dict(DecoderForCausalLM(cfg, None, SimpleNamespace(rank=r, size=2)).named_parameters())
                       for r in range(2)]  # each rank's shard of the model (built, never run)
    full = model.checkpoint_layout()
    layouts = [model.checkpoint_layout(r, 2) for r in range(2)]  # every rank's, from the unsharded model
    for name, slot in full.items():
        covered = torch.zeros(slot.shape[layouts[0][name].dim], dtype=torch.int64)
        for layout, params in zip(layouts, rank_params):
            s = layout[name]
            assert s.shape == slot.shape  # full checkpoint shapes on every rank
            start, end = s.shard
            assert tuple(s.view(params[s.param]).shape) == s.shard_shape  # fits the rank's parameter
            covered[start:end] += 1
        assert covered.min() >= 1, name
        replicated = name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and num_kv_heads < 2
        assert covered.max() == (2 if replicated or "norm" in name else 1), name


def test_bad_head_counts_are_value_errors():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible"):
        head_partition(6, 2, 0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=6"):
        head_partition(12, 6, 0, 4)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        head_partition(12, 3, 0, 4)
    assert head_partition(8, 2, 3, 4).kv_start == 1  # ranks 2, 3 share kv head 1


@pytest.mark.parametrize("shape,dim", [((6, 8), 0), ((6, 8), 1), ((7,), 0), ((6, 7, 5), 0), ((6, 7, 5), 1),
                                       ((6, 7, 5), 2)])
def test_patch_indices_map_to_the_rank_slice(shape, dim):
    from runner.models import CheckpointSlot

    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    slot = CheckpointSlot(param="p", shape=shape, dim=dim, shard=(2, 5))
    shard = full.narrow(dim, 2, 3).contiguous()
    flat = torch.randperm(full.numel(), generator=torch.Generator().manual_seed(0))[: full.numel() // 2]
    local, keep = local_flat_indices(slot, flat)
    assert torch.equal(shard.view(-1)[local], full.view(-1)[flat[keep]])
    coord = torch.unravel_index(flat, shape)[dim]
    assert torch.equal(keep, (coord >= 2) & (coord < 5)) and 0 < keep.sum() < flat.numel()


# ---- engines: 1 rank vs 2 ranks --------------------------------------------------------------------------
def test_tp_logits_equal_single_process(engine_1, engine_tp):
    ids = [3, 5, 7, 11, 13, 2, 9, 200, 255, 128]
    ref = engine_1.collective_rpc("full_sequence_logits", ids)[0]  # [10, 256]
    got = engine_tp.collective_rpc("full_sequence_logits", ids)[0]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5


def test_tp_untied_llama_with_split_kv_heads(tmp_path, single_thread):
    """An untied LM head (vocab-parallel Linear) and kv heads split, not replicated, over the ranks."""
    path = write_random_checkpoint(tmp_path, family="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ids = [5, 9, 100, 127, 3, 3, 64]
    ref_engine = Engine(tp_config(path))
    ref = ref_engine.collective_rpc("full_sequence_logits", ids)[0]
    ref_tokens = _tokens(ref_engine.generate(PROMPTS, PARAMS))
    with Engine(tp_config(path, tensor_parallel_size=2)) as engine:
        assert engine.runner.weights.view("lm_head.weight").shape == (64, 64)  # this rank's half of the vocab
        assert (engine.collective_rpc("full_sequence_logits", ids)[0] - ref).abs().max().item() < 1e-5
        assert _tokens(engine.generate(PROMPTS, PARAMS)) == ref_tokens


def test_tp_seeded_tokens_equal_single_process_and_allgather(engine_1, engine_tp, engine_ag):
    ref = engine_1.generate(PROMPTS, PARAMS)
    sharded = engine_tp.generate(PROMPTS, PARAMS)
    gathered = engine_ag.generate(PROMPTS, PARAMS)
    assert _tokens(sharded) == _tokens(ref) == _tokens(gathered)
    for a, b in zip(ref, sharded):
        for x, y in zip(a.outputs, b.outputs):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
            if x.top_logprobs:
                assert [[t for t, _ in pos] for pos in x.top_logprobs] == [[t for t, _ in pos] for pos in y.top_logprobs]


def test_batch_sharded_sampling_halves_peak_logits_memory(engine_tp, engine_ag):
    """Measured on rank 0 with the torch profiler around each sampler call (logits exchange + sampling)."""
    prompts = [[i + 2, i + 3] for i in range(8)]  # 8 sampling rows per decode step
    params = SamplingParams(max_tokens=3, seed=5, ignore_eos=True)
    peaks, tokens = sampler_peaks({"sharded": engine_tp, "allgather": engine_ag}, prompts, params)
    assert tokens["sharded"] == tokens["allgather"]
    assert 0 < peaks["sharded"] < 0.6 * peaks["allgather"], peaks


def test_weight_update_under_tp_matches_single_process(engine_1, engine_tp):
    from weight_updates import WeightUpdateError

    before = _tokens(engine_tp.generate(PROMPTS, PARAMS))
    records = update_records(engine_1.runner.weights)
    bad = Patch(name=records[-1].name, indices=records[-1].indices, values=records[-1].values, checksum=123)
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):
        engine_tp.apply_weight_update(1, records[:-1] + [bad])  # nothing written on any rank
    assert _tokens(engine_tp.generate(PROMPTS, PARAMS)) == before
    engine_1.apply_weight_update(1, records)
    engine_tp.apply_weight_update(1, records)
    assert engine_tp.policy_version == engine_1.policy_version == 1
    ref, got = engine_1.generate(PROMPTS, PARAMS), engine_tp.generate(PROMPTS, PARAMS)
    assert _tokens(got) == _tokens(ref) != before
    engine_1.step(), engine_tp.step()  # an empty step frees the finished requests' runner slots
    ids = [3, 5, 7, 11, 13, 2, 9, 200, 255, 128]
    diff = engine_tp.collective_rpc("full_sequence_logits", ids)[0] - engine_1.collective_rpc("full_sequence_logits", ids)[0]
    assert diff.abs().max().item() < 1e-5


def test_close_stops_the_worker_ranks(engine_ag):
    workers = engine_ag.executor._workers
    assert all(w.is_alive() for w in workers)
    with engine_ag:
        pass
    assert engine_ag.runner is None
    assert not any(w.is_alive() for w in workers)


def test_rank_devices_must_exist():
    from runner.parallel.worker import check_rank_devices

    check_rank_devices("cpu", 2, 0)
    check_rank_devices("cuda", 2, 2)
    with pytest.raises(ValueError, match="needs cuda:1 .. cuda:2, but this host has 2 GPU"):
        check_rank_devices("cuda:1", 2, 2)


def test_patches_scatter_straight_into_whole_tensors_only(engine_1, engine_tp):
    """Batched patch writes go through live views only where flat indices are the view's own: every
    tensor of a single-process engine, a replicated tensor under TP, never a TP shard."""
    names = ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"]
    views = engine_1.runner.weights.writable_views(names)
    assert views is not None and all(v.data_ptr() == engine_1.runner.weights.view(n).data_ptr() for n, v in zip(names, views))
    sharded = engine_tp.runner.weights
    assert sharded.writable_views(["model.norm.weight"]) is not None
    assert sharded.writable_views(names) is None  # q_proj is split over the ranks
    # the same through the data pointers: every checkpoint name of the engine, also the fused q / k / v rows
    every = list(engine_1.runner.weights.layout)
    held, addresses = engine_1.runner.weights.writable_addresses(every)
    assert addresses.tolist() == [v.data_ptr() for v in engine_1.runner.weights.writable_views(every)]
    assert len(held) < len(every) and all(t.is_contiguous() for t in held)  # one per parameter, fused ones once
    assert sharded.writable_addresses(["model.norm.weight"]) is not None
    assert sharded.writable_addresses(names) is None


def test_tp_async_scheduling_equals_sync(tp_model_dir, single_thread):
    """Every rank launches step t+1 before collecting step t; tokens, logprobs and policy versions equal the
    synchronous TP engine's, also through chunked prefill, preemption and a weight update between steps
    (deterministic mode: async scheduling changes which rows share a step)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 21, 9, 40, 5)]
    params = [
        SamplingParams(n=3, max_tokens=12, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=30, seed=2, stop_token_ids=[7, 11, 13, 17, 19, 23]),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(n=2, max_tokens=25, seed=4, top_p=0.9, min_tokens=3),
        SamplingParams(max_tokens=40, seed=6, ignore_eos=True),
    ]
    with Engine(tp_config(tp_model_dir)) as single:  # full checkpoint-shaped records of the fresh weights
        records = update_records(single.runner.weights)
    results = []
    for async_scheduling in (False, True):
        cfg = dataclasses.replace(tp_config(tp_model_dir, tensor_parallel_size=2, async_scheduling=async_scheduling,
                                            deterministic=True),
                                  max_num_seqs=4, num_kv_blocks=12, block_size=8, max_num_batched_tokens=16)
        with Engine(cfg) as engine:
            ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            done = {}
            for step in range(400):
                if step == 10:  # between steps, with a step in flight under async scheduling
                    engine.apply_weight_update(1, records)
                done.update({o.request_id: o for o in engine.step() if o.finished})
                if not engine.has_unfinished_requests():
                    break
            assert engine.scheduler.stats.num_preemptions > 0
            results.append([[(c.token_ids, c.logprobs, c.policy_versions) for c in done[i].outputs] for i in ids])
    assert results[1] == results[0]


def test_step_messages_round_trip_through_json():
    """What rank 0 sends the workers each step: new requests in full (their sampling settings as plain
    fields), running ones as columns; JSON text in between, as over the control channel."""
    import json

    from runner.messages import CachedRequestData, NewRequestData, SchedulerOutput

    sampling = SamplingParams(n=2, top_p=0.9, top_k=5, min_p=0.1, temperature=0.7, top_logprobs=3, speculative=False)
    sched = SchedulerOutput(
        new_reqs=[NewRequestData(req_id="a-0", token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[4], num_computed_tokens=0,
                                 sampling=sampling.runner_sampling(99))],
        cached_reqs=CachedRequestData(["b-0", "c-1"], [[], [8, 9]], [17, 40]),
        num_scheduled_tokens={"a-0": 3, "b-0": 1, "c-1": 1}, total_num_scheduled_tokens=5,
        finished_req_ids={"d-0", "e-0"}, preempted_req_ids={"f-0"}, placeholders={"b-0": 17},
    )
    back = SchedulerOutput.from_dict(json.loads(json.dumps(sched.to_dict())))
    assert back == sched
    assert back.new_reqs[0].sampling.seed == 99 and back.new_reqs[0].sampling.top_logprobs == 3
    assert not back.new_reqs[0].sampling.speculative


def test_tp_engine_reloads_weights_from_disk(tp_model_dir, tmp_path, single_thread):
    """Engine.load_weights under TP: full checkpoint tensors go through rank 0's validated session, each
    rank writes its shard; greedy output then equals a fresh single-process engine on the new checkpoint."""
    from conftest import perturbed_checkpoint

    moved = perturbed_checkpoint(tp_model_dir, tmp_path / "moved", seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 4, 5], [9, 10, 11, 12]]
    with Engine(tp_config(moved)) as fresh:
        expected = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy)]
    with Engine(tp_config(tp_model_dir, tensor_parallel_size=2)) as engine:
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] != expected
        assert engine.load_weights(str(moved)).version == 1
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == expected


def test_tp_small_batch_kernels_follow_the_unfused_layers(tp_model_dir, single_thread, monkeypatch):
    """Under TP the batch-1 path (`set_gemv_rows`, which the runner turns on for CUDA; here on both ranks through
    collective_rpc, the kernels in Triton's interpreter): the column-parallel qkv / gate_up with the norm folded in,
    the row-parallel o / down (SiLU-and-mul folded in) all-reduced, the vocab-parallel LM head. Greedy decodes of
    one prompt at a time equal the same TP engine's without them (prefix cache off), logprobs within 1e-4."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU kernels need TRITON_INTERPRET=1 in the workers' environment")
    import kernels.gemv

    calls = []  # rank 0's launches (rank 1 runs in its worker process)
    real = kernels.gemv.fused_gemv
    monkeypatch.setattr(kernels.gemv, "fused_gemv", lambda *a, **kw: calls.append(kw.get("prologue", "none")) or real(*a, **kw))
    engine = Engine(tp_config(tp_model_dir, tensor_parallel_size=2, enable_prefix_caching=False))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True)
        refs = [engine.generate([prompt], greedy)[0].outputs[0] for prompt in PROMPTS[:2]]
        assert calls == []
        assert engine.collective_rpc("model.set_gemv_rows", 1) == [None, None]
        for prompt, ref in zip(PROMPTS[:2], refs):
            out = engine.generate([prompt], greedy)[0].outputs[0]
            assert out.token_ids == ref.token_ids
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-4)
        assert set(calls) == {"rms_norm", "none", "silu_mul"}
    finally:
        engine.close()
