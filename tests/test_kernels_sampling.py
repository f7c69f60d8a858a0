"""Triton sampler against `sample_ref` (Triton interpreter on CPU, real vocab on CUDA).

Tokens must be identical to the reference's. Logits are random normals scaled so that no truncation
threshold falls on a floating-point tie (the only place the two may legitimately differ). Logprobs:
abs error <= 1e-5 on CPU, 1e-4 on CUDA (fast exp/log there; the reference runs on the CPU).
Neither sampler may ever pick a truncated token (logprob -inf).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.sampling import sample  # noqa: E402
from kernels.sampling_ref import sample_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _params(num_rows, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, device=DEVICE):
    """Per-row sampling tensors; each knob is a scalar or a list cycled over the rows."""

    def col(v, dtype):
        vals = v if isinstance(v, (list, tuple)) else [v]
        return torch.tensor([vals[i % len(vals)] for i in range(num_rows)], dtype=dtype, device=device)

    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**32, (num_rows,), generator=gen, dtype=torch.int64).to(device)
    positions = torch.randint(0, 4096, (num_rows,), generator=gen, dtype=torch.int64).to(device)
    return (col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32),
            col(min_p, torch.float32), seeds, positions)


def _logits(num_rows, vocab, *, dtype=torch.float32, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab, generator=gen) * scale).to(dtype).to(DEVICE)


def _check(logits, params, num_top_logprobs=0, atol=1e-5):
    ids, lps, top = sample(logits, *params, num_top_logprobs)
    ref_ids, ref_lps, ref_top = sample_ref(logits.cpu(), *(p.cpu() for p in params), num_top_logprobs)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32
    ids, lps = ids.cpu(), lps.cpu()
    assert torch.isfinite(lps).all() and torch.isfinite(ref_lps).all()
    mismatched = (ids != ref_ids).nonzero().flatten().tolist()
    assert not mismatched, f"rows {mismatched}: {ids[mismatched].tolist()} vs {ref_ids[mismatched].tolist()}"
    assert torch.allclose(lps, ref_lps, atol=atol, rtol=0), (lps - ref_lps).abs().max()
    if num_top_logprobs:
        top_ids, top_lps = top[0].cpu(), top[1].cpu()
        kept = torch.isfinite(ref_top[1])  # beyond the kept tokens, -inf ties come in any order
        # equal logits (common in bf16) may come in either order: compare the logits the ids point at
        raw = logits.cpu().float()
        assert torch.equal(raw.gather(1, top_ids)[kept], raw.gather(1, ref_top[0])[kept])
        assert torch.allclose(top_lps[kept], ref_top[1][kept], atol=atol, rtol=0)
        assert torch.isneginf(top_lps[~kept]).all()
    return ids


def test_greedy_takes_first_argmax_and_raw_logprob():
    logits = _logits(6, 200, seed=1)
    logits[0, 17] = logits[0, 150] = logits[0].max() + 1.0  # tie: the first index wins
    # truncation knobs must not affect greedy rows
    params = _params(6, temperature=0.0, top_k=[0, 3], top_p=[1.0, 0.5], min_p=[0.0, 0.3])
    ids = _check(logits, params)
    assert ids[0].item() == 17


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain_temperature_matches_ref(dtype):
    _check(_logits(48, 300, dtype=dtype, seed=2), _params(48, temperature=[1.0, 0.7, 1.3], seed=2))


def test_top_k_matches_ref():
    _check(_logits(24, 300, seed=3), _params(24, temperature=[1.0, 0.8], top_k=[1, 5, 50, 299, 300, 1000], seed=3))


def test_top_p_matches_ref():
    _check(_logits(24, 300, seed=4), _params(24, top_p=[0.0, 0.3, 0.9, 0.99], temperature=[1.0, 2.0], seed=4))


def test_min_p_matches_ref():
    _check(_logits(24, 300, seed=5), _params(24, min_p=[0.01, 0.1, 0.5, 1.0], seed=5))


def test_combined_truncation_and_top_logprobs_match_ref():
    params = _params(24, temperature=[0.0, 0.9, 1.2], top_k=[0, 20, 8, 40], top_p=[1.0, 0.8, 0.95],
                     min_p=[0.0, 0.05], seed=6)
    _check(_logits(24, 257, seed=6), params, num_top_logprobs=3)


def test_vocab_spanning_several_chunks():
    params = _params(4, temperature=[1.0, 0.5], top_k=[0, 100], top_p=[0.9, 1.0], seed=7)
    _check(_logits(4, 2500, seed=7), params, num_top_logprobs=2)


def test_seeded_row_does_not_depend_on_batch():
    logits = _logits(8, 300, seed=8)
    params = _params(8, top_k=[0, 30], top_p=[0.9, 1.0], seed=8)
    full, _, _ = sample(logits, *params)
    for row in (0, 5):
        alone, _, _ = sample(logits[row : row + 1], *(p[row : row + 1] for p in params))
        assert alone.item() == full[row].item()
    # another seed draws differently on at least one row
    other = list(params)
    other[4] = other[4] ^ 1
    assert not torch.equal(sample(logits, *other)[0], full)


def test_sample_rejects_misuse():
    logits = _logits(3, 50)
    params = _params(3)
    with pytest.raises(ValueError, match="logits"):
        sample(logits[0], *params)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, params[0][:2], *params[1:])
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, params[0], params[1].float(), *params[2:])
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, *params[:2], params[2].double(), *params[3:])
    with pytest.raises(ValueError, match="num_top_logprobs"):
        sample(logits, *params, 51)
    with pytest.raises(ValueError, match="vocab dimension"):
        sample(logits.t().contiguous().t(), *params)


# ---------------------------------------------------------------------------------------------- CUDA, real vocab


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_qwen_vocab_batch_256_matches_cpu_ref(dtype):
    num_rows, vocab = 256, 151936
    params = _params(num_rows, temperature=[1.0, 0.0, 0.7, 1.0], top_k=[0, 0, 50, 20], top_p=[1.0, 0.9, 0.95],
                     min_p=[0.0, 0.0, 0.05], seed=9)
    _check(_logits(num_rows, vocab, dtype=dtype, seed=9), params, num_top_logprobs=5, atol=1e-4)


@needs_cuda
def test_cuda_sampler_under_graph_capture():
    logits = _logits(64, 151936, dtype=torch.bfloat16, seed=10)
    params = _params(64, top_k=[0, 40], top_p=[0.9, 1.0], seed=10)
    expected, _, _ = sample(logits, *params)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, _, _ = sample(logits, *params)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids, expected)


@pytest.mark.parametrize("vocab", [300, 5000])
def test_token_logprobs_match_the_sampler_and_log_softmax(vocab):
    from kernels.sampling import sample_untruncated, token_logprobs

    logits = _logits(12, vocab, seed=4)
    temps = torch.tensor([1.0, 0.7, 0.0] * 4, device=DEVICE)
    params = _params(12, temperature=temps.tolist())
    ids, lps = sample_untruncated(logits, params[0], params[4], params[5])
    ours = token_logprobs(logits, ids, temps)
    assert torch.equal(ours, lps)  # the same chunk passes and the same merge
    ref = torch.log_softmax(logits.cpu().double() / torch.where(temps > 0, temps, 1.0).cpu()[:, None], -1)
    torch.testing.assert_close(ours.cpu().double(), ref.gather(1, ids.cpu()[:, None])[:, 0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(logits, ids.int(), temps)


@pytest.mark.parametrize("vocab", [300, 5000])
def test_untruncated_split_sampler_matches_the_reference(vocab):
    from kernels.sampling import sample_untruncated

    logits = _logits(9, vocab, seed=vocab)
    logits[0, 123] = logits[0, 4000 % vocab] = logits[0].max() + 2.0  # greedy tie: the first index wins
    params = _params(9, temperature=[0.0, 1.0, 0.8])
    ids, lps = sample_untruncated(logits, params[0], params[4], params[5])
    ref_ids, ref_lps, _ = sample_ref(logits.cpu(), *(p.cpu() for p in params))
    assert torch.equal(ids.cpu(), ref_ids)
    assert ids[0].item() == min(123, 4000 % vocab)
    torch.testing.assert_close(lps.cpu(), ref_lps, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="seeds"):
        sample_untruncated(logits, params[0], params[4][:3], params[5])
