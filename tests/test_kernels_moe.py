"""The fused MoE layer: the Triton kernels (interpreted on the CPU at tiny float32 shapes) and the torch
reference, both against a naive per-token loop in float64.

Tolerances: float32 results against the float64 loop within 2e-5 absolute + 1e-5 relative. Outputs and
their terms are O(1) (weights scaled by 1/sqrt(fan-in)) and each dot product has at most 64 terms, so
float32 rounding in any summation order stays near 64 * 2**-24 * O(1) ~ 4e-6. Batch invariance in
deterministic mode is checked bitwise. The interpreter has no bfloat16; tests/test_gpu_moe_kernels.py runs
bfloat16 at real shapes.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels.moe as moe  # noqa: E402
from kernels.moe import MoeConfig, fused_moe, moe_align_block_size, moe_config, moe_workspace_bytes  # noqa: E402
from kernels.moe_ref import fused_moe_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL, RTOL = 2e-5, 1e-5


def _routing(tokens, experts, top_k, gen, id_dtype=torch.int64, skew=0.0):
    """Softmax router, top-k, renormalised; `skew` > 0 sends most rows to the low expert ids."""
    logits = torch.randn(tokens, experts, generator=gen) - skew * torch.arange(experts, dtype=torch.float32)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(id_dtype).to(DEVICE)


def _problem(tokens, experts, top_k, hidden, inter, seed, id_dtype=torch.int64, skew=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE)
    return (x, w13, w2, *_routing(tokens, experts, top_k, gen, id_dtype, skew))


def _naive(x, w13, w2, topk_weights, topk_ids):
    """The oracle: token by token, choice by choice, in x's dtype."""
    inter = w13.shape[1] // 2
    outs = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e] @ x[t]
            acc = acc + topk_weights[t, j].to(x.dtype) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
        outs.append(acc)
    return torch.stack(outs) if outs else x.new_zeros(0, x.shape[1])


def _naive64(*args):
    return _naive(*(a.double() if a.is_floating_point() else a for a in args))


def _check_alignment(topk_ids, num_experts, block_m, sorted_ids, block_experts, num_padded):
    ids = topk_ids.reshape(-1).long().cpu()
    sorted_ids, block_experts = sorted_ids.cpu().long(), block_experts.cpu().long()
    rows = ids.numel()
    valid = (ids >= 0) & (ids < num_experts)
    counts = torch.bincount(ids[valid], minlength=num_experts)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == padded
    assert sorted_ids.numel() == -(-(rows + min(num_experts, rows) * (block_m - 1)) // block_m) * block_m
    assert block_experts.numel() == sorted_ids.numel() // block_m
    head = sorted_ids[:padded]
    real = head[head < rows]
    assert torch.equal(real.sort().values, torch.arange(rows)[valid])  # every valid (token, j) exactly once
    assert torch.all(head[head >= rows] == rows) and torch.all(sorted_ids[padded:] == rows)  # padding marked
    owners = block_experts[: padded // block_m]
    assert torch.all(block_experts[padded // block_m :] == -1)
    assert torch.all(owners[1:] >= owners[:-1]) and torch.all((owners >= 0) & (owners < num_experts))  # expert order
    for b, e in enumerate(owners.tolist()):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        members = block[block < rows]
        assert members.numel() > 0 and torch.all(ids[members] == e)  # one expert per block, no empty block
        assert torch.all(members[1:] > members[:-1])  # stable: each expert's rows in ascending order
    assert owners.unique().numel() == int((counts > 0).sum())


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,top_k,experts,block_m,skew", [
    (1, 2, 8, 16, 0.0),  # decode at batch 1: most experts get nothing
    (13, 3, 5, 4, 0.0),
    (40, 2, 6, 16, 2.0),  # skewed: several blocks for one expert
    (3, 1, 1, 16, 0.0),  # one expert
])
def test_align_block_size(id_dtype, tokens, top_k, experts, block_m, skew):
    _, ids = _routing(tokens, experts, top_k, torch.Generator().manual_seed(tokens), id_dtype, skew)
    _check_alignment(ids, experts, block_m, *moe_align_block_size(ids, experts, block_m))


@pytest.mark.parametrize("max_chunks", [128, 2])  # chunks of one step each; chunks of several steps
def test_align_block_size_counting_pass(monkeypatch, max_chunks):
    """Enough rows for the two-launch path (per-chunk counts, then placement), at tiny tiles."""
    monkeypatch.setattr(moe, "_TILE_ELEMENTS", 256)  # 16 experts padded -> 16-row steps
    monkeypatch.setattr(moe, "_MAX_CHUNKS", max_chunks)
    _, ids = _routing(37, 5, 3, torch.Generator().manual_seed(1), skew=1.0)
    _check_alignment(ids, 5, 4, *moe_align_block_size(ids, 5, 4))


def test_align_leaves_out_ids_outside_the_experts():
    ids = torch.tensor([[0, 3], [5, 1], [-1, 3]], device=DEVICE)  # 5 and -1 are no expert of 4
    sorted_ids, block_experts, num_padded = moe_align_block_size(ids, 4, 4)
    _check_alignment(ids, 4, 4, sorted_ids, block_experts, num_padded)
    assert 2 not in sorted_ids.tolist() and 4 not in sorted_ids.tolist()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 48, 40),  # T = 1: most experts idle
    (9, 6, 3, 32, 24),
    (21, 4, 2, 40, 16),
])
def test_fused_moe_matches_naive_loop(deterministic, id_dtype, tokens, experts, top_k, hidden, inter):
    args = _problem(tokens, experts, top_k, hidden, inter, seed=tokens + hidden, id_dtype=id_dtype)
    out = fused_moe(*args, deterministic=deterministic)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive64(*args), atol=ATOL, rtol=RTOL)


