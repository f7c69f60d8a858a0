"""GPU speculative decoding (skipped without CUDA): graph-captured uniform steps against the eager runner
(`enforce_eager=True`) and against plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Vocabulary 8, so even an untrained drafter gets drafts accepted."""
    path = tmp_path_factory.mktemp("gpu_spec_qwen2")
    return make_checkpoint(path, "qwen2", seed=5, vocab_size=8, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.25,
                           max_position_embeddings=1024)


def _prompts(n, vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _engine(path, method="eagle", spec=True, **kw) -> Engine:
    args = dict(model=str(path), device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256,
                num_kv_blocks=256, block_size=16)
    args.update(kw)
    speculative = SpeculativeConfig(method=method, num_speculative_tokens=3) if spec else None
    engine = Engine(EngineConfig(**args, speculative=speculative))
    if engine.spec_controller is not None:
        engine.spec_controller.auto_off = False
    return engine


def _tokens(outs):
    return [[o.token_ids for o in r.outputs] for r in outs]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_graph_greedy_equals_eager_and_plain_greedy(model, method, deterministic):
    prompts = _prompts(5)  # n = 2: 10 rows, padded to the capture size 16
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2)
    engine = _engine(model, method, deterministic=deterministic)
    graphs = engine.runner.spec.graphs
    assert graphs is not None and graphs.capture
    got = engine.generate(prompts, params)
    assert (16, 3) in graphs.graphs and graphs.num_steps[(16, 3)] > 0
    eager = _engine(model, method, deterministic=deterministic, enforce_eager=True)
    assert eager.runner.spec.graphs is None
    want = eager.generate(prompts, params)
    plain = _engine(model, spec=False, deterministic=deterministic).generate(prompts, params)
    assert _tokens(got) == _tokens(want) == _tokens(plain)
    assert sum(engine.spec_decode_stats["acceptance_histogram"][1:]) > 0
    for a, b in zip(got, want):
        for x, y in zip(a.outputs, b.outputs):
            assert x.spec_decode_stats == y.spec_decode_stats
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4


def test_graph_sampling_equals_eager_in_deterministic_mode(model):
    """Seeded temperature-1 sampling: with batch-invariant kernels the padded graph step draws the eager
    step's tokens, drafts and acceptances."""
    prompts = _prompts(3, seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, n=2, seed=9)
    engine = _engine(model, deterministic=True)
    graphs = engine.runner.spec.graphs
    graphs.capture_all(6, [0, 3])
    assert {(s, d) for s in (1, 2, 4, 8) for d in (0, 3)} == set(graphs.graphs)
    got = engine.generate(prompts, params)
    assert sum(graphs.num_steps.values()) > 0
    assert sum(engine.spec_decode_stats["acceptance_histogram"][1:]) > 0
    want = _engine(model, deterministic=True, enforce_eager=True).generate(prompts, params)
    assert _tokens(got) == _tokens(want)
    stats = [[[o.spec_decode_stats for o in r.outputs] for r in outs] for outs in (got, want)]
    assert stats[0] == stats[1]


def test_graphs_follow_drafter_replacement_and_skip_truncation(model):
    """A replaced drafter (EAGLE-3 aux inputs) is recaptured; top-p rows run eagerly; greedy output stays the
    plain one."""
    from runner.spec_decode.drafter import new_drafter

    prompts = _prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(_engine(model, spec=False).generate(prompts, params))
    engine = _engine(model)
    assert _tokens(engine.generate(prompts, params)) == want
    r, graphs = engine.runner, engine.runner.spec.graphs
    assert graphs.graphs
    r.spec.replace_drafter(new_drafter("eagle", r.model_config, r.dtype, r.device, r.backend, aux_layers=[0, 1]))
    assert not graphs.graphs
    assert _tokens(engine.generate(prompts, params)) == want
    assert graphs.graphs
    before = sum(graphs.num_steps.values())
    engine.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=1))
    assert sum(graphs.num_steps.values()) == before


def test_auto_sized_kv_cache_counts_the_speculative_graphs(model):
    """KV sizing captures the largest speculative graph (and releases it); the engine then runs within its
    share of the device."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    engine = _engine(model, max_num_seqs=64, num_kv_blocks=None, gpu_memory_utilization=0.3)
    assert not engine.runner.spec.graphs.graphs  # the probe's graph is gone
    out = engine.generate(_prompts(64, seed=4), SamplingParams(max_tokens=24, ignore_eos=True, seed=0))
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.3 * total + 2**30  # within its share, give or take the allocator's slack
