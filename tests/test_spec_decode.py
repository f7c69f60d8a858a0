"""Speculative decoding: exact rejection sampling, engine integration, drafters, stats and auto-off.

Statistical tests use fixed seeds (so they are deterministic); each states the false-positive rate it
would have under fresh randomness: a chi-square p-value threshold of 1e-3 (FPR 0.1% per test).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

if not torch.cuda.is_available():  # the Triton kernels of rejection_kernel.py run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from runner.spec_decode.controller import SpecController
from runner.spec_decode.drafter import save_drafter
from runner.sampling_tensors import SamplingTensors
from runner.spec_decode.rejection import rejection_sample, sample_draft
from runner.testing import write_random_checkpoint

P_THRESHOLD = 1e-3  # false-positive rate of each chi-square test


def chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_vs_probs(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts [V] against probabilities [V] (cells with expected count < 5 pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def chi2_two_sample(a: Counter, b: Counter) -> float:
    """p-value of the chi-square homogeneity test of two samples over the same outcomes (rare cells pooled)."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    rows, rare = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 10:
            rows.append((a[k], b[k]))
        else:
            rare[0] += a[k]
            rare[1] += b[k]
    if sum(rare):
        rows.append(tuple(rare))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return chi2_sf(stat, len(rows) - 1)


# ---- the rejection sampler alone ------------------------------------------------------------------------
def _synthetic(V=6, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_logits = torch.randn(K, V, generator=g) * 1.5
    return p_logits, q_logits


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rejection_sampler_matches_target_distribution(temperature, top_p):
    V, K, N = 6, 2, 20000
    p_logits, q_logits = _synthetic(V, K)
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + 11
    positions = torch.full((N,), 5, dtype=torch.int64)
    temp, top_k, tp, min_p = (torch.full((N,), temperature), torch.zeros(N, dtype=torch.int64),
                              torch.full((N,), top_p), torch.zeros(N))
    sampling = SamplingTensors(temperature=temp, top_k=top_k, top_p=tp, min_p=min_p, seeds=seeds, positions=positions)
    drafts, qs = [], []
    for j in range(K):
        tok, q = sample_draft(q_logits[j].expand(N, V), sampling.replace(positions=positions + j))
        drafts.append(tok)
        qs.append(q)
    out, num_acc, logprobs, _ = rejection_sample(
        p_logits.expand(N, K + 1, V), torch.stack(drafts, 1), torch.stack(qs, 1), torch.full((N,), K), sampling,
    )
    from kernels.sampling_ref import processed_logits_ref

    p = torch.softmax(processed_logits_ref(p_logits, torch.full((K + 1,), temperature), torch.zeros(K + 1, dtype=torch.int64),
                                           torch.full((K + 1,), top_p), torch.zeros(K + 1)), -1)
    assert chi2_vs_probs(torch.bincount(out[:, 0], minlength=V), p[0]) > P_THRESHOLD
    second = out[num_acc >= 1, 1]  # produced whenever the first draft was accepted; independent of it here
    assert chi2_vs_probs(torch.bincount(second, minlength=V), p[1]) > P_THRESHOLD
    # acceptance rate of the first draft is sum_x min(p, q)
    q0 = qs[0][0]
    assert abs(float((num_acc >= 1).float().mean()) - float(torch.minimum(p[0], q0).sum())) < 0.02
    # logprobs are under p
    assert torch.allclose(logprobs[:, 0], torch.log(p[0][out[:, 0]]), atol=1e-5)
    assert (out[torch.arange(N), num_acc] >= 0).all() and (num_acc <= K).all()


def test_rejection_sampler_greedy_and_no_drafts():
    V, K = 8, 3
    logits = torch.randn(2, K + 1, V)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # row 1: second draft wrong
    ones = torch.ones(2)
    zeros_i = torch.zeros(2, dtype=torch.int64)
    greedy = SamplingTensors(temperature=torch.zeros(2), top_k=zeros_i, top_p=ones, min_p=torch.zeros(2),
                             seeds=zeros_i, positions=zeros_i)
    out, num_acc, _, _ = rejection_sample(logits, drafts, torch.full((2, K, V), 1.0 / V), torch.tensor([K, K]), greedy)
    assert num_acc.tolist() == [K, 1]
    assert out[0].tolist() == argmax[0].tolist()
    assert out[1, :2].tolist() == argmax[1, :2].tolist() and out[1, 2:].tolist() == [-1, -1]
    # no drafts: exactly the ordinary sampler
    from kernels.sampling_ref import sample_ref

    seeds, pos = torch.tensor([3, 4]), torch.tensor([0, 9])
    sampled = SamplingTensors(temperature=ones, top_k=zeros_i, top_p=ones, min_p=torch.zeros(2), seeds=seeds,
                              positions=pos)
    out, num_acc, lp, _ = rejection_sample(logits[:, :1], drafts[:, :0], torch.zeros(2, 0, V), zeros_i, sampled)
    ref_tok, ref_lp, _ = sample_ref(logits[:, 0], ones, zeros_i, ones, torch.zeros(2), seeds, pos)
    assert out[:, 0].tolist() == ref_tok.tolist() and torch.allclose(lp[:, 0], ref_lp)


def test_untruncated_processing_equals_the_reference():
    from kernels.sampling_ref import processed_logits_ref
    from runner.spec_decode.rejection import NO_TRUNCATION, processed_logits

    logits = torch.randn(5, 11, dtype=torch.bfloat16)
    temp = torch.tensor([0.0, 0.5, 1.0, 1.3, 2.0])
    args = (temp, torch.zeros(5, dtype=torch.int64), torch.ones(5), torch.zeros(5))
    assert torch.equal(processed_logits(logits, *args, NO_TRUNCATION), processed_logits_ref(logits, *args))


# ---- the Triton kernels against the torch reference ------------------------------------------------------
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


_LOG_ZERO = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0) = -inf


