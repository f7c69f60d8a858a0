"""Qwen3-MoE and Qwen2-MoE against transformers (fp32, CPU): logits at every position, greedy continuations
(also with chunked prefill and preemption), sampled-token logprobs, checkpoints written without
transformers, config validation and the dense forward's routing replay."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_hf, variant_id
from rollout import Engine, EngineConfig, SamplingParams
from runner.testing import write_random_checkpoint
from trainer_bridge.training_model import TrainingModel

VARIANTS = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "num_hidden_layers": 4, "mlp_only_layers": [1],
                   "decoder_sparse_step": 2}),  # layer 3 sparse only: 0 and 2 dense by step, 1 by list
    ("qwen2_moe", {}),
    ("qwen2_moe", {"tie_word_embeddings": True, "norm_topk_prob": True}),
]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_logits_match_transformers_at_every_position(ckpt_factory, variant):
    family, overrides = variant
    path = ckpt_factory(family, **overrides)
    hf = load_hf(path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, num_kv_blocks=64))
    tokens = _tokens(90, 1)
    ours = engine.collective_rpc("full_sequence_logits", tokens)[0]
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    assert out.logits.std() > 0.5, "logits too flat for a meaningful comparison"
    # the routing is not degenerate: several experts are chosen in every sparse layer
    for logits in out.router_logits:
        assert logits.topk(2, dim=-1).indices.unique().numel() >= 4
    torch.testing.assert_close(ours, out.logits[0], atol=1e-4, rtol=1e-4)
    sparse = engine.runner.model.routed_experts_shape[0]
    assert sparse == len(out.router_logits) == (1 if overrides.get("mlp_only_layers") else 2)
    engine.close()


PROMPTS = [[5, 9, 13, 2, 7], list(range(40, 63)), [100], list(range(3, 60)), [7] * 18]


@pytest.mark.parametrize(
    "family,engine_kw",
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", {"max_num_batched_tokens": 8}),  # chunked prefill
        ("qwen2_moe", {"num_kv_blocks": 24, "block_size": 4}),  # so few blocks that requests get preempted
    ],
)
def test_greedy_matches_transformers(ckpt_factory, family, engine_kw):
    path = ckpt_factory(family)
    hf = load_hf(path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", **{"max_num_seqs": 8, **engine_kw}))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
    if "num_kv_blocks" in engine_kw:
        assert engine.scheduler.stats.num_preemptions > 0
    if "max_num_batched_tokens" in engine_kw:
        assert engine.scheduler.stats.num_steps > len(PROMPTS[3]) // engine_kw["max_num_batched_tokens"]
    engine.close()


def test_sampled_logprobs_are_those_of_the_sampling_distribution(ckpt_factory):
    path = ckpt_factory("qwen2_moe")
    hf = load_hf(path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=8, num_kv_blocks=64))
    prompts = [[3, 4, 5, 6], list(range(20, 31))]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=7, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        for sample in out.outputs:
            ids = prompt + sample.token_ids
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            ref = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=1e-4, rtol=1e-4)
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_random_checkpoint_writer_writes_what_transformers_reads(tmp_path, family):
    """runner.testing writes MoE checkpoints from the layout: transformers loads them with no missing or
    unexpected tensor, and both compute the same logits."""
    extra = {"shared_expert_intermediate_size": 48} if family == "qwen2_moe" else {}
    path = write_random_checkpoint(tmp_path / family, family=family, vocab_size=128, hidden_size=64,
                                   intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, **extra)
    import transformers

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32))
    tokens = _tokens(30, 3)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(engine.collective_rpc("full_sequence_logits", tokens)[0], ref, atol=1e-4, rtol=1e-4)
    engine.close()


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in"),
    ({"moe_intermediate_size": None}, "missing required field 'moe_intermediate_size'"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
])
def test_bad_moe_config_is_refused_naming_the_field(ckpt_factory, tmp_path, change, message):
    src = ckpt_factory("qwen3_moe")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16))


def test_dense_forward_replays_given_experts(ckpt_factory):
    """Replaying the forward's own top-k changes nothing (bitwise); replaying other experts changes the
    logits of those positions only, and gradients still reach the router through the recomputed weights."""
    path = ckpt_factory("qwen3_moe")
    tm = TrainingModel.from_pretrained(path)
    model = tm.model
    ids = torch.tensor([_tokens(16, 4), _tokens(16, 5)])
    with torch.no_grad():
        base = tm(ids)
        own = []
        hooks = [b.register_forward_hook(lambda m, a, o: own.append(m.route(a[0].reshape(-1, a[0].shape[-1]),
                                                                              tuple(a[0].shape[:-1]))[1]))
                 for b in model.sparse_blocks]
        tm(ids)
        for h in hooks:
            h.remove()
    routed = torch.stack([r.view(2, 16, -1) for r in own], dim=2)  # [B, T, L, k]
    with torch.no_grad():
        same = model.compute_logits(model.forward_dense(ids, routed_experts=routed[:, :15])).float()
    assert torch.equal(same, base)

    other = routed.clone()
    other[:, 3] = (other[:, 3] + 1) % model.moe.num_experts  # different experts at position 3 only
    other[:, 3, :, 1] = (other[:, 3, :, 0] + 1) % model.moe.num_experts
    logits = model.compute_logits(model.forward_dense(ids, routed_experts=other[:, :15])).float()
    assert not torch.allclose(logits[:, 3], base[:, 3])
    torch.testing.assert_close(logits[:, :3], base[:, :3])
    logits.logsumexp(-1).sum().backward()
    assert all(b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0 for b in model.sparse_blocks)

    with pytest.raises(ValueError, match="routed_experts must be an integer tensor of shape"):
        model.forward_dense(ids, routed_experts=routed[:, :, :1])
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
        model.forward_dense(ids, routed_experts=routed + 8)