def test_fused_moe_with_small_tiles(monkeypatch):
    """Several column tiles, reduction steps, row blocks per expert and launch groups (with a partial
    last group), and experts that receive no rows."""
    small = MoeConfig(block_m=16, block_n=16, block_k=16, group_m=3, num_warps=4, num_stages=2)
    monkeypatch.setattr(moe, "moe_config", lambda *a, **kw: small)
    x, w13, w2, w, _ = _problem(24, 8, 2, 40, 36, seed=3)
    ids = torch.tensor([[1, 6]] * 19 + [[6, 1]] * 4 + [[2, 1]], device=DEVICE)  # experts 0, 3, 4, 5, 7 idle
    torch.testing.assert_close(fused_moe(x, w13, w2, w, ids).double(), _naive64(x, w13, w2, w, ids),
                               atol=ATOL, rtol=RTOL)


def test_fused_moe_on_strided_and_empty_inputs():
    x, w13, w2, w, ids = _problem(6, 4, 2, 32, 16, seed=5)
    wide = torch.cat([x, x], 1)[:, 32:]  # row stride 64
    torch.testing.assert_close(fused_moe(wide, w13, w2, w.t().contiguous().t(), ids.t().contiguous().t()).double(),
                               _naive64(x, w13, w2, w, ids), atol=ATOL, rtol=RTOL)
    assert fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, 32)
    assert fused_moe_ref(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, 32)


def test_fused_moe_deterministic_is_batch_invariant():
    args = _problem(20, 6, 2, 32, 24, seed=8)
    full = fused_moe(*args, deterministic=True)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 11), slice(19, 20)):
        part = fused_moe(*(a[rows] if a.dim() == 2 else a for a in args), deterministic=True)
        assert torch.equal(part, full[rows]), rows


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_ref_matches_naive_loop(deterministic, id_dtype):
    for tokens, experts, top_k in ((1, 8, 2), (11, 5, 3)):
        args = _problem(tokens, experts, top_k, 24, 20, seed=tokens, id_dtype=id_dtype)
        out = fused_moe_ref(*args, deterministic=deterministic)
        assert out.shape == (tokens, 24) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _naive64(*args), atol=ATOL, rtol=RTOL)


def test_ref_deterministic_is_batch_invariant():
    """A token alone, and inside batches of other tokens at other positions: bitwise the same."""
    x, w13, w2, w, ids = _problem(30, 6, 2, 48, 40, seed=9)
    full = fused_moe_ref(x, w13, w2, w, ids, deterministic=True)
    others = _problem(17, 6, 2, 48, 40, seed=10)
    for t in (0, 13, 29):
        alone = fused_moe_ref(x[t : t + 1], w13, w2, w[t : t + 1], ids[t : t + 1], deterministic=True)
        assert torch.equal(alone, full[t : t + 1])
        mixed = [torch.cat([o[:5], a[t : t + 1], o[5:]]) for o, a in ((others[0], x), (others[3], w), (others[4], ids))]
        assert torch.equal(fused_moe_ref(mixed[0], w13, w2, mixed[1], mixed[2], deterministic=True)[5], full[t])