@_LOG_ZERO
@pytest.mark.parametrize("vocab,chunk", [
    (37, 2048),  # one chunk, one masked block
    (37, 16),  # three chunks, the last one partial
    (5000, 2048),  # three chunks of two blocks of 1024, the last one partial
])
def test_kernels_equal_the_reference(vocab, chunk):
    """`rejection_kernel.py` against `sample_draft_ref` / `rejection_sample_ref`: the same draft tokens,
    acceptances, resampled and bonus tokens; q (normalized over the whole row) and logprobs to float
    rounding. Rows: greedy and tempered, 0..K drafts, drafters close to the target (many acceptances, bonus
    tokens), an unnormalized q = 2p (all-zero residuals: the fallback to p), strided draft ids as the graph
    step passes them, a greedy row whose maximum is tied in the first and the last chunk (first index), a
    sampled row with -inf logits (whole chunks of them at chunk 16)."""
    from runner.spec_decode import rejection_kernel
    from runner.spec_decode.rejection import (
        ACCEPT_SALT,
        DRAFT_SALT,
        RESAMPLE_SALT,
        rejection_sample_ref,
        sample_draft_ref,
    )

    dev, R, K = KERNEL_DEVICE, 48, 3
    g = torch.Generator().manual_seed(vocab)
    target = torch.randn(R, K + 1, vocab, generator=g) * 2
    closeness = torch.tensor([0.0, 0.05, 0.5, 3.0]).repeat(R // 4)[:, None, None]
    draft_logits = target[:, :K] + closeness * torch.randn(R, K, vocab, generator=g)
    for logits in (target, draft_logits):  # row 0 is greedy
        logits[0, :, [3, vocab - 1]] = 20.0
    target[13, :, -16:] = float("-inf")  # a sampled row's masked tokens (whole chunks at chunk = 16)
    draft_logits[13, :, :16] = float("-inf")
    target, draft_logits = target.to(dev), draft_logits.to(dev)
    temperature = torch.tensor([0.0, 1.0, 0.6, 1.7], device=dev).repeat_interleave(R // 4)
    seeds = torch.randint(0, 2**32, (R,), generator=g).to(dev)
    positions = torch.randint(0, 5000, (R,), generator=g).to(dev)
    num_drafts = torch.tensor([K, K, K, 0, 1, 2], device=dev).repeat(R // 6)
    sampling = SamplingTensors(temperature=temperature, top_k=torch.zeros(R, dtype=torch.int64, device=dev),
                               top_p=torch.ones(R, device=dev), min_p=torch.zeros(R, device=dev), seeds=seeds,
                               positions=positions)

    ids = torch.zeros(R, K + 1, dtype=torch.int64, device=dev)
    q = torch.empty(R, K, vocab, device=dev)
    for j in range(K):
        want_tokens, want_q = sample_draft_ref(draft_logits[:, j], sampling.replace(positions=positions + j))
        rejection_kernel.draft_sample(draft_logits[:, j].contiguous(), temperature, seeds, positions, j, ids[:, j + 1],
                                      q[:, j], DRAFT_SALT, chunk=chunk)
        assert torch.equal(ids[:, j + 1], want_tokens)
        torch.testing.assert_close(q[:, j], want_q, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(q[:, j].sum(-1), torch.ones(R, device=dev), rtol=0, atol=1e-5)
    assert ids[0, 1:].tolist() == [3] * K
    drafts = ids[:, 1:]
    q[R // 2 :: 4] = 2 * torch.softmax(target[R // 2 :: 4, :K].float() / temperature[R // 2 :: 4, None, None], -1)

    want = rejection_sample_ref(target, drafts, q, num_drafts, sampling)
    got = rejection_kernel.rejection_sample(target, drafts, q, num_drafts, temperature, seeds, positions, ACCEPT_SALT,
                                            RESAMPLE_SALT, chunk=chunk)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    valid = got[0] >= 0
    torch.testing.assert_close(got[2][valid], want[2][valid], rtol=0, atol=1e-5)
    rejected = got[1] < num_drafts
    sampled = temperature > 0
    # every path taken: greedy stops, resampling (with and without the fallback), bonus tokens
    assert (rejected & sampled).sum() > 4 and (~rejected & sampled & (num_drafts == K)).sum() > 2
    assert (rejected & sampled)[R // 2 :: 4].any() and (~rejected & ~sampled & (num_drafts == K)).any()

    no_drafts = rejection_kernel.rejection_sample(target[:, :1], drafts[:, :0], q[:, :0], num_drafts * 0, temperature,
                                                  seeds, positions, ACCEPT_SALT, RESAMPLE_SALT, chunk=chunk)
    want = rejection_sample_ref(target[:, :1], drafts[:, :0], q[:, :0], num_drafts * 0, sampling)
    assert torch.equal(no_drafts[0], want[0]) and not no_drafts[1].any()
    torch.testing.assert_close(no_drafts[2], want[2], rtol=0, atol=1e-5)


# ---- the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """Vocabulary 4, so the distribution of whole 4-token completions (256 outcomes) can be tested."""
    return write_random_checkpoint(tmp_path_factory.mktemp("v4"), vocab_size=4, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, std=0.5)


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("v64"), vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, std=0.3)


def make_engine(path, spec: SpeculativeConfig | None = None, **kw):
    args = dict(model=str(path), dtype="float32", max_num_seqs=64, num_kv_blocks=256, block_size=4)
    args.update(kw)
    engine = Engine(EngineConfig(**args, speculative=spec))
    if engine.spec_controller is not None:
        engine.spec_controller.auto_off = False
    return engine


def sample_sequences(engine, params_kw: dict, num: int) -> Counter:
    params = [SamplingParams(seed=1000 + i, max_tokens=4, ignore_eos=True, **params_kw) for i in range(num)]
    outs = engine.generate([[2, 3, 1]] * num, params)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.mark.parametrize("params_kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_speculative_sequences_have_the_target_distribution(small_vocab_model, params_kw):
    torch.set_num_threads(1)
    num = 3000
    plain = sample_sequences(make_engine(small_vocab_model), params_kw, num)
    engine = make_engine(small_vocab_model, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    spec = sample_sequences(engine, params_kw, num)
    stats = engine.spec_decode_stats
    hist = stats["acceptance_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # both rejections and acceptances were exercised
    assert chi2_two_sample(plain, spec) > P_THRESHOLD


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_greedy_equals_plain_greedy(model64, method):
    prompts = [[3, 4, 5, 6, 7], [9, 10], [11] * 9]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    plain = make_engine(model64).generate(prompts, params)
    spec = make_engine(model64, SpeculativeConfig(method=method, num_speculative_tokens=3)).generate(prompts, params)
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4


def test_seeded_output_is_batch_invariant_and_reproducible(model64):
    engine = make_engine(model64, SpeculativeConfig(method="eagle", num_speculative_tokens=4))
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=5)
    alone = engine.generate([[7, 8, 9]], params)[0]
    crowd = engine.generate([[1, 2], [7, 8, 9], [4] * 6], params)[1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in crowd.outputs]
    assert len({tuple(o.token_ids) for o in alone.outputs}) == 3  # the n samples differ
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_preemption_and_prefix_sharing_keep_greedy_output(model64):
    prompts = [list(range(5, 5 + 10)), list(range(20, 27))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=3)
    want = make_engine(model64).generate(prompts, params)
    engine = make_engine(model64, SpeculativeConfig(method="eagle", num_speculative_tokens=4), num_kv_blocks=20)
    got = engine.generate(prompts, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in want]
    assert got[0].num_cached_prompt_tokens > 0


def test_stats_opt_out_and_top_logprobs(model64):
    engine = make_engine(model64, SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    on, off = engine.generate([[3, 4], [3, 4]], [SamplingParams(max_tokens=10, ignore_eos=True, top_logprobs=2, seed=1),
                                                  SamplingParams(max_tokens=10, ignore_eos=True, speculative=False)])
    s = on.outputs[0].spec_decode_stats
    # k = 2 drafts per step, fewer only near max_tokens
    assert s["num_spec_steps"] > 0 and s["num_spec_steps"] < s["num_draft_tokens"] <= 2 * s["num_spec_steps"]
    assert sum(s["acceptance_histogram"]) == s["num_spec_steps"]
    assert s["mean_acceptance_length"] == 1 + s["num_accepted_tokens"] / s["num_spec_steps"]
    assert off.outputs[0].spec_decode_stats["num_spec_steps"] == 0
    tops = on.outputs[0].top_logprobs
    assert len(tops) == 10 and all(len(t) == 2 for t in tops)
    for tok, lp, top in zip(on.outputs[0].token_ids, on.outputs[0].logprobs, tops):
        assert dict(top).get(tok, lp) == pytest.approx(lp, abs=1e-5)
    total = engine.spec_decode_stats
    assert total["num_spec_steps"] == s["num_spec_steps"] and "auto_off" in total


def test_drafter_save_load_roundtrip_and_errors(model64, tmp_path):
    engine = make_engine(model64, SpeculativeConfig(method="eagle", num_speculative_tokens=2))
    drafter = engine.runner.spec.drafter
    with torch.no_grad():
        drafter.fc.weight.mul_(1.5)
    path = save_drafter(drafter, tmp_path / "d")
    loaded = make_engine(model64, SpeculativeConfig(method="eagle", num_speculative_tokens=2, drafter=str(path)))
    assert torch.equal(loaded.runner.spec.drafter.fc.weight, drafter.fc.weight)
    with pytest.raises(ValueError, match="mtp"):
        make_engine(model64, SpeculativeConfig(method="mtp", drafter=str(path)))
    with pytest.raises(ValueError, match="config.json"):
        make_engine(model64, SpeculativeConfig(drafter=str(tmp_path / "missing")))


def test_eagle3_aux_layers(model64):
    from runner.spec_decode.drafter import new_drafter

    engine = make_engine(model64, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    r = engine.runner
    r.spec.replace_drafter(new_drafter("eagle", r.model_config, r.dtype, r.device, r.backend, aux_layers=[0, 1]))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = make_engine(model64).generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == want
    assert engine.spec_decode_stats["num_spec_steps"] > 0


def test_auto_off_controller():
    ctl = SpecController(4, probe_steps=2, reprobe_interval=100)
    assert ctl.lookahead(64) == 4  # no measurements yet: speculate
    for _ in range(2):  # probing alternates: spec, plain, spec, plain
        assert ctl.lookahead(64) == 4
        ctl.record(64, True, num_tokens=64 * 2, seconds=1.0)  # 128 tok/s with speculation
        assert ctl.lookahead(64) == 0
        ctl.record(64, False, num_tokens=64, seconds=0.25)  # 256 tok/s without
    assert ctl.lookahead(64) == 0 and ctl.lookahead(100) == 0  # same bucket [64, 128)
    assert ctl.stats()[64]["speculating"] is False
    assert ctl.lookahead(1) == 4  # other buckets unaffected
    ctl.auto_off = False
    assert ctl.lookahead(64) == 4


def test_auto_off_one_slow_step_does_not_decide():
    """A mode's rate is mean tokens per step over the median step time of its last probe_steps steps: a
    single 50x pause (a collector run) in the speculating window leaves speculation the winner."""
    ctl = SpecController(4, probe_steps=5, reprobe_interval=20)
    for i in range(5):
        ctl.record(1, True, num_tokens=3, seconds=0.05 if i == 2 else 0.001)  # ~3000 tok/s, one 50 ms step
        ctl.record(1, False, num_tokens=1, seconds=0.0007)  # ~1430 tok/s
    stats = ctl.stats()[1]
    assert stats["tokens_per_s_spec"] == 3000.0 and stats["speculating"] is True


def test_auto_off_decides_only_from_side_by_side_probes():
    """Slow speculating steps after the choice (the host got busy) do not turn speculation off against the
    other mode's older measurements; the next probe phase, which sees both modes under the same
    conditions, decides again."""
    ctl = SpecController(4, probe_steps=2, reprobe_interval=10)
    for _ in range(2):
        ctl.record(1, True, num_tokens=4, seconds=0.001)
        ctl.record(1, False, num_tokens=1, seconds=0.0007)
    for _ in range(6):  # steps 4..9: the host is 10x slower
        assert ctl.lookahead(1) == 4
        ctl.record(1, True, num_tokens=4, seconds=0.01)
    assert ctl.lookahead(1) == 4  # step 10: a probe phase opens, spec first
    ctl.record(1, True, num_tokens=4, seconds=0.01)
    assert ctl.lookahead(1) == 0
    ctl.record(1, False, num_tokens=1, seconds=0.007)  # the slow host slows plain steps too
    ctl.record(1, True, num_tokens=4, seconds=0.01)
    ctl.record(1, False, num_tokens=1, seconds=0.007)
    assert ctl.lookahead(1) == 4  # 400 vs 143 tok/s side by side: speculation stays on
    for _ in range(6):
        ctl.record(1, True, num_tokens=1, seconds=0.01)  # acceptance collapses (policy drift)
    for _ in range(2):  # the next probe phase sees it
        ctl.record(1, True, num_tokens=1, seconds=0.01)
        ctl.record(1, False, num_tokens=1, seconds=0.007)
    assert ctl.lookahead(1) == 0 and ctl.stats()[1]["speculating"] is False
    with pytest.raises(ValueError, match="reprobe_interval"):
        SpecController(4, probe_steps=4, reprobe_interval=8)


def test_engine_auto_off_turns_speculation_off_when_it_loses(model64):
    engine = make_engine(model64, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    engine.spec_controller = SpecController(3, probe_steps=2)
    engine.generate([[3, 4, 5]] * 4, SamplingParams(max_tokens=30, ignore_eos=True, seed=0))
    bucket = engine.spec_decode_stats["auto_off"][4]
    # an untrained drafter accepts almost nothing, so plain decoding is faster
    assert bucket["tokens_per_s_plain"] > 0 and bucket["tokens_per_s_spec"] > 0
    assert bucket["speculating"] is (bucket["tokens_per_s_spec"] >= bucket["tokens_per_s_plain"])


def test_auto_off_is_a_config_field(model64):
    for flag in (True, False):
        args = dict(model=str(model64), dtype="float32", max_num_seqs=8, num_kv_blocks=64, block_size=4)
        engine = Engine(EngineConfig(**args, speculative=SpeculativeConfig(method="mtp", auto_off=flag)))
        assert engine.spec_controller.auto_off is flag


# ---- the static-shape (graph) step, run eagerly on the CPU ------------------------------------------------------
def static_engine(path, spec: SpeculativeConfig, **kw):
    """An engine whose uniform decode steps take the static-shape path of graphs.py (run eagerly here)."""
    from runner.spec_decode.graphs import SpecDecodeGraphs

    engine = make_engine(path, spec, **kw)
    engine.runner.spec.graphs = SpecDecodeGraphs(engine.runner.spec, capture=False)
    return engine


@pytest.mark.parametrize("deterministic", [False, True])
def test_static_step_equals_eager_step(small_vocab_model, deterministic):
    """Padded uniform steps (6 rows -> capture size 8) give the eager runner's tokens and acceptance counts:
    greedy and temperature-1 rows, n = 2, and a batch with a row that opted out (run eagerly). Logprobs are
    bitwise equal in deterministic mode; otherwise the padded batch and the attention grid sized for
    max_model_len change float rounding (~1e-6)."""
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
    kw = dict(max_model_len=64, deterministic=deterministic)
    prompts = [[2, 3, 1], [1, 1], [3, 0, 2, 2, 1]]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2),
              SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, n=2, seed=7),
              SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, n=2, seed=8)]
    opted_out = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=9, speculative=False)]

    def run(engine):
        outs = engine.generate(prompts, params) + engine.generate(prompts[:2], params[1:2] + opted_out)
        return [o for r in outs for o in r.outputs]

    static = static_engine(small_vocab_model, spec, **kw)
    got = run(static)
    want = run(make_engine(small_vocab_model, spec, **kw))
    assert [(o.token_ids, o.spec_decode_stats) for o in got] == [(o.token_ids, o.spec_decode_stats) for o in want]
    for x, y in zip(got, want):
        if deterministic:
            assert x.logprobs == y.logprobs
        else:
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
    graphs = static.runner.spec.graphs
    assert graphs.num_steps[(8, 3, False)] > 0
    hist = static.spec_decode_stats["acceptance_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # rejections and acceptances both exercised


def test_static_step_without_drafts_and_greedy_parity(model64):
    """Look-ahead 0 (auto-off's plain steps) through the static path, and greedy speculation through it
    equal to plain greedy decoding."""
    prompts = [[3, 4, 5, 6, 7], [9, 10], [11] * 9]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2)
    plain = make_engine(model64, max_model_len=64).generate(prompts, params)
    for k in (0, 3):
        engine = static_engine(model64, SpeculativeConfig(method="mtp", num_speculative_tokens=3), max_model_len=64)
        engine.spec_controller.k = k
        outs = engine.generate(prompts, params)
        assert engine.runner.spec.graphs.num_steps[(8, k, False)] > 0
        for a, b in zip(plain, outs):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4


# ops that wait for the device or make a host constant (not allowed in a CUDA graph capture)
_SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.lift_fresh", "aten.masked_select",
             "aten.repeat_interleave.Tensor", "aten.unique")
# CPU references of what runs as Triton kernels on CUDA (AttentionBackend, Sampler): their syncs are CPU-only
_CPU_ONLY = {"store_kv_ref", "plan_paged_attention", "paged_attention_ref", "sample_ref"}


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_static_step_has_no_host_sync(small_vocab_model, num_drafts):
    """Everything the graph captures outside the CPU reference kernels is free of host syncs and host
    constants (checked on the ops the CPU run dispatches)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.syncs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith(_SYNC_OPS):
                names = {frame.name for frame in traceback.extract_stack()}
                if not names & _CPU_ONLY:
                    self.syncs.append((str(func), traceback.format_stack(limit=6)))
            return func(*args, **(kwargs or {}))

    engine = static_engine(small_vocab_model, SpeculativeConfig(method="eagle", num_speculative_tokens=3),
                           max_model_len=64)
    graphs = engine.runner.spec.graphs
    graphs._fill_padding(0, 4, num_drafts)
    engine.runner.buffers.upload(4)
    with Recorder() as rec:
        graphs.static_step(4, num_drafts)
    assert not rec.syncs, rec.syncs[0]


@_LOG_ZERO
def test_static_step_with_kernels_equals_eager_step(small_vocab_model, monkeypatch):
    """The static step with the Triton draft and rejection kernels (as on CUDA) against the eager runner on
    the torch reference: the same tokens and acceptances, logprobs to float rounding."""
    from runner.spec_decode import rejection

    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    prompts = [[2, 3, 1], [1, 1], [3, 0, 2, 2, 1]]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=2, seed=7),
              SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=8)]
    want = [o for r in make_engine(small_vocab_model, spec, max_model_len=64).generate(prompts, params) for o in r.outputs]
    monkeypatch.setattr(rejection, "use_kernels", lambda device: True)
    engine = static_engine(small_vocab_model, spec, max_model_len=64)
    got = [o for r in engine.generate(prompts, params) for o in r.outputs]
    assert engine.runner.spec.graphs.num_steps[(4, 3, False)] > 0
    assert [(o.token_ids, o.spec_decode_stats) for o in got] == [(o.token_ids, o.spec_decode_stats) for o in want]
    for x, y in zip(got, want):
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
    hist = engine.spec_decode_stats["acceptance_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0


# CPU references of kernels the model runs on CUDA (one launch each there)
_REFERENCE_KERNELS = _CPU_ONLY | {"rms_norm_ref", "fused_add_rms_norm_ref", "apply_rotary_heads", "apply_rotary_cos_sin",
                                  "rotary_cos_sin", "silu_and_mul_ref"}
_MODEL_OPS = ("aten.linear.", "aten.embedding.")


@_LOG_ZERO
@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_static_step_launches(small_vocab_model, monkeypatch, method):
    """With the Triton kernels on, the graph step launches nothing besides the models' linears, embeddings
    and kernels but this short list (each op one launch on CUDA): the drafter state gather, one stack of the
    look-ahead positions / context lengths / KV slots, the drafter's input cat per look-ahead step and in the
    catch-up, the next-token clamp and stop index after verification, and the drafter state scatter. Before
    the kernels, sampling and rejection took ~100 launches per draft step and ~190 for verification."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runner.spec_decode import rejection

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if func._schema.is_mutable or not any(  # views and no-op conversions alias their input
                    isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)
                    and a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for a in args):
                frame = sys._getframe()
                while frame is not None and frame.f_code.co_name not in _REFERENCE_KERNELS and \
                        not frame.f_code.co_filename.endswith("rejection_kernel.py"):  # the interpreter's copies
                    frame = frame.f_back
                if frame is None and not name.startswith(_MODEL_OPS) and not name.startswith("aten.empty"):
                    self.ops[name] += 1
            return out

    monkeypatch.setattr(rejection, "use_kernels", lambda device: True)
    engine = static_engine(small_vocab_model, SpeculativeConfig(method=method, num_speculative_tokens=4),
                           max_model_len=64)
    graphs = engine.runner.spec.graphs
    graphs._fill_padding(0, 2, 4)
    engine.runner.buffers.upload(2)
    graphs.static_step(2, 4)  # makes the step's constants
    with Recorder() as rec:
        graphs.static_step(2, 4)
    assert rec.ops == {"aten.index.Tensor": 2, "aten.stack.default": 1, "aten.cat.default": 4, "aten.clamp.default": 1,
                       "aten.add.Tensor": 1, "aten.index_put_.default": 1}, rec.ops
