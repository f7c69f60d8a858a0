"""The one-launch linear + LoRA kernel (kernels/lora_linear.py) against its reference (kernels/lora_linear_ref.py)
and a per-token loop in float64, under the interpreter on the CPU (float32, tiny shapes): many slots with tokens
without an adapter, the slices of a fused output, a bias, ragged `in` and column blocks, two row blocks, a shrink
of several splits; the shrink's partials are `add_lora`'s; a token's row is the same bits alone and in any batch;
rows without an adapter get the GEMM alone; one plan serves many launches (its per-tile counters end at zero, its
step count holds every launch's shrink programs). With CUDA (skipped without), the Llama-3.1-8B decode shapes in
bfloat16 and a CUDA graph replayed across slot changes. (The interpreter runs programs one after another in id
order, so there the GEMM programs find the shrink done.)"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.lora import LoraKernelConfig, lora_batch, lora_shrink  # noqa: E402
from kernels.lora_linear import LinearLoraConfig, linear_config_for, linear_lora  # noqa: E402
from kernels.lora_linear_ref import linear_lora_ref  # noqa: E402
from kernels.lora_ref import lora_expand_ref  # noqa: E402
from test_kernels_lora import LLAMA_8B, _decode_idx, cuda  # noqa: E402
from test_kernels_lora import _per_token as per_token_deltas  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S = 4  # slots
# interpreter-sized tiles, the shrink in add_lora's splits (three for 1100 in-features)
SMALL = LinearLoraConfig(block_n=16, block_k=32, stages=2, block_r=2, lora=LoraKernelConfig())


def _layer(g, in_features, slices, r_max, ranks, bias=False):
    """weight, bias, and slot stacks with slot s holding a random adapter of rank ranks[s] (zero-padded to r_max)
    in every slice."""
    n = sum(slices)
    A = torch.zeros(S, len(slices) * r_max, in_features)
    B = torch.zeros(S, n, r_max)
    for s, r in enumerate(ranks):
        start = 0
        for j, width in enumerate(slices):
            A[s, j * r_max:j * r_max + r] = torch.randn(r, in_features, generator=g) / in_features**0.5
            B[s, start:start + width, :r] = torch.randn(width, r, generator=g)
            start += width
    W = torch.randn(n, in_features, generator=g) / in_features**0.5
    b = torch.randn(n, generator=g) if bias else None
    scaling = torch.rand(S, generator=g) + 0.5
    return (W.to(DEVICE), None if b is None else b.to(DEVICE), A.to(DEVICE), B.to(DEVICE), scaling.to(DEVICE))


def _per_token(x, W, b, A, B, idx, scaling, slices):
    """The definition in float64: the layer, then test_kernels_lora's per-token loop of the deltas."""
    return per_token_deltas(x.double() @ W.double().t() + (0 if b is None else b.double()), x, A, B, idx, scaling,
                            slices)


def _idx(g, n):
    idx = torch.randint(-1, S, (n,), generator=g, dtype=torch.int32)
    if n > 1:
        idx[0], idx[1] = -1, 2  # both kinds, whatever the draw
    return idx.to(DEVICE)


@pytest.mark.parametrize("num_tokens", [1, 7, 70])  # 70: two row blocks of the GEMM
@pytest.mark.parametrize(("slices", "bias"), [((24,), False), ((16, 8, 8), True), ((12, 20), False)])
@pytest.mark.parametrize("in_features", [40, 1100])  # ragged K steps; the shrink in three splits
def test_linear_lora_matches_reference_and_per_token_loop(num_tokens, slices, bias, in_features):
    g = torch.Generator().manual_seed(num_tokens * 1000 + in_features + len(slices))
    W, b, A, B, scaling = _layer(g, in_features, slices, 8, ranks=(8, 3, 5, 1), bias=bias)
    x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
    idx = _idx(g, num_tokens)
    ours = linear_lora(x, W, b, A, B, idx, scaling, slices=slices, config=SMALL)
    assert ours.shape == (num_tokens, sum(slices)) and ours.dtype == x.dtype
    torch.testing.assert_close(ours, linear_lora_ref(x, W, b, A, B, idx, scaling, slices=slices), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(ours.double(), _per_token(x, W, b, A, B, idx, scaling, slices), rtol=1e-5, atol=1e-5)


def test_rows_without_an_adapter_get_the_gemm_alone_and_the_shrink_is_add_loras():
    """A row without an adapter is the kernel's GEMM with zero stacks, bit for bit; an adapter row's delta over
    that GEMM is the expand (reference) of `lora_shrink`'s y, the partials `add_lora` sums."""
    g = torch.Generator().manual_seed(1)
    slices = (16, 8, 8)
    W, b, A, B, scaling = _layer(g, 1100, slices, 8, ranks=(8, 2, 7, 8), bias=True)
    x, idx = torch.randn(30, 1100, generator=g).to(DEVICE), _idx(g, 30)
    ours = linear_lora(x, W, b, A, B, idx, scaling, slices=slices, config=SMALL)
    gemm = linear_lora(x, W, b, torch.zeros_like(A), torch.zeros_like(B), idx, scaling, slices=slices, config=SMALL)
    none = idx < 0
    assert torch.equal(ours[none], gemm[none]) and not torch.equal(ours[~none], gemm[~none])
    torch.testing.assert_close(gemm, F.linear(x, W, b), rtol=1e-5, atol=1e-5)
    y = lora_shrink(x, A, idx, config=SMALL.lora)
    expected = lora_expand_ref(y, B, idx, scaling, gemm.clone(), slices=slices)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [3, 70])
