"""Sampling correctness: distributions (chi-square), logprobs, and seed invariance.

Each chi-square test rejects at significance 1e-3, so a correct sampler fails one case with probability
1e-3; every test uses fixed seeds, so its outcome is reproducible run to run.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import load_hf
from kernels.sampling_ref import counter_uniform, sample_ref
from rollout import Engine, EngineConfig, SamplingParams

ALPHA = 1e-3


def expected_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The target distribution, written independently of the sampler: tempered softmax, then truncations."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k:
        keep[order[top_k:]] = False
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    if top_p < 1.0:
        mass, kept = 0.0, torch.zeros_like(keep)
        for i in order.tolist():
            if mass >= top_p:
                break
            kept[i] = keep[i]
            mass += float(q[i])
        keep &= kept
        q = torch.where(keep, q, 0.0)
        q = q / q.sum()
    if min_p > 0:
        keep &= q >= min_p * q.max()
        q = torch.where(keep, q, 0.0)
        q = q / q.sum()
    return q


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the allowed set"
    n = counts.sum().double()
    exp = probs[support] * n
    stat = ((counts[support].double() - exp) ** 2 / exp).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.12),
    dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampler_distribution_chi_square(case):
    vocab, num = 12, 40_000
    logits = torch.linspace(-2.0, 2.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    rows = logits.expand(num, vocab)
    full = lambda v, dt=torch.float32: torch.full((num,), v, dtype=dt)
    tokens, logprobs, _ = sample_ref(
        rows, full(case.get("temperature", 1.0)), full(case.get("top_k", 0), torch.int64),
        full(case.get("top_p", 1.0)), full(case.get("min_p", 0.0)),
        torch.arange(num, dtype=torch.int64) * 7919 + 11, torch.zeros(num, dtype=torch.int64),
    )
    probs = expected_probs(logits, **case)
    counts = torch.bincount(tokens, minlength=vocab)
    assert chi_square_pvalue(counts, probs) > ALPHA
    torch.testing.assert_close(logprobs.double(), probs.log()[tokens], atol=1e-5, rtol=1e-5)


def test_counter_noise_is_a_pure_function():
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    pos = torch.tensor([0, 5, 9], dtype=torch.int64)
    u = counter_uniform(seeds, pos, 50)
    assert torch.equal(u[1], counter_uniform(seeds[1:2], pos[1:2], 50)[0])  # row independent of the batch
    assert not torch.equal(u[0], counter_uniform(seeds[:1], pos[:1] + 1, 50)[0])  # position matters
    assert ((u > 0) & (u < 1)).all()
    big = counter_uniform(torch.arange(200, dtype=torch.int64), torch.zeros(200, dtype=torch.int64), 500)
    assert abs(big.mean().item() - 0.5) < 0.01  # 100k uniforms: sd of the mean ~ 0.001


def test_greedy_rows_take_argmax_with_raw_logprob():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    z = torch.zeros(5)
    tokens, logprobs, top = sample_ref(logits, z, z.long(), torch.ones(5), z, z.long(), z.long(), num_top_logprobs=3)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    assert torch.equal(top[0][:, 0], tokens)


@pytest.fixture(scope="module")
def tiny_vocab_model(ckpt_factory):
    return ckpt_factory("qwen3", vocab_size=16, seed=5, initializer_range=0.5)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.85), dict(top_k=5)])
def test_engine_samples_follow_model_distribution(tiny_vocab_model, params):
    engine = Engine(EngineConfig(model=str(tiny_vocab_model), dtype="float32", max_num_seqs=256, num_kv_blocks=512))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    n = 4000
    out = engine.generate([prompt], SamplingParams(n=n, max_tokens=1, seed=2024, ignore_eos=True, **params))[0]
    first = torch.tensor([o.token_ids[0] for o in out.outputs])
    with torch.no_grad():
        logits = load_hf(tiny_vocab_model)(torch.tensor([prompt])).logits[0, -1]
    probs = expected_probs(logits, **params)
    assert chi_square_pvalue(torch.bincount(first, minlength=16), probs) > ALPHA
    lps = torch.tensor([o.logprobs[0] for o in out.outputs], dtype=torch.float64)
    torch.testing.assert_close(lps, probs.log()[first], atol=1e-4, rtol=1e-4)


def test_seeded_request_is_batch_invariant(ckpt_factory):
    path = ckpt_factory("llama")
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    target = [9, 8, 7, 6, 5, 4, 3]

    def run(max_num_seqs, others):
        engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=max_num_seqs, num_kv_blocks=256))
        g = torch.Generator().manual_seed(others)
        batch = [torch.randint(2, 128, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(others)]
        prompts = batch[: others // 2] + [target] + batch[others // 2 :]
        plist = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * len(prompts)
        plist[others // 2] = params
        return engine.generate(prompts, plist)[others // 2]

    alone, crowded, narrow = run(8, 0), run(32, 16), run(3, 16)
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # the n samples differ
    for other in (crowded, narrow):
        for a, b in zip(alone.outputs, other.outputs):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert math.isfinite(sum(alone.outputs[0].logprobs))


# ---- the sampling-tensors struct and its persistent buffers -----------------------------------------------
def _struct(R: int, seed: int = 0):
    from runner.sampling_tensors import SamplingTensors

    g = torch.Generator().manual_seed(seed)
    return SamplingTensors(
        temperature=torch.rand(R, generator=g) + 0.5, top_k=torch.randint(0, 6, (R,), generator=g),
        top_p=torch.rand(R, generator=g) * 0.5 + 0.5, min_p=torch.rand(R, generator=g) * 0.2,
        seeds=torch.randint(0, 2**32, (R,), generator=g), positions=torch.randint(0, 100, (R,), generator=g),
        uses=(True, True, True), num_top_logprobs=2,
    )


def test_sampler_takes_the_struct_as_the_reference_takes_its_tensors():
    """Every field reaches the sampler in its place: each row uses all three truncations with different
    values, so a swapped field changes the tokens or logprobs."""
    from runner.sampler import Sampler

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    s = _struct(6)
    got = Sampler(torch.device("cpu"))(logits, s)
    want = sample_ref(logits, s.temperature, s.top_k, s.top_p, s.min_p, s.seeds, s.positions, 2)
    for x, y in zip(got[:2] + got[2], want[:2] + want[2]):
        assert torch.equal(x, y)


def test_sampling_tensors_slice_as_views_and_pad_with_declared_values():
    from runner.sampling_tensors import SamplingTensors

    s = _struct(5)
    head = s[:3]
    for name, _, _ in SamplingTensors.row_fields():
        full, part = getattr(s, name), getattr(head, name)
        assert part.data_ptr() == full.data_ptr() and torch.equal(part, full[:3])  # a view, no copy
    assert (head.uses, head.num_top_logprobs) == (s.uses, s.num_top_logprobs)
    picked = s[torch.tensor([4, 0])]
    assert torch.equal(picked.seeds, s.seeds[[4, 0]]) and picked.uses == s.uses
    assert s.padded(0) is s
    padded = s.padded(3)
    pads = {name: pad for name, _, pad in SamplingTensors.row_fields()}
    assert pads == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seeds": 0, "positions": 0}
    for name, dtype, pad in SamplingTensors.row_fields():
        x = getattr(padded, name)
        assert x.dtype == dtype and torch.equal(x[:5], getattr(s, name)) and (x[5:] == pad).all()


def test_step_buffers_hand_out_views_of_their_persistent_sampling_fields():
    """`StepBuffers.sampling(R)` reads the same memory on every call (what a captured graph relies on), the
    host staging of each struct field lands in it, and padding rows get the struct's pad values."""
    from runner.sampling_tensors import SamplingTensors
    from runner.step_buffers import StepBuffers

    b = StepBuffers(max_tokens=32, max_num_seqs=8, max_blocks=4, device=torch.device("cpu"))
    first, again = b.sampling(8), b.sampling(4, (False, False, False), 3)
    assert (again.uses, again.num_top_logprobs) == ((False, False, False), 3)
    for i, (name, dtype, pad) in enumerate(SamplingTensors.row_fields()):
        host = getattr(b.host.sampling, name)
        host[:] = i + 2
        assert getattr(first, name).dtype == dtype and (getattr(first, name) == i + 2).all()
        assert getattr(again, name).data_ptr() == getattr(first, name).data_ptr()
    b.positions[:] = -1  # the token positions are their own field, apart from the sampled rows' positions
    assert (first.positions == [n for n, _, _ in SamplingTensors.row_fields()].index("positions") + 2).all()
    b.pad_sampling(2, 6)
    for i, (name, _, pad) in enumerate(SamplingTensors.row_fields()):
        x = getattr(first, name)
        assert (x[2:6] == pad).all() and (x[:2] == i + 2).all() and (x[6:] == i + 2).all()