@pytest.mark.parametrize("deterministic", [False, True])
def test_ref_gradients_match_autograd_through_the_naive_loop(deterministic):
    x, w13, w2, w, ids = _problem(7, 5, 2, 16, 12, seed=11)
    cotangent = torch.randn(7, 16, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    (fused_moe_ref(*leaves, ids, deterministic=deterministic) * cotangent).sum().backward()
    oracle = [t.double().requires_grad_() for t in (x, w13, w2, w)]
    (_naive(*oracle, ids) * cotangent.double()).sum().backward()
    for name, ours, theirs in zip(("x", "w13", "w2", "topk_weights"), leaves, oracle):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_moe_config_by_shape():
    decode = moe_config(128, 768, 2048, 8)
    prefill = moe_config(128, 768, 2048, 8192 * 8)
    assert decode.block_m < prefill.block_m
    for m in (8, 2048, 65536):  # both GEMMs of a call share block_m
        assert moe_config(128, 768, 2048, m, fused_gate_up=True).block_m == moe_config(128, 2048, 768, m).block_m
    fixed = {moe_config(60, 1408, 2048, m, fused_gate_up=True, deterministic=True) for m in (1, 4, 7, 256, 65536)}
    assert len(fixed) == 1
    assert moe_config(4, 24, 40, 10).block_n <= 32  # tiles shrink to small widths


def test_workspace_bytes_bound_what_the_call_allocates(monkeypatch):
    """Every tensor kernels/moe.py allocates in one call fits in moe_workspace_bytes (their sum bounds the peak)."""
    allocated = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def spy(*a, _real=real, **kw):
            t = _real(*a, **kw)
            if sys._getframe(1).f_code.co_filename.endswith(os.path.join("kernels", "moe.py")):
                allocated.append(t.untyped_storage().nbytes())
            return t

        monkeypatch.setattr(torch, name, spy)
    for tokens, deterministic in ((1, False), (40, False), (40, True)):
        allocated.clear()
        args = _problem(tokens, 4, 3, 32, 16, seed=tokens)
        fused_moe(*args, deterministic=deterministic)
        # the routing arrays (not for a few rows: a block per row), act, z and the output
        assert len(allocated) >= (3 if tokens * 3 <= moe.ROW_BLOCK_ROWS else 6)
        assert sum(allocated) <= moe_workspace_bytes(tokens, 3, 32, 16, torch.float32)
    assert moe_workspace_bytes(64, 8, 2048, 768, torch.bfloat16) < moe_workspace_bytes(64, 8, 2048, 768, torch.float32)
    with pytest.raises(ValueError, match="non-negative"):
        moe_workspace_bytes(-1, 8, 2048, 768, torch.bfloat16)


def test_a_block_per_row_equals_the_aligned_path(monkeypatch):
    """Few rows skip the alignment (each row its own block); the result is that of the aligned blocks."""
    args = _problem(3, 6, 4, 32, 16, seed=11)  # 12 rows <= ROW_BLOCK_ROWS, some expert chosen twice
    per_row = fused_moe(*args)
    monkeypatch.setattr(moe, "ROW_BLOCK_ROWS", 0)
    torch.testing.assert_close(fused_moe(*args), per_row, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fn", [fused_moe, fused_moe_ref])
def test_rejects_bad_arguments(fn):
    x, w13, w2, w, ids = _problem(3, 4, 2, 16, 8, seed=0)
    cases = [
        ((x.double(), w13, w2, w, ids), "x must be"),
        ((x, w13[:, :15], w2, w, ids), "w13 must be"),
        ((x, w13, w2[:, :, :7], w, ids), "w2 must be"),
        ((x, w13, w2, w, ids.float()), "topk_ids must be"),
        ((x, w13, w2, w, ids[:2]), "topk_ids must be"),
        ((x, w13, w2, w.half(), ids), "topk_weights must be"),
        ((x, w13, w2, w[:, :1], ids), "topk_weights must be"),
        ((x, w13[:2], w2[:2], w, torch.zeros(3, 3, dtype=torch.int64)), "1..2 experts"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(*args)
    if fn is fused_moe:
        with pytest.raises(ValueError, match="contiguous in their last"):
            fn(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, w, ids)
    else:
        with pytest.raises(ValueError, match="must lie in"):
            fn(x, w13, w2, w, ids + 3)


@pytest.mark.parametrize("fn", [fused_moe, fused_moe_ref])
@pytest.mark.parametrize("tokens,deterministic", [(3, False), (20, False), (20, True)])  # 6 rows: a block per
def test_an_expert_range_adds_its_terms_only(monkeypatch, fn, tokens, deterministic):  # row; 40: aligned
    """Expert parallelism: weights of experts [s, s + E/P) and global ids; the pairs routed elsewhere add
    exactly nothing (uninitialised memory is filled with NaN / out-of-range ids, so a term read from a row
    never written would show), and the ranges' outputs sum to the whole layer's."""
    experts, parts = 6, 3
    x, w13, w2, w, ids = _problem(tokens, experts, 2, 32, 16, seed=5)
    real_empty = torch.empty

    def poisoned_empty(*shape, dtype=None, **kw):
        t = real_empty(*shape, dtype=dtype, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else 12345)

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    total = torch.zeros_like(x)
    share = experts // parts
    for start in range(0, experts, share):
        out = fn(x, w13[start : start + share], w2[start : start + share], w, ids, expert_start=start,
                 deterministic=deterministic)
        mine = (ids >= start) & (ids < start + share)
        expected = _naive64(x, w13, w2, torch.where(mine, w, 0.0), ids).to(x.dtype)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
        total += out
    torch.testing.assert_close(total, _naive64(x, w13, w2, w, ids).to(x.dtype), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="expert_start must be >= 0"):
        fn(x, w13, w2, w, ids, expert_start=-1)
