"""The Triton routing kernel (kernels/routing.py) against the torch reference, under the interpreter on the
CPU (float32) and for real on CUDA: top-k ids, weights (renormalised or not), replayed ids, the routing store."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.routing import route_topk  # noqa: E402
from kernels.routing_ref import routing_weights_ref, topk_ids_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 8, 2), (5, 60, 4), (7, 128, 8)] if DEVICE == "cpu" else [(1, 128, 8), (64, 60, 4), (300, 128, 8)]


@pytest.mark.parametrize("n,experts,k", SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16])
def test_topk_and_weights_match_the_reference(n, experts, k, renormalize, dtype):
    g = torch.Generator().manual_seed(n * experts + k)
    if dtype == torch.float32:
        logits = (2 * torch.randn(n, experts, generator=g)).to(DEVICE, dtype)
    else:  # distinct values per row (multiples of 1/16, exact in bfloat16): ties may be ordered either way
        logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(n)]).sub(experts / 2).div(16)
        logits = logits.to(DEVICE, dtype)
    weights, ids = route_topk(logits, k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), topk_ids_ref(logits, k))
    torch.testing.assert_close(weights, routing_weights_ref(logits, ids, renormalize), atol=2e-7, rtol=1e-6)


def test_given_ids_get_their_weights_and_are_returned():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, generator=g).to(DEVICE)
    given = torch.stack([torch.randperm(16, generator=g)[:3] for _ in range(6)])  # not the top-k
    weights, ids = route_topk(logits, 3, True, ids=given.to(DEVICE))
    assert torch.equal(ids.long().cpu(), given)
    torch.testing.assert_close(weights, routing_weights_ref(logits, given.to(DEVICE), True), atol=2e-7, rtol=1e-6)


def test_store_gets_each_rows_ids_at_its_slot_and_layer_skipping_negative_slots():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 8, generator=g).to(DEVICE)
    store = torch.full((10, 3, 2), -7, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 9], device=DEVICE)
    _, ids = route_topk(logits, 2, False, store=store, slots=slots, layer=1)
    expect = torch.full((10, 3, 2), -7, dtype=torch.int32)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[slot, 1] = ids[row].cpu()
    assert torch.equal(store.cpu(), expect)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="top_k must be in"):
        route_topk(torch.zeros(2, 4, device=DEVICE), 5, True)
    with pytest.raises(ValueError, match=r"ids must be \[2, 2\]"):
        route_topk(torch.zeros(2, 4, device=DEVICE), 2, True, ids=torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))
