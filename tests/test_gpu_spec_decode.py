"""GPU speculative decoding (skipped without CUDA): graph-captured uniform steps against the eager runner
(`enforce_eager=True`) and against plain greedy decoding, and the KV-cache sizing of a speculative engine."""

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
    assert (16, 3, False) in graphs.graphs and graphs.num_steps[(16, 3, False)] > 0
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
    assert {(s, d, False) for s in (1, 2, 4, 8) for d in (0, 3)} == set(graphs.graphs)
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


# ---- KV-cache sizing -------------------------------------------------------------------------------------
# A model whose speculative graphs and drafter are large enough to be many KV blocks: vocabulary 2**18, so the
# vocabulary-wide buffers of the largest graph (batch P = 512, k = 3 drafts, float32) are the target logits
# [P * (k + 1), V] (2 GiB), the draft distributions q [P, k, V] (1.5 GiB) and one drafter logits [P, V]
# (0.5 GiB): about 4 GiB of graph pool, ~87k blocks of 48 KiB, against ~0.5 GiB for the plain decode graph of
# the same batch. Hidden 512 / intermediate 8192, so the EAGLE drafter (fc + one decoder layer) holds 52.5 MiB
# of weights. Tied embeddings keep the checkpoint at ~0.6 GiB.
WIDE = dict(vocab_size=2**18, hidden_size=512, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=1024)
WIDE_SEQS = 512


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpu_spec_wide"), "qwen2", seed=7, **WIDE)


def _used_bytes() -> int:
    """Device bytes in use, after this process's unused cached blocks went back to the driver."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_auto_sized_kv_cache_counts_the_drafter_and_the_speculative_graphs(wide_model):
    """The auto-sized KV cache leaves room for the drafter's weights and KV, and for every speculative graph.

    Sizing fills `gpu_memory_utilization * total` with what is resident when the cache is sized (weights,
    drafter, buffers, context, other processes), the KV cache, and a reserve for what comes later (the
    activation peak and the graphs). So after start-up `reserve = utilization * total - in use` is that
    reserve whatever the device held before: activation peak + counted graph bytes + under one block + the
    KV tensors' rounding to 2 MiB segments (<= 6 x 2 MiB).

    1. The speculative engine with enforce_eager against the plain eager engine: both profile the same step,
       so the speculative engine's reserve is no more than 16 MiB below the plain one's (rounding and one
       block). Drafter weights loaded after the sizing would take their 52.5 MiB out of the speculative
       engine's reserve; drafter KV left out of the per-block bytes would take a third of its KV cache (GiBs)
       out of it. Above, it may be up to 64 MiB larger: more KV tensors (the drafter's) round to more 2 MiB
       segments and a block more is left over (18 MiB was seen on an H200); more would be memory wasted.
    2. The graph-capturing engine, once it has captured every speculative graph (every batch size, 0..k
       drafts), must still have the eager engine's reserve (the activation peak) left, within 512 MiB. The
       sizing counts the largest graph by capturing it (`probe_bytes`: its pool, the warm-up runs' cached
       blocks and the capture stream's cuBLAS workspace); every later graph shares its pool and its one
       capture stream. With the speculative graphs left out (only the plain decode graph's ~1 GiB counted)
       the engine would end >= 2 GiB short of the bound. With a fresh side stream per capture it ended 1.1 GiB
       short on an H200: a ~32 MiB cuBLAS workspace left behind per pooled stream is the likely cause.
    Device memory at utilization 0.2 on an H200 (139 GiB): ~28 GiB per engine, one engine alive at a time.
    """
    util = 0.2
    kw = dict(max_num_seqs=WIDE_SEQS, num_kv_blocks=None, gpu_memory_utilization=util, gc_freeze=False)
    budget = int(util * torch.cuda.mem_get_info()[1])

    # 1. the drafter's weights and KV
    eager = _engine(wide_model, enforce_eager=True, **kw)
    r = eager.runner
    assert r.spec.graphs is None
    kv = [t for pair in r.kv_caches for t in pair] + list(r.spec.kv_cache)
    assert sum(t.numel() * t.element_size() for t in kv) == eager.num_kv_blocks * r.kv_bytes_per_block()
    drafter_bytes = sum(p.numel() * p.element_size() for p in r.spec.drafter.parameters())
    eager_reserve = budget - _used_bytes()
    eager.close()
    del eager, r, kv
    plain = _engine(wide_model, spec=False, enforce_eager=True, **kw)
    plain_reserve = budget - _used_bytes()
    plain.close()
    del plain
    tol, waste = 16 * 2**20, 64 * 2**20
    assert drafter_bytes > 3 * tol  # the model keeps the check sharp
    assert -tol <= eager_reserve - plain_reserve <= waste, dict(eager=eager_reserve, plain=plain_reserve)

    # 2. the speculative graphs
    engine = _engine(wide_model, **kw)
    graphs = engine.runner.spec.graphs
    assert not graphs.graphs  # the probe's graph is gone
    before = _used_bytes()
    draft_counts = list(range(engine.runner.spec.k, -1, -1))  # largest first: the others reuse its pool
    graphs.capture_all(WIDE_SEQS, draft_counts)
    assert len(graphs.graphs) == len(graphs.sizes) * len(draft_counts)
    after = _used_bytes()
    tol = 512 * 2**20
    assert after - before > 4 * tol  # the model keeps the check sharp
    assert budget - after >= eager_reserve - tol, dict(left=budget - after, eager_reserve=eager_reserve,
                                                       graph_bytes=after - before)
    out = engine.generate(_prompts(64, vocab=WIDE["vocab_size"], seed=4),
                          SamplingParams(max_tokens=16, ignore_eos=True, seed=0))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out) and sum(graphs.num_steps.values()) > 0
    engine.close()


def test_graphs_with_adapters_equal_eager_and_plain_lora_decoding(model, tmp_path):
    """Rows with LoRA adapters (and rows without) through the captured speculative graphs' LoRA variant: the greedy
    tokens of the eager speculative runner and of the plain LoRA engine; a batch without adapter rows takes the
    variant without LoRA."""
    from test_lora_engine import write_adapter

    adapters = {name: write_adapter(model, tmp_path / name, seed=seed, r=4, lora_alpha=8)
                for name, seed in (("a", 1), ("b", 2))}
    loras = [None, "a", "b", "a", "b"]
    prompts = _prompts(len(loras), seed=3)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2, lora=lora) for lora in loras]

    def run(**kw):
        engine = _engine(model, max_loras=2, max_lora_rank=4, **kw)
        for name, path in adapters.items():
            engine.load_lora(name, str(path))
        return engine, engine.generate(prompts, params)

    engine, got = run()
    graphs = engine.runner.spec.graphs
    assert graphs.num_steps[(16, 3, True)] > 0
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert sum(n for (_, d, lora), n in graphs.num_steps.items() if d == 3 and not lora) > 0
    _, eager = run(enforce_eager=True)
    plain_engine, plain = run(spec=False)
    assert _tokens(got) == _tokens(eager) == _tokens(plain)
    unadapted = plain_engine.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert _tokens(unadapted)[0][0] != _tokens(got)[1][0]  # adapter a changes the tokens
    assert sum(engine.spec_decode_stats["acceptance_histogram"][1:]) > 0
