"""The Triton multi-tensor checksum equals the torch definition bitwise (under the interpreter on the CPU,
compiled on CUDA), for every supported element size, blocks that straddle tensor ends, and tensors past
2**22 elements (where the position weight gains its chunk term)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.checksum import checksum_many  # noqa: E402
from weight_updates.checksum import checksum_tensor, checksum_tensors  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reference(tensors):
    return torch.stack([checksum_tensor(t.cpu()) for t in tensors])  # the torch path, on the CPU


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_checksum_many_equals_torch_definition(dtype):
    g = torch.Generator().manual_seed(3)
    sizes = [(1,), (4095,), (4097,), (3, 7), ((1 << 22) + 4100,)]
    tensors = [(torch.randn(*s, generator=g) * 50).to(dtype).to(DEVICE) for s in sizes]
    got = checksum_many(tensors)
    assert got.dtype == torch.int64 and got.shape == (len(sizes),)
    assert torch.equal(got.cpu(), _reference(tensors))


def test_checksum_tensors_mixes_element_sizes_and_layouts():
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 10, generator=g).to(DEVICE)
    tensors = [torch.randn(100, generator=g).to(torch.bfloat16).to(DEVICE), wide[:, 2:7],  # non-contiguous
               torch.randn(33, generator=g).to(DEVICE)]
    assert torch.equal(checksum_tensors(tensors).cpu(), _reference(tensors))


def test_a_flipped_bit_changes_the_checksum():
    t = torch.randn(9000, generator=torch.Generator().manual_seed(5)).to(torch.float16).to(DEVICE)
    flipped = t.clone()
    flipped.view(torch.int16)[8999] ^= 1
    assert checksum_many([t])[0] != checksum_many([flipped])[0]


def test_checksum_many_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        checksum_many([])
    with pytest.raises(ValueError, match="contiguous"):
        checksum_many([torch.zeros(4, 4, device=DEVICE).t()])
    with pytest.raises(ValueError, match="one element size"):
        checksum_many([torch.zeros(4, device=DEVICE), torch.zeros(4, dtype=torch.float16, device=DEVICE)])
    with pytest.raises(ValueError, match="1-, 2- and 4-byte"):
        checksum_many([torch.zeros(4, dtype=torch.float64, device=DEVICE)])


def test_checksum_many_finds_each_blocks_tensor_among_many_with_empty_and_unaligned_ones():
    # Empty tensors between others (their first block equals the next one's), tensors that start at an odd
    # element offset (no vector loads), and more tensors than a few rounds of the binary search cover.
    g = torch.Generator().manual_seed(6)
    backing = (torch.randn(40000, generator=g) * 50).to(torch.float16).to(DEVICE)
    sizes = [0, 1, 4096, 0, 0, 5000, 3, 8192, 0, 4095, 17, 0]
    tensors, at = [], 1  # odd start: every tensor's address is 2-byte but not 16-byte aligned
    for n in sizes * 3:
        tensors.append(backing[at : at + n])
        at += n + 1
    assert torch.equal(checksum_many(tensors).cpu(), _reference(tensors))
    assert torch.equal(checksum_many(tensors[1:2]).cpu(), _reference(tensors[1:2]))