def test_each_token_gets_the_bits_it_gets_alone(num_tokens):
    """A row's GEMM, shrink and expand depend on that row, its slot and the layer only: alone, in a batch of other
    adapters, or with another launch shape of the same tiles, the same bits."""
    g = torch.Generator().manual_seed(9 + num_tokens)
    slices = (16, 8, 8)
    W, b, A, B, scaling = _layer(g, 300, slices, 8, ranks=(8, 3, 5, 1))
    x, idx = torch.randn(num_tokens, 300, generator=g).to(DEVICE), _idx(g, num_tokens)
    batch = linear_lora(x, W, b, A, B, idx, scaling, slices=slices, config=SMALL)
    moved = LinearLoraConfig(block_n=16, block_k=32, stages=1, block_r=2, num_warps=2, expand_stages=1,
                             lora=LoraKernelConfig(groups_per_tile_row=1))
    for t in (0, 1, num_tokens - 1):
        alone = linear_lora(x[t:t + 1], W, b, A, B, idx[t:t + 1], scaling, slices=slices, config=moved)
        assert torch.equal(batch[t:t + 1], alone), t


def test_one_plan_serves_many_launches_and_counts_their_shrink_programs():
    g = torch.Generator().manual_seed(4)
    layers = [(slices, _layer(g, 64, slices, 4, ranks=(4, 2, 4, 1))) for slices in ((16,), (16, 16), (8, 8, 16))]
    x = torch.randn(19, 64, generator=g).to(DEVICE)
    idx = _idx(g, 19)
    batch = lora_batch(idx, S)
    assert batch.token_slot.tolist() == idx.tolist()
    for slices, (W, b, A, B, scaling) in layers:
        out = torch.full((19, sum(slices)), float("nan"), device=DEVICE)
        assert linear_lora(x, W, b, A, B, batch, scaling, slices=slices, out=out, config=SMALL) is out
        torch.testing.assert_close(out, linear_lora_ref(x, W, b, A, B, idx, scaling, slices=slices), rtol=1e-5,
                                   atol=1e-5)
        assert int(batch.done[0]) == batch.counted[0] > 0 and not batch.arrivals.any()  # the step's running count


def test_step_count_waits_on_the_steps_running_count_and_gives_the_same_bits():
    """`LinearLoraConfig.step_count`: no count of the GEMM programs' own; the plan's counter holds every shrink
    program of the step's launches so far (the host's `counted`), the same bits as the launch-wide count."""
    g = torch.Generator().manual_seed(6)
    layers = [(slices, _layer(g, 1100, slices, 4, ranks=(4, 2, 4, 1))) for slices in ((16,), (16, 16), (8, 8, 16))]
    x = torch.randn(19, 1100, generator=g).to(DEVICE)
    idx = _idx(g, 19)
    counted, stepped = lora_batch(idx, S), lora_batch(idx, S)
    assert SMALL.step_count
    for launches, (slices, (W, b, A, B, scaling)) in enumerate(layers, 1):
        want = linear_lora(x, W, b, A, B, counted, scaling, slices=slices, config=replace(SMALL, step_count=False))
        assert torch.equal(linear_lora(x, W, b, A, B, stepped, scaling, slices=slices, config=SMALL), want)
        assert int(counted.done[0]) == 0 and counted.counted == [0]
        assert int(stepped.done[0]) == stepped.counted[0] >= 3 * launches  # three splits of 1100, >= 1 tile group
    assert lora_batch(idx, S).counted == [0]


