"""The small-token MoE block (kernels/moe_decode.py): under the interpreter at tiny float32 shapes against the
torch reference (kernels/moe_decode_ref.py), and on CUDA at the Qwen3-30B-A3B shape in bfloat16 against the
reference, the unfused engine path and a float32 oracle (skipped without CUDA).

Tolerances (float32): outputs are O(1) (weights scaled by 1/sqrt(fan-in)), each dot product has at most 64
terms, so any summation order stays within 2e-5 absolute + 1e-5 relative. Routing: float32 logits drawn at
random have no ties, so the ids must be equal, the weights equal to float32 rounding of the softmax.
bfloat16 (CUDA): each token's relative L2 error against the float32 oracle under 3% (bfloat16 rounding gives
about 0.5%, a wrong expert or a lost term about 100%).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.moe_decode import DecodeConfig, moe_decode  # noqa: E402
from kernels.moe_decode_ref import moe_decode_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL, RTOL = 2e-5, 1e-5
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _problem(tokens, experts, top_k, hidden, inter, seed, dtype=torch.float32, local=None):
    """(hidden_sum, norm_weight, logits, w13, w2); `local` (start, count): the weights of those experts only."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(tokens, hidden, generator=g) * 3
    nw = 1 + 0.1 * torch.randn(hidden, generator=g)
    logits = 2 * torch.randn(tokens, experts, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    if local is not None:
        w13, w2 = w13[local[0] : local[0] + local[1]], w2[local[0] : local[0] + local[1]]
    return tuple(t.to(DEVICE, dtype) for t in (s, nw, logits, w13, w2))


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 32, 16), (2, 16, 8, 48, 40),
                                                               (3, 6, 3, 64, 24)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_the_reference(tokens, experts, top_k, hidden, inter, renormalize):
    s, nw, logits, w13, w2 = _problem(tokens, experts, top_k, hidden, inter, seed=tokens * 7 + top_k)
    out, weights, ids = moe_decode(s, nw, 1e-6, logits, w13, w2, top_k, renormalize)
    ref_out, ref_weights, ref_ids = moe_decode_ref(s, nw, 1e-6, logits, w13, w2, top_k, renormalize)
    assert out.shape == s.shape and out.dtype == s.dtype and ids.dtype == torch.int32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=2e-7, rtol=1e-6)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)


def test_tiles_smaller_than_the_problem_cover_it():
    """Several column blocks and K steps in both launches (hidden and I not multiples of the tiles)."""
    s, nw, logits, w13, w2 = _problem(2, 8, 4, 80, 40, seed=3)
    cfg = DecodeConfig(up_block_n=16, up_block_k=32, down_columns=16, down_block_k=16)
    out, _, _ = moe_decode(s, nw, 1e-5, logits, w13, w2, 4, True, config=cfg)
    torch.testing.assert_close(out, moe_decode_ref(s, nw, 1e-5, logits, w13, w2, 4, True)[0], atol=ATOL, rtol=RTOL)


def test_routing_store_gets_the_ids_at_each_tokens_slot():
    s, nw, logits, w13, w2 = _problem(3, 8, 2, 32, 16, seed=5)
    store = torch.full((6, 3, 2), -7, dtype=torch.int32, device=DEVICE)
    ref_store = store.clone()
    slots = torch.tensor([4, -1, 0], device=DEVICE)  # the middle token is padding: recorded nowhere
    _, _, ids = moe_decode(s, nw, 1e-6, logits, w13, w2, 2, True, store=store, slots=slots, layer=2)
    moe_decode_ref(s, nw, 1e-6, logits, w13, w2, 2, True, store=ref_store, slots=slots, layer=2)
    assert torch.equal(store, ref_store)
    assert torch.equal(store[4, 2], ids[0]) and torch.equal(store[0, 2], ids[2])
    assert int((store != -7).sum()) == 4


def test_expert_parallel_ranks_sum_to_the_whole_block():
    """Each rank's experts [start, start + 4) of 12 contribute their terms only; the ranks' outputs add up."""
    s, nw, logits, w13, w2 = _problem(2, 12, 4, 32, 16, seed=9)
    whole = moe_decode_ref(s, nw, 1e-6, logits, w13, w2, 4, True)[0]
    parts = []
    for start in (0, 4, 8):
        mine = (w13[start : start + 4], w2[start : start + 4])
        out, _, ids = moe_decode(s, nw, 1e-6, logits, *mine, 4, True, expert_start=start)
        ref = moe_decode_ref(s, nw, 1e-6, logits, *mine, 4, True, expert_start=start)[0]
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        parts.append(out)
    torch.testing.assert_close(parts[0] + parts[1] + parts[2], whole, atol=3 * ATOL, rtol=RTOL)


