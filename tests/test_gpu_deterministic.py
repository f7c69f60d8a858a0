"""Deterministic mode on CUDA in bf16 (skipped without CUDA): engine logprobs equal the trainer's bitwise."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from rollout import Engine, EngineConfig, SamplingParams
from trainer_bridge import TrainingModel

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("det_qwen3"), "qwen3", seed=21, dtype=torch.bfloat16,
                           vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, initializer_range=0.1,
                           max_position_embeddings=2048)


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=24, block_size=16, num_kv_blocks=12, max_num_seqs=6),  # chunking + preemption
    dict(max_num_batched_tokens=4096, block_size=16, num_kv_blocks=256, max_num_seqs=16),
    dict(max_num_batched_tokens=4096, block_size=16, num_kv_blocks=256, max_num_seqs=16, enforce_eager=True),
])
def test_engine_logprobs_equal_trainer_bitwise_bf16(qwen3_bf16, engine_kw):
    engine = Engine(EngineConfig(model=str(qwen3_bf16), device="cuda", dtype="bfloat16", deterministic=True,
                                 max_model_len=512, **engine_kw))
    trainer = TrainingModel.from_pretrained(qwen3_bf16, dtype="bfloat16", device="cuda", deterministic=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (3, 37, 9, 70)]
    params = [SamplingParams(n=2, max_tokens=24, seed=i, ignore_eos=True) for i in range(4)]
    outs = engine.generate(prompts, params)
    if engine_kw["max_num_batched_tokens"] < 100:
        assert engine.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            with torch.no_grad():
                theirs = trainer.token_logprobs(ids)[0, len(prompt) - 1 :].cpu()
            ours = torch.tensor(c.logprobs, dtype=torch.float32)
            assert torch.equal(ours, theirs), (ours - theirs).abs().max()


@pytest.fixture(scope="module")
def qwen2_shape_bf16(tmp_path_factory):
    """Qwen2.5-0.5B's widths, vocabulary and qkv bias (two layers): the GEMM shapes of the benchmark."""
    return make_checkpoint(tmp_path_factory.mktemp("det_qwen2"), "qwen2", seed=3, dtype=torch.bfloat16,
                           vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                           num_attention_heads=14, num_key_value_heads=2, initializer_range=0.05,
                           tie_word_embeddings=True, max_position_embeddings=2048)


def test_real_shapes_mixed_truncation_and_batched_scoring(qwen2_shape_bf16):
    """Rows without truncation match the trainer bitwise even when their batch holds top-p rows, and the
    trainer may score many sequences in one forward (more rows than one GEMM block)."""
    engine = Engine(EngineConfig(model=str(qwen2_shape_bf16), device="cuda", dtype="bfloat16", deterministic=True,
                                 max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512))
    trainer = TrainingModel.from_pretrained(qwen2_shape_bf16, dtype="bfloat16", device="cuda", deterministic=True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 151936, (n,), generator=g).tolist() for n in (5, 40, 17, 90, 33, 64)]
    params = [SamplingParams(n=3, max_tokens=40, seed=i, ignore_eos=True, top_p=0.9 if i == 2 else 1.0)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    seqs, rollout, starts = [], [], []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i == 2:
            continue  # truncated rows have no trainer-side counterpart
        for c in out.outputs:
            seqs.append(prompt + c.token_ids)
            rollout.append(torch.tensor(c.logprobs, dtype=torch.float32))
            starts.append(len(prompt) - 1)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device="cuda")  # [B, width]; B * width > 256
    with torch.no_grad():
        scored = trainer.token_logprobs(ids).cpu()  # [B, width - 1]
    for row, (seq, ours, start) in enumerate(zip(seqs, rollout, starts)):
        theirs = scored[row, start : len(seq) - 1]
        assert torch.equal(ours, theirs), (row, (ours - theirs).abs().max())
    engine.close()


def test_trainer_backward_runs_in_deterministic_mode(qwen3_bf16):
    trainer = TrainingModel.from_pretrained(qwen3_bf16, dtype="bfloat16", device="cuda", deterministic=True)
    ids = torch.randint(2, 1024, (2, 40), device="cuda")
    logp = trainer.token_logprobs(ids)
    logp.sum().backward()
    grads = [p.grad for p in trainer.parameters()]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    assert sum(float(g.float().abs().sum()) for g in grads) > 0