def test_each_layer_shape_takes_its_measured_tile_and_every_tile_computes_the_layer():
    from kernels.lora_linear import DEFAULT_LINEAR_CONFIG, LONG_CONFIG, WIDE_CONFIG

    assert {name: linear_config_for(inp, sum(slices)) for name, (inp, slices) in LLAMA_8B.items()} == {
        "qkv": DEFAULT_LINEAR_CONFIG, "o": DEFAULT_LINEAR_CONFIG, "gate_up": WIDE_CONFIG, "down": LONG_CONFIG}
    g = torch.Generator().manual_seed(6)
    slices = (40, 24)
    W, b, A, B, scaling = _layer(g, 100, slices, 4, ranks=(4, 2, 3, 1), bias=True)
    x, idx = torch.randn(5, 100, generator=g).to(DEVICE), _idx(g, 5)
    want = linear_lora_ref(x, W, b, A, B, idx, scaling, slices=slices)
    for config in (WIDE_CONFIG, LONG_CONFIG):
        torch.testing.assert_close(linear_lora(x, W, b, A, B, idx, scaling, slices=slices, config=config), want,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [(8, 3, 5, 1), (20, 17, 1, 20)])  # 20: the expand by slot takes two rank steps
def test_the_expand_by_slot_and_the_gathered_expand_both_give_the_reference(ranks):
    """Tokens of all four slots and none, two row blocks: each slot's dot must pick its own rows only."""
    g = torch.Generator().manual_seed(12)
    slices = (16, 8)
    W, b, A, B, scaling = _layer(g, 48, slices, max(ranks), ranks=ranks)
    x, idx = torch.randn(70, 48, generator=g).to(DEVICE), _idx(g, 70)
    want = _per_token(x, W, b, A, B, idx, scaling, slices)
    for by_slot in (True, False):
        got = linear_lora(x, W, b, A, B, idx, scaling, slices=slices, config=replace(SMALL, expand_by_slot=by_slot))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=f"expand_by_slot={by_slot}")


@pytest.mark.parametrize("used", [1, 2, 3, 4])
def test_the_expand_in_chunks_of_slots_gives_the_bits_of_one_dot_per_slot(used):
    """`expand_chunk`: once the step uses that many slots, one dot per chunk of slots (the last chunk part empty
    when the chunk does not divide the slots in use), its B blocks loaded as one block or row by row
    (`expand_b_rows`); a row's products fall in one K step either way."""
    g = torch.Generator().manual_seed(20 + used)
    slices = (16, 8)
    W, b, A, B, scaling = _layer(g, 48, slices, 20, ranks=(20, 17, 1, 9))  # 20: two rank steps
    x = torch.randn(70, 48, generator=g).to(DEVICE)
    idx = torch.randint(-1, used, (70,), generator=g, dtype=torch.int32)
    idx[:used] = torch.arange(used)  # every slot below `used` in the step
    idx = idx.to(DEVICE)
    one_per_slot = linear_lora(x, W, b, A, B, idx, scaling, slices=slices, config=replace(SMALL, expand_chunk=1))
    torch.testing.assert_close(one_per_slot.double(), _per_token(x, W, b, A, B, idx, scaling, slices), rtol=1e-5,
                               atol=1e-5)
    for chunk in (2, 4):
        for b_rows in (False, True):
            got = linear_lora(x, W, b, A, B, idx, scaling, slices=slices,
                              config=replace(SMALL, expand_chunk=chunk, expand_b_rows=b_rows))
            assert torch.equal(got, one_per_slot), (chunk, b_rows)
        early = linear_lora(x, W, b, A, B, idx, scaling, slices=slices,
                            config=replace(SMALL, expand_chunk=chunk, expand_early=True))
        assert torch.equal(early, one_per_slot), (chunk, "expand_early")


