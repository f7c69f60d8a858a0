"""The Triton LoRA kernels on CUDA in bfloat16 at real shapes (skipped without CUDA): against the torch
reference, a token's bits independent of its batch (decode and prefill tile groups, other adapters around
it), and a CUDA graph of the whole step's LoRA work (tile plan + shrink and expand) replaying bitwise what
eager computes, also after the slot assignment and the inputs change (no adapter token at all; one adapter for all);
the overlapped halves (the shrink forked onto a side stream beside the base GEMM, the expand joined after it) in a
captured graph replaying `add_lora`'s eager bits across slot changes, and eagerly too.

Tolerance against the reference (bfloat16): the kernel and the reference sum y in float32 in different
orders, so y's rounding to bfloat16 may differ by one ulp (2**-8 relative) in any of its entries, and the
output's rounding by one ulp more: |ours - ref| <= 2**-7 * (|ref| + scaling * |y| @ |B|^T) elementwise."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QKV = (4096, 1024, 1024)  # Llama-3-8B's q|k|v widths


def _stacks(g, num_slots, in_features, slices, r_max, ranks):
    A = torch.zeros(num_slots, len(slices) * r_max, in_features)
    B = torch.zeros(num_slots, sum(slices), r_max)
    for s in range(num_slots):
        r = ranks[s % len(ranks)]
        start = 0
        for j, width in enumerate(slices):
            A[s, j * r_max:j * r_max + r] = torch.randn(r, in_features, generator=g) / in_features**0.5
            B[s, start:start + width, :r] = torch.randn(width, r, generator=g) / r**0.5
            start += width
    return (A.to("cuda", torch.bfloat16), B.to("cuda", torch.bfloat16),
            (torch.rand(num_slots, generator=g) + 0.5).cuda())


def _inputs(g, num_tokens, in_features, out_features, num_slots):
    x = torch.randn(num_tokens, in_features, generator=g).to("cuda", torch.bfloat16)
    base = torch.randn(num_tokens, out_features, generator=g).to("cuda", torch.bfloat16)
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32).cuda()
    return x, base, idx


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 257, 512])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("slices", [(4096,), QKV])
def test_bf16_real_shapes_match_the_reference(num_tokens, rank, slices):
    from kernels.lora import add_lora
    from kernels.lora_ref import lora_expand_ref, lora_shrink_ref

    g = torch.Generator().manual_seed(num_tokens * 7 + rank + len(slices))
    num_slots = 16
    A, B, scaling = _stacks(g, num_slots, 4096, slices, rank, ranks=(rank, rank // 2, 8))
    x, base, idx = _inputs(g, num_tokens, 4096, sum(slices), num_slots)
    ours = add_lora(base.clone(), x, A, B, idx, scaling, slices=slices)
    y = lora_shrink_ref(x, A, idx)
    ref = lora_expand_ref(y, B, idx, scaling, base.clone(), slices=slices)
    mag = lora_expand_ref(y.abs(), B.abs(), idx, scaling, torch.zeros_like(base), slices=slices).float()
    err = (ours.float() - ref.float()).abs()
    bound = 2.0**-7 * (ref.float().abs() + mag)
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(ours[idx < 0], base[idx < 0])


def test_bf16_token_bits_do_not_depend_on_the_batch():
    from kernels.lora import add_lora

    g = torch.Generator().manual_seed(1)
    A, B, scaling = _stacks(g, 16, 4096, QKV, 64, ranks=(64, 16, 40))
    x, base, idx = _inputs(g, 512, 4096, sum(QKV), 16)
    prefill = add_lora(base.clone(), x, A, B, idx, scaling, slices=QKV)
    decode = torch.cat([add_lora(base[i:i + 64].clone(), x[i:i + 64], A, B, idx[i:i + 64], scaling, slices=QKV)
                        for i in range(0, 512, 64)])
    assert torch.equal(prefill, decode)
    for t in (0, 100, 511):
        alone = add_lora(base[t:t + 1].clone(), x[t:t + 1], A, B, idx[t:t + 1], scaling, slices=QKV)
        assert torch.equal(prefill[t:t + 1], alone), t
    one_adapter = torch.full_like(idx, int(idx[100]))
    same = add_lora(base.clone(), x, A, B, one_adapter, scaling, slices=QKV)
    assert torch.equal(same[100], prefill[100])  # other tokens' adapters change nothing for token 100


@pytest.mark.parametrize("num_tokens", [64, 256])
def test_graph_replay_equals_eager_bitwise_across_slot_changes(num_tokens):
    from kernels.lora import add_lora, lora_batch

    g = torch.Generator().manual_seed(num_tokens)
    A, B, scaling = _stacks(g, 8, 4096, QKV, 16, ranks=(16, 4))
    x, base, idx = _inputs(g, num_tokens, 4096, sum(QKV), 8)
    out = torch.empty_like(base)

    def step():  # two layers over one tile plan (the shrink's arrival counters are reused)
        out.copy_(base)
        batch = lora_batch(idx, 8)
        add_lora(out, x, A, B, batch, scaling, slices=QKV)
        add_lora(out, x, A, B, batch, scaling, slices=QKV)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(5):
        if trial:  # new inputs and a new slot assignment in the same buffers
            idx.copy_(torch.randint(-1, 8, (num_tokens,), generator=g, dtype=torch.int32))
            x.copy_(torch.randn(num_tokens, 4096, generator=g))
            A[trial].mul_(-1)  # an adapter swapped in place
        if trial == 3:
            idx.fill_(-1)  # no adapter token: no tile
        if trial == 4:
            idx.fill_(5)  # one adapter: every tile of one slot
        graph.replay()
        replayed = out.clone()
        eager = add_lora(add_lora(base.clone(), x, A, B, idx, scaling, slices=QKV), x, A, B, idx, scaling,
                         slices=QKV)
        assert torch.equal(replayed, eager), trial
        assert not (idx < 0).all() or torch.equal(replayed, base)


LLAMA_8B = {"qkv": (4096, QKV), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


@pytest.mark.parametrize("num_tokens", [64, 256])
def test_overlapped_halves_in_a_graph_replay_eager_add_lora_across_slot_changes(num_tokens):
    """A step of the 8B shapes as the overlapped hook runs it (per layer: the shrink forked onto a side stream, the
    base GEMM and a copy on the capturing stream, the expand joined after them), captured once and replayed with new
    slot assignments, inputs and an adapter swapped in place: each output equals eager `add_lora` (one launch,
    after the GEMM) on the graph's own GEMM output, bitwise, and the arrival counters stay at zero. The same halves
    run eagerly give the same bits."""
    from kernels.lora import add_lora, lora_batch, lora_expand_partials, lora_shrink_partials

    g = torch.Generator().manual_seed(20 + num_tokens)
    num_slots = 16
    layers = {}
    for name, (in_features, slices) in LLAMA_8B.items():
        A, B, scaling = _stacks(g, num_slots, in_features, slices, 16, ranks=(16, 8))
        W = (torch.randn(sum(slices), in_features, generator=g) / in_features**0.5).to("cuda", torch.bfloat16)
        layers[name] = (W, A, B, scaling, slices)
    xs = {name: torch.randn(num_tokens, LLAMA_8B[name][0], generator=g).to("cuda", torch.bfloat16) for name in layers}
    gemm = {name: torch.empty(num_tokens, sum(LLAMA_8B[name][1]), dtype=torch.bfloat16, device="cuda")
            for name in layers}  # the graph's base outputs
    outs = {name: torch.empty_like(t) for name, t in gemm.items()}
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32).cuda()
    side = torch.cuda.Stream(priority=-1)
    plan = []

    def step():
        batch = lora_batch(idx, num_slots)
        plan[:] = [batch]
        for name, (W, A, B, scaling, slices) in layers.items():
            partials = lora_shrink_partials(xs[name], A, batch, stream=side)
            torch.mm(xs[name], W.t(), out=gemm[name])
            outs[name].copy_(gemm[name])
            lora_expand_partials(outs[name], partials, B, scaling, slices=slices)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    captured = plan[0]
    for trial, fill in enumerate((None, 3, -1, None, None)):
        if fill is None:
            idx.copy_(torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32))
        else:
            idx.fill_(fill)
        for x in xs.values():
            x.copy_(torch.randn(x.shape, generator=g))
        layers["qkv"][1][trial].mul_(-1)  # an adapter swapped in place
        graph.replay()
        torch.cuda.synchronize()
        for name, (W, A, B, scaling, slices) in layers.items():
            eager = add_lora(gemm[name].clone(), xs[name], A, B, idx, scaling, slices=slices)
            assert torch.equal(outs[name], eager), (trial, name)
            if fill == -1:
                assert torch.equal(outs[name], gemm[name])
        assert not captured.arrivals.any()
        step()  # the halves eagerly, on the default stream and the side stream
        for name, (W, A, B, scaling, slices) in layers.items():
            assert torch.equal(outs[name], add_lora(gemm[name].clone(), xs[name], A, B, idx, scaling,
                                                    slices=slices)), (trial, name)