def test_ties_take_the_lowest_expert_first():
    """Equal logits: the kernel's order is kernels/routing.py's (lowest index first)."""
    from kernels.routing import route_topk

    s, nw, _, w13, w2 = _problem(2, 8, 3, 32, 16, seed=2)
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.5]] * 2, device=DEVICE)
    _, weights, ids = moe_decode(s, nw, 1e-6, logits, w13, w2, 3, False)
    ref_weights, ref_ids = route_topk(logits, 3, False)
    assert ids[0].tolist() == [1, 2, 4] and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=2e-7, rtol=1e-6)


@pytest.mark.parametrize("field,bad", [("hidden_sum", "rank"), ("w13", "width"), ("w2", "shape"),
                                       ("router_logits", "rows"), ("top_k", "zero"), ("expert_start", "range")])
def test_bad_arguments_are_refused_by_name(field, bad):
    s, nw, logits, w13, w2 = _problem(2, 8, 2, 32, 16, seed=1)
    args = dict(hidden_sum=s, norm_weight=nw, eps=1e-6, router_logits=logits, w13=w13, w2=w2, top_k=2,
                renormalize=True)
    if field == "hidden_sum":
        args["hidden_sum"] = s[None]
    elif field == "w13":
        args["w13"] = w13[:, :, :16]
    elif field == "w2":
        args["w2"] = w2[:, :, :8]
    elif field == "router_logits":
        args["router_logits"] = logits[:1]
    elif field == "top_k":
        args["top_k"] = 0
    else:
        args["expert_start"] = 7
    with pytest.raises(ValueError, match=field):
        moe_decode(**args)


# ---- CUDA, the Qwen3-30B-A3B shape in bfloat16 ------------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("tokens", [1, 2])
def test_real_shape_bf16_matches_the_reference_and_the_engine_path(tokens):
    from kernels.moe import fused_moe
    from kernels.norm import rms_norm
    from kernels.routing import route_topk

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(tokens)
    s = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    # distinct logits (multiples of 1/16, exact in bfloat16): no ties, so every path picks the same experts
    logits = (torch.stack([torch.randperm(experts, device="cuda", generator=g) for _ in range(tokens)]) / 16
              ).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    out, weights, ids = moe_decode(s, nw, 1e-6, logits, w13, w2, top_k, True)
    ref_out, ref_weights, ref_ids = moe_decode_ref(s, nw, 1e-6, logits, w13, w2, top_k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    oracle = moe_decode_ref(s.float(), nw.float(), 1e-6, logits.float(), w13.float(), w2.float(), top_k, True)[0]
    relative = ((out.float() - oracle).norm(dim=-1) / oracle.norm(dim=-1)).max().item()
    ref_relative = ((ref_out.float() - oracle).norm(dim=-1) / oracle.norm(dim=-1)).max().item()
    assert relative < 0.03 and relative <= 2 * ref_relative + 1e-3, (relative, ref_relative)
    # the engine's unfused path: norm kernel, routing kernel, fused_moe; the same experts, close outputs
    engine_weights, engine_ids = route_topk(logits, top_k, True)
    engine = fused_moe(rms_norm(s, nw, 1e-6), w13, w2, engine_weights, engine_ids)
    assert torch.equal(ids, engine_ids)
    assert ((out.float() - engine.float()).norm(dim=-1) / engine.float().norm(dim=-1)).max().item() < 0.02


@cuda_only
def test_graph_replay_equals_eager_bitwise():
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(1, hidden, device="cuda", generator=g).bfloat16()
    nw = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, experts, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    store = torch.zeros(4, 2, top_k, dtype=torch.int32, device="cuda")
    slots = torch.tensor([2], device="cuda")
    eager = moe_decode(s, nw, 1e-6, logits, w13, w2, top_k, True, store=store, slots=slots, layer=1)[0]
    eager_store = store.clone()
    store.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode(s, nw, 1e-6, logits, w13, w2, top_k, True, store=store, slots=slots, layer=1)[0]
    store.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.equal(store, eager_store)