def test_the_early_first_chunk_with_no_adapter_in_the_step_gives_the_gemm_alone():
    """`expand_early` loads the first chunk whatever the step uses: with no slot in use, nothing is added."""
    g = torch.Generator().manual_seed(27)
    slices = (16, 8)
    W, b, A, B, scaling = _layer(g, 48, slices, 4, ranks=(4, 2, 3, 1), bias=True)
    x = torch.randn(9, 48, generator=g).to(DEVICE)
    none = torch.full((9,), -1, dtype=torch.int32, device=DEVICE)
    got = linear_lora(x, W, b, A, B, none, scaling, slices=slices, config=replace(SMALL, expand_chunk=2,
                                                                                 expand_early=True))
    assert torch.equal(got, linear_lora(x, W, b, A, B, none, scaling, slices=slices, config=SMALL))
    torch.testing.assert_close(got.double(), x.double() @ W.double().t() + b.double(), rtol=1e-5, atol=1e-5)


def test_ticketed_and_block_id_roles_give_the_same_bits_and_leave_the_counters_at_zero():
    """LoraKernelConfig.ticketed (the default): each program's role from a ticket instead of its block id; the same
    programs, so the same bits, launch after launch on one plan, add_lora's one launch and the linear's alike."""
    from kernels.lora import add_lora

    g = torch.Generator().manual_seed(13)
    slices = (16, 8)
    W, b, A, B, scaling = _layer(g, 600, slices, 4, ranks=(4, 2, 3, 1))
    x, idx = torch.randn(21, 600, generator=g).to(DEVICE), _idx(g, 21)
    batch = lora_batch(idx, S)
    assert SMALL.lora.ticketed
    block_ids = LoraKernelConfig(fused=True, ticketed=False)
    for _ in range(2):
        ticketed = linear_lora(x, W, b, A, B, batch, scaling, slices=slices, config=SMALL)
        assert int(batch.ticket[0]) == 0 and int(batch.done[0]) == batch.counted[0]
        assert torch.equal(linear_lora(x, W, b, A, B, batch, scaling, slices=slices,
                                       config=replace(SMALL, lora=block_ids)), ticketed)
        base = torch.randn(21, 24, generator=g).to(DEVICE)
        want = add_lora(base.clone(), x, A, B, batch, scaling, slices=slices, config=replace(block_ids, ticketed=True))
        assert int(batch.ticket[0]) == 0 and not batch.arrivals.any()
        assert torch.equal(add_lora(base.clone(), x, A, B, batch, scaling, slices=slices, config=block_ids), want)
        assert int(batch.ticket[0]) == 0 and int(batch.done[0]) == batch.counted[0] and not batch.arrivals.any()


def test_token_slot_counts_out_of_range_slots_as_none():
    idx = torch.tensor([3, -1, 7, 0, -5, 2], dtype=torch.int32, device=DEVICE)
    assert lora_batch(idx, 4).token_slot.tolist() == [3, -1, -1, 0, -1, 2]


