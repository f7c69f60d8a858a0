"""Batched gather / scatter over many tensors (sparse weight patches): equal to per-tensor indexing, under
the interpreter on the CPU and compiled on CUDA."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.scatter import TensorTable, gather_many, scatter_many  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _patch(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in shapes]
    picks = [torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 3)].sort().values for t in tensors]
    indices = torch.cat(picks).to(DEVICE)
    segment = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(picks)]).to(DEVICE)
    return tensors, picks, indices, segment


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_gather_and_scatter_match_per_tensor_indexing(dtype):
    shapes = [(5, 7), (1,), (3000,), (2, 3, 4)]  # 3000 spans blocks; sizes not multiples of anything
    tensors, picks, indices, segment = _patch(shapes, dtype, seed=1)
    expected = torch.cat([t.reshape(-1)[p.to(DEVICE)] for t, p in zip(tensors, picks)])
    assert torch.equal(gather_many(tensors, indices, segment), expected)

    values = (torch.arange(indices.numel()) % 100 - 50).to(dtype).to(DEVICE)
    want = [t.clone() for t in tensors]
    for w, p, v in zip(want, picks, values.split([p.numel() for p in picks])):
        w.view(-1)[p.to(DEVICE)] = v
    scatter_many(tensors, indices, segment, values)
    for got, w in zip(tensors, want):
        assert torch.equal(got, w)


def test_a_table_serves_many_calls():
    """A TensorTable built once reads and writes the live tensors: a scatter through it is seen by the next
    gather through it and by the tensors themselves."""
    tensors, picks, indices, segment = _patch([(6, 5), (700,)], torch.float32, seed=3)
    table = TensorTable.of(tensors)
    old = gather_many(table, indices, segment)
    scatter_many(table, indices, segment, old + 1)
    assert torch.equal(gather_many(table, indices, segment), old + 1)
    assert torch.equal(tensors[1].view(-1)[picks[1].to(DEVICE)], old[picks[0].numel():] + 1)
    with pytest.raises(ValueError, match="values must be"):
        scatter_many(table, indices, segment, old.half())


def test_bad_input_is_refused():
    tensors, _, indices, segment = _patch([(4, 4)], torch.float32, seed=2)
    with pytest.raises(ValueError, match="contiguous"):
        gather_many([tensors[0].t()], indices, segment)
    with pytest.raises(ValueError, match="int64"):
        gather_many(tensors, indices.to(torch.int32), segment)
    with pytest.raises(ValueError, match="values must be"):
        scatter_many(tensors, indices, segment, torch.zeros(indices.numel(), dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="at least one"):
        gather_many([], indices, segment)
    with pytest.raises(ValueError, match="got torch.float64"):
        TensorTable.of([tensors[0], tensors[0].double()])
