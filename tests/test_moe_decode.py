"""The MoE layers' decode path (`SparseMoeBlock.forward_decode`: the post-attention norm in the router's GEMV, then
kernels/moe_decode.py) in the engine on CUDA (skipped without CUDA): it is taken at batch 1 and 4 (top-4), not
beyond its pair budget nor for Qwen2-MoE's shared expert; in float32 it continues greedily and routes exactly as
the unfused path does; a captured graph replays it bitwise as the eager step computes it.

False positives: the two float32 paths differ by summation-order rounding (~1e-6 relative), so a greedy token or
an expert choice could only flip where two logits lie within ~1e-5 of each other; over the ~500 choices here
that has a probability below 1e-3 for these random models.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from rollout import Engine, EngineConfig, SamplingParams
from runner.models.qwen_moe import SparseMoeBlock

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MOE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
           num_key_value_heads=2, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
           initializer_range=0.1, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("decode_qwen3_moe"), "qwen3_moe", seed=7, **MOE)


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the calls of kernels.moe_decode.moe_decode (the model imports it at each call)."""
    import kernels.moe_decode as module

    calls = []
    real = module.moe_decode

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "moe_decode", counting)
    return calls


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1024, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _greedy(path, prompts, dtype, decode_pairs, monkeypatch):
    monkeypatch.setattr(SparseMoeBlock, "decode_pairs", decode_pairs)
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=256,
                                 num_kv_blocks=64, enforce_eager=True))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   return_routed_experts=True))
    engine.close()
    return [(o.outputs[0].token_ids, o.outputs[0].routed_experts) for o in outs]


@pytest.mark.parametrize("batch", [1, 4])
def test_float32_decode_path_continues_and_routes_as_the_unfused_path(qwen3_moe, batch, decode_calls, monkeypatch):
    prompts = _prompts(batch, seed=batch)
    fused = _greedy(qwen3_moe, prompts, "float32", 16, monkeypatch)
    assert decode_calls.count(batch) >= 23  # every decode step of the batch took the path
    calls = len(decode_calls)
    unfused = _greedy(qwen3_moe, prompts, "float32", 0, monkeypatch)
    assert len(decode_calls) == calls  # off: never taken
    for (tokens, routed), (ref_tokens, ref_routed) in zip(fused, unfused):
        assert tokens == ref_tokens
        assert (routed == ref_routed).all()


def test_not_taken_beyond_the_pair_budget_or_with_a_shared_expert(qwen3_moe, tmp_path, decode_calls, monkeypatch):
    _greedy(qwen3_moe, _prompts(5), "float32", 16, monkeypatch)  # decode steps: 5 tokens x top-4 = 20 pairs > 16
    assert all(tokens <= 4 for tokens in decode_calls)
    decode_calls.clear()
    shared = make_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", seed=7, shared_expert_intermediate_size=128, **MOE)
    _greedy(shared, _prompts(1), "float32", 16, monkeypatch)
    assert decode_calls == []


@pytest.mark.parametrize("batch", [1, 4])
def test_graph_replay_is_bitwise_equal_to_the_eager_step(qwen3_moe, batch, decode_calls):
    engine = Engine(EngineConfig(model=str(qwen3_moe), device="cuda", dtype="bfloat16", max_num_seqs=8,
                                 max_model_len=256, num_kv_blocks=64))
    runner = engine.runner
    assert runner.graphs is not None
    for p in _prompts(batch, seed=3):
        engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True, seed=3, return_routed_experts=True))
    for _ in range(6):
        engine.step()
    size = runner.graphs.padded_size(batch)
    assert size == batch
    in_flight = runner.last_sampled.clone()
    g_tokens, g_logprobs = (t.clone() for t in runner.graphs.replay(size, False))
    g_store = runner.routed_store.clone()
    runner.last_sampled.copy_(in_flight)
    calls = len(decode_calls)
    e_tokens, e_logprobs = runner.decode_forward(size, False)
    torch.cuda.synchronize()
    assert len(decode_calls) > calls  # the eager step took the decode path (so the captured one did too)
    assert torch.equal(g_tokens[:batch], e_tokens[:batch])
    assert torch.equal(g_logprobs[:batch], e_logprobs[:batch])
    assert torch.equal(g_store, runner.routed_store)
    engine.close()