def test_bad_arguments_and_configs_are_refused():
    g = torch.Generator().manual_seed(0)
    W, _, A, B, scaling = _layer(g, 16, (16,), 4, ranks=(4, 4, 4, 4))
    x, idx = torch.randn(3, 16, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \[16, 16\]"):
        linear_lora(x, W[:8], None, A, B, idx, scaling)
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        linear_lora(x, W, torch.zeros(8, device=DEVICE), A, B, idx, scaling)
    with pytest.raises(ValueError, match="out must be x's dtype"):
        linear_lora(x, W, None, A, B, idx, scaling, out=torch.zeros(3, 16, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="slot assignment is for 2 tokens"):
        linear_lora(x, W, None, A, B, idx[:2], scaling)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        LinearLoraConfig(block_n=24)
    with pytest.raises(ValueError, match="block_r must be a power of two >= 1"):
        LinearLoraConfig(block_r=3)
    with pytest.raises(ValueError, match="expand_chunk must be a power of two >= 1"):
        LinearLoraConfig(expand_chunk=3)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        LinearLoraConfig(stages=0)
    with pytest.raises(ValueError, match="expand_stages must be >= 1"):
        LinearLoraConfig(expand_stages=0)
    with pytest.raises(ValueError, match="expand_early needs expand_by_slot, expand_b_rows and expand_chunk > 1"):
        LinearLoraConfig(expand_early=True, expand_chunk=1)


# ---- CUDA: the Llama-3.1-8B decode shapes in bfloat16 (test_kernels_lora.py's) ------------------------------------
def _bf16_layer(g, num_slots, in_features, slices, rank):
    n = sum(slices)
    W = torch.randn(n, in_features, generator=g) / in_features**0.5
    A = torch.randn(num_slots, len(slices) * rank, in_features, generator=g) / in_features**0.5
    B = torch.randn(num_slots, n, rank, generator=g) / rank**0.5
    return (W.to("cuda", torch.bfloat16), A.to("cuda", torch.bfloat16), B.to("cuda", torch.bfloat16),
            (torch.rand(num_slots, generator=g) + 0.5).cuda())


@cuda
@pytest.mark.parametrize("distinct", [1, 16])
@pytest.mark.parametrize("layer", sorted(LLAMA_8B))
def test_cuda_8b_decode_matches_cublas_then_the_reference(layer, distinct):
    """T = 64 over 64 rank-16 slots, 1 or 16 of them in the batch, against cuBLAS's F.linear then the reference's
    delta, and the expand's loop over slots pipelined or not (`expand_stages`) or in chunks of 4 or 8 slots
    (`expand_chunk`, their B blocks loaded row by row or not: `expand_b_rows`, the first chunk's before the wait
    or after: `expand_early`), and the shrink's loop in 2 stages or 3, giving the same bits. Tolerance (bfloat16):
    the two GEMMs sum `in` in different orders, so the rounded base may differ by an ulp of the float32 sum's
    magnitude, and y's rounding by one ulp in any entry:
    |ours - ref| <= 2**-7 * (|ref| + |x| @ |W|^T * 2**-8 + scaling * |y| @ |B|^T) elementwise."""
    from kernels.lora_ref import lora_shrink_ref

    in_features, slices = LLAMA_8B[layer]
    g = torch.Generator().manual_seed(distinct + len(layer))
    W, A, B, scaling = _bf16_layer(g, 64, in_features, slices, 16)
    x = torch.randn(64, in_features, generator=g).to("cuda", torch.bfloat16)
    idx = _decode_idx(64, distinct, 64)
    batch = lora_batch(idx, 64)
    config = linear_config_for(in_features, sum(slices))
    ours = linear_lora(x, W, None, A, B, batch, scaling, slices=slices, config=config)
    for changed in ({"expand_stages": 1, "expand_chunk": 1}, {"expand_stages": 2, "expand_chunk": 1},
                    {"expand_chunk": 1}, {"expand_chunk": 4}, {"expand_b_rows": False},
                    {"lora": replace(config.lora, shrink_stages=2)}, {"step_count": not config.step_count},
                    {"expand_early": not config.expand_early}):
        again = linear_lora(x, W, None, A, B, lora_batch(idx, 64), scaling, slices=slices,
                            config=replace(config, **changed))
        assert torch.equal(ours, again), changed
    base = F.linear(x, W)
    y = lora_shrink_ref(x, A, idx)
    ref = lora_expand_ref(y, B, idx, scaling, base.clone(), slices=slices).float()
    gemm_mag = x.abs().float() @ W.abs().float().t()
    mag = lora_expand_ref(y.abs(), B.abs(), idx, scaling, torch.zeros_like(base), slices=slices).float()
    err = (ours.float() - ref).abs()
    assert (err <= 2.0**-7 * (ref.abs() + gemm_mag * 2.0**-8 + mag)).all()


@cuda
def test_cuda_graph_of_a_decode_step_replays_eager_bits_across_slot_changes():
    g = torch.Generator().manual_seed(4)
    layers = [(name, *_bf16_layer(g, 64, LLAMA_8B[name][0], LLAMA_8B[name][1], 16)) for name in sorted(LLAMA_8B)]
    xs = {name: torch.randn(64, LLAMA_8B[name][0], generator=g).to("cuda", torch.bfloat16) for name in LLAMA_8B}
    outs = {name: torch.empty(64, sum(LLAMA_8B[name][1]), dtype=torch.bfloat16, device="cuda") for name in LLAMA_8B}
    idx = _decode_idx(64, 4, 64)

    def step(graphed: bool):
        batch = lora_batch(idx, 64)
        return {name: linear_lora(xs[name], W, None, A, B, batch, scaling, slices=LLAMA_8B[name][1],
                                  out=outs[name] if graphed else None) for name, W, A, B, scaling in layers}

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(True)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    for fill in (None, 16, -1, 7, None):
        if fill is None:
            idx.copy_(torch.randint(-1, 64, (64,), generator=g, dtype=torch.int32))
        else:
            idx.copy_(_decode_idx(64, fill, 64) if fill > 0 else torch.full_like(idx, -1))
        graph.replay()
        eager = step(False)
        torch.cuda.synchronize()
        for name in LLAMA_8B:
            assert torch.equal(outs[name], eager[name]), (fill, name)
