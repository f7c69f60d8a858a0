"""The Triton LoRA kernels (kernels/lora.py) against the torch reference (kernels/lora_ref.py) and a naive
per-token loop in float64, under the interpreter on the CPU (float32, tiny shapes): many slots in one batch with
tokens without an adapter, ranks below the slots' r_max, one token, the slices of a fused output, a shrink
with several splits; `add_lora` equals `lora_shrink` then `lora_expand` bitwise, its one launch equals its two
and the split halves the overlapped hook runs (`lora_shrink_partials` / `lora_expand_partials`),
every launch shape (`LoraKernelConfig` but the split-K chunk) gives the same bits, zero padding changes no bit,
and a token's result does not depend on the batch around it. With CUDA (skipped without), the same at the
Llama-3.1-8B shapes in bfloat16 for decode at batch 64 and across CUDA graph replays; more real shapes:
tests/test_gpu_lora_kernels.py. (The interpreter runs programs one after another in id order, so there the
expand programs of the one launch find their tiles' counters complete.)"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.lora import (BLOCK_M, LoraKernelConfig, add_lora, lora_batch, lora_expand,  # noqa: E402
                          lora_expand_partials, lora_shrink, lora_shrink_partials, max_tiles)
from kernels.lora_ref import add_lora_ref, lora_expand_ref, lora_shrink_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S = 4  # slots
TWO_LAUNCHES = LoraKernelConfig()  # the default
ONE_LAUNCH = LoraKernelConfig(fused=True)
LAUNCH_SHAPES = [ONE_LAUNCH, TWO_LAUNCHES, LoraKernelConfig(fused=True, groups_per_tile_row=1, block_n=16, num_warps=2),
                 LoraKernelConfig(fused=True, ticketed=False), LoraKernelConfig(groups_per_tile_row=8, block_n=64)]


def _stacks(g, in_features, slices, r_max, ranks, dtype=torch.float32):
    """Slot stacks with slot s holding a random adapter of rank ranks[s] (zero-padded to r_max) in every slice."""
    A = torch.zeros(S, len(slices) * r_max, in_features)
    B = torch.zeros(S, sum(slices), r_max)
    for s, r in enumerate(ranks):
        start = 0
        for j, width in enumerate(slices):
            A[s, j * r_max:j * r_max + r] = torch.randn(r, in_features, generator=g) / in_features**0.5
            B[s, start:start + width, :r] = torch.randn(width, r, generator=g)
            start += width
    scaling = torch.rand(S, generator=g) + 0.5
    return A.to(DEVICE, dtype), B.to(DEVICE, dtype), scaling.to(DEVICE)


def _per_token(out, x, A, B, idx, scaling, slices):
    """The definition, one token and one slice at a time, in float64."""
    r_max = B.shape[2]
    out = out.double().clone()
    for t, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        start = 0
        for j, width in enumerate(slices):
            y = A[s, j * r_max:(j + 1) * r_max].double() @ x[t].double()
            out[t, start:start + width] += scaling[s].double() * (B[s, start:start + width].double() @ y)
            start += width
    return out


def _idx(g, n):
    return torch.randint(-1, S, (n,), generator=g, dtype=torch.int32).to(DEVICE)


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("slices", [(24,), (16, 8, 8), (12, 20)])
@pytest.mark.parametrize("in_features", [40, 1100])  # one shrink split; three
def test_add_lora_matches_reference_and_per_token_loop(num_tokens, slices, in_features):
    g = torch.Generator().manual_seed(num_tokens * 1000 + in_features + len(slices))
    A, B, scaling = _stacks(g, in_features, slices, 8, ranks=(8, 3, 5, 1))
    x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
    idx = _idx(g, num_tokens)
    if num_tokens > 1:
        idx[0], idx[1] = -1, 2  # both kinds, whatever the draw
    base = torch.randn(num_tokens, sum(slices), generator=g).to(DEVICE)
    ours = add_lora(base.clone(), x, A, B, idx, scaling, slices=slices)
    ref = add_lora_ref(base.clone(), x, A, B, idx, scaling, slices=slices)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.double(), _per_token(base, x, A, B, idx, scaling, slices), rtol=1e-5, atol=1e-5)
    none = (idx < 0).nonzero().squeeze(1)
    assert torch.equal(ours[none], base[none])  # rows without an adapter are not touched


@pytest.mark.parametrize("config", [LoraKernelConfig(block_k=16, shrink_stages=1, split_k_chunk=64),
                                    LoraKernelConfig(block_k=64, shrink_stages=3, split_k_chunk=256, fused=False)],
                         ids=["k16-unpipelined", "k64-three-stages"])
def test_shrink_k_step_and_pipeline_stages_keep_the_reference(config):
    """The shrink's K step and its pipeline stages (4 and 3 steps a split of a ragged 1100: partial last steps)."""
    g = torch.Generator().manual_seed(11)
    A, B, scaling = _stacks(g, 1100, (16, 8, 8), 8, ranks=(8, 3, 5, 1))
    x = torch.randn(37, 1100, generator=g).to(DEVICE)
    idx = _idx(g, 37)
    base = torch.randn(37, 32, generator=g).to(DEVICE)
    ours = add_lora(base.clone(), x, A, B, idx, scaling, slices=(16, 8, 8), config=config)
    torch.testing.assert_close(ours, add_lora_ref(base.clone(), x, A, B, idx, scaling, slices=(16, 8, 8)),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora_shrink(x, A, idx, config=config), lora_shrink_ref(x, A, idx), rtol=1e-5,
                               atol=1e-5)


def test_a_float32_out_of_zeros_receives_the_unrounded_delta_of_half_weights():
    """out may be float32 under float16 operands: into zeros, add_lora writes each adapter token's delta unrounded
    (the reference's, computed in float32 from the same float16 values); rows without an adapter stay zero."""
    g = torch.Generator().manual_seed(5)
    A, B, scaling = _stacks(g, 300, (16, 8, 8), 8, ranks=(8, 3, 5, 1), dtype=torch.float16)
    x = torch.randn(23, 300, generator=g).to(DEVICE, torch.float16)
    idx = _idx(g, 23)
    idx[0], idx[1] = -1, 2
    delta = add_lora(torch.zeros(23, 32, device=DEVICE), x, A, B, idx, scaling, slices=(16, 8, 8))
    assert delta.dtype == torch.float32
    ref = add_lora_ref(torch.zeros(23, 32), x.cpu().float(), A.cpu().float(), B.cpu().float(), idx.cpu(),
                       scaling.cpu(), slices=(16, 8, 8))
    torch.testing.assert_close(delta.cpu(), ref, rtol=2e-3, atol=2e-3)  # y rounded to float16 before the expand
    assert not delta[idx < 0].any() and delta[idx >= 0].abs().sum() > 0


@pytest.mark.parametrize("in_features", [24, 1100])
def test_shrink_matches_reference_with_zero_rows_for_no_adapter(in_features):
    g = torch.Generator().manual_seed(in_features)
    A, _, _ = _stacks(g, in_features, (16, 16), 8, ranks=(8, 8, 2, 4))
    x = torch.randn(21, in_features, generator=g).to(DEVICE)
    idx = _idx(g, 21)
    idx[3] = -1
    y = lora_shrink(x, A, idx)
    assert y.dtype == torch.float32 and y.shape == (21, 16)
    torch.testing.assert_close(y, lora_shrink_ref(x, A, idx), rtol=1e-5, atol=1e-5)
    assert not y[idx < 0].any()


@pytest.mark.parametrize("accumulate", [True, False])
def test_expand_adds_or_replaces(accumulate):
    g = torch.Generator().manual_seed(7)
    _, B, scaling = _stacks(g, 8, (16, 8, 8), 8, ranks=(8, 6, 8, 3))
    idx = _idx(g, 19)
    idx[0] = -1
    y = lora_shrink_ref(torch.randn(19, 8, generator=g), torch.randn(S, 24, 8, generator=g), idx.cpu()).to(DEVICE)
    base = torch.randn(19, 32, generator=g).to(DEVICE)
    ours = lora_expand(y, B, idx, scaling, base.clone(), accumulate, slices=(16, 8, 8))
    ref = lora_expand_ref(y, B, idx, scaling, base.clone(), accumulate, slices=(16, 8, 8))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    none = idx < 0
    assert torch.equal(ours[none], base[none] if accumulate else torch.zeros_like(base[none]))


def test_fused_entry_equals_shrink_then_expand_bitwise():
    g = torch.Generator().manual_seed(3)
    A, B, scaling = _stacks(g, 1100, (16, 8, 8), 8, ranks=(8, 2, 7, 8))
    x, idx = torch.randn(30, 1100, generator=g).to(DEVICE), _idx(g, 30)
    base = torch.randn(30, 32, generator=g).to(DEVICE)
    fused = add_lora(base.clone(), x, A, B, idx, scaling, slices=(16, 8, 8), config=ONE_LAUNCH)
    two = lora_expand(lora_shrink(x, A, idx), B, idx, scaling, base.clone(), slices=(16, 8, 8))
    assert torch.equal(fused, two)


@pytest.mark.parametrize("config", [LoraKernelConfig(), LoraKernelConfig(groups_per_tile_row=1, block_n=16)],
                         ids=["default", "narrow"])
@pytest.mark.parametrize(("num_tokens", "in_features"), [(1, 40), (30, 1100), (19, 9000)])  # splits: 1, 3, 16
def test_split_shrink_then_expand_equals_add_lora_bitwise(config, num_tokens, in_features):
    """`lora_shrink_partials` then `lora_expand_partials` (the overlapped hook's halves, here on one stream) give
    `add_lora`'s bits, layer after layer over one plan, touch no row without an adapter and leave the arrival
    counters at zero; the partials are the splits `lora_shrink` sums."""
    g = torch.Generator().manual_seed(num_tokens + in_features)
    slices = (16, 8, 8)
    A, B, scaling = _stacks(g, in_features, slices, 8, ranks=(8, 2, 7, 8))
    idx = _idx(g, num_tokens)
    if num_tokens > 2:
        idx[:3] = torch.tensor([-1, 3, 0])
    batch = lora_batch(idx, S)
    for layer in range(2):
        x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
        base = torch.randn(num_tokens, 32, generator=g).to(DEVICE)
        partials = lora_shrink_partials(x, A, batch if layer else idx, config=config)  # a plan, or built from idx
        assert partials.stream is None and partials.part.shape[1:] == (num_tokens, 24)
        assert not batch.arrivals.any() and not partials.batch.arrivals.any()
        ours = lora_expand_partials(base.clone(), partials, B, scaling, slices=slices)
        for fused in (True, False):
            one = LoraKernelConfig(fused=fused, groups_per_tile_row=config.groups_per_tile_row, block_n=config.block_n)
            assert torch.equal(ours, add_lora(base.clone(), x, A, B, batch, scaling, slices=slices, config=one)), layer
        assert torch.equal(ours[idx < 0], base[idx < 0])
        assert not batch.arrivals.any() and not partials.batch.arrivals.any()
        rows = idx >= 0
        assert torch.equal(_split_sum(partials.part)[rows], lora_shrink(x, A, batch, config=config)[rows])
    torch.testing.assert_close(ours, add_lora_ref(base.clone(), x, A, B, idx, scaling, slices=slices),
                               rtol=1e-5, atol=1e-5)


def _split_sum(part):
    """The splits of a shrink's partials summed in split order (as the expand and `lora_shrink` sum them)."""
    y = part[0].clone()
    for p in range(1, part.shape[0]):
        y += part[p]
    return y


def test_split_halves_refuse_bad_arguments():
    A, B, scaling = torch.zeros(S, 8, 16), torch.zeros(S, 12, 8), torch.ones(S)
    x, idx = torch.zeros(3, 16), torch.zeros(3, dtype=torch.int32)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="stream must be a CUDA stream"):
            lora_shrink_partials(x, A, idx, stream=object())
    partials = lora_shrink_partials(x.to(DEVICE), A.to(DEVICE), idx.to(DEVICE))
    with pytest.raises(ValueError, match="must agree in S, r_max"):
        lora_expand_partials(torch.zeros(3, 12, device=DEVICE), partials, B.to(DEVICE), scaling.to(DEVICE),
                             slices=(6, 6))
    with pytest.raises(ValueError, match="out must have x's 3 rows"):
        lora_expand_partials(torch.zeros(4, 12, device=DEVICE), partials, B.to(DEVICE), scaling.to(DEVICE))
    empty = lora_shrink_partials(torch.zeros(0, 16, device=DEVICE), A.to(DEVICE),
                                 torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert lora_expand_partials(torch.zeros(0, 12, device=DEVICE), empty, B.to(DEVICE),
                                scaling.to(DEVICE)).shape == (0, 12)


def test_zero_padding_to_r_max_changes_no_bit():
    g = torch.Generator().manual_seed(11)
    slices, in_features = (16, 8, 8), 40
    A4, B4, scaling = _stacks(g, in_features, slices, 4, ranks=(4, 3, 4, 2))
    A32 = torch.zeros(S, 3 * 32, in_features, device=DEVICE)  # the same adapters in slots of r_max 32
    B32 = torch.zeros(S, 32, 32, device=DEVICE)
    for j in range(3):
        A32[:, j * 32:j * 32 + 4] = A4[:, j * 4:(j + 1) * 4]
    B32[:, :, :4] = B4
    x, idx = torch.randn(23, in_features, generator=g).to(DEVICE), _idx(g, 23)
    base = torch.randn(23, 32, generator=g).to(DEVICE)
    assert torch.equal(add_lora(base.clone(), x, A4, B4, idx, scaling, slices=slices),
                       add_lora(base.clone(), x, A32, B32, idx, scaling, slices=slices))


@pytest.mark.parametrize("num_tokens", [37, 70])  # different tile groups per launch
def test_each_token_gets_the_bits_it_gets_alone(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    A, B, scaling = _stacks(g, 1100, (16, 8, 8), 8, ranks=(8, 5, 8, 1))
    x, idx = torch.randn(num_tokens, 1100, generator=g).to(DEVICE), _idx(g, num_tokens)
    base = torch.randn(num_tokens, 32, generator=g).to(DEVICE)
    batch = add_lora(base.clone(), x, A, B, idx, scaling, slices=(16, 8, 8))
    for t in (0, 1, num_tokens // 2, num_tokens - 1):
        alone = add_lora(base[t:t + 1].clone(), x[t:t + 1], A, B, idx[t:t + 1], scaling, slices=(16, 8, 8),
                         config=LAUNCH_SHAPES[t % len(LAUNCH_SHAPES)])  # any launch shape: the same bits
        assert torch.equal(batch[t:t + 1], alone), t


@pytest.mark.parametrize("num_slots", [1, 4, 37])
@pytest.mark.parametrize("num_tokens", [1, 16, 53])
def test_lora_batch_tiles_cover_each_adapter_token_once(num_slots, num_tokens):
    g = torch.Generator().manual_seed(num_slots * 100 + num_tokens)
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int64)
    idx[:20] = num_slots - 1  # a slot with more than one tile when there are more than 16 tokens
    idx[-1] = num_slots + 3  # out of range: no adapter
    batch = lora_batch(idx.to(DEVICE), num_slots)
    assert batch.tile_len.shape[0] == max_tiles(num_tokens, num_slots)
    used = int(batch.num_tiles[0])
    key = torch.where((idx >= 0) & (idx < num_slots), idx, num_slots)
    assert batch.order.tolist() == torch.argsort(key, stable=True).tolist()  # by slot, stable, no adapter last
    seen = []
    for j, (start, length, slot) in enumerate(zip(batch.tile_start.tolist(), batch.tile_len.tolist(),
                                                   batch.tile_slot.tolist())):
        if j >= used:
            assert (length, slot) == (0, -1)
            continue
        assert 1 <= length <= BLOCK_M and 0 <= slot < num_slots
        tokens = batch.order[start:start + length].tolist()
        assert all(idx[t].item() == slot for t in tokens)
        seen += tokens
    assert sorted(seen) == [t for t in range(num_tokens) if 0 <= idx[t] < num_slots]  # each adapter token once
    assert used == sum(-(-int((idx == s).sum()) // BLOCK_M) for s in range(num_slots))
    assert not batch.arrivals.any()


@pytest.mark.parametrize(("num_slots", "num_tokens", "in_features"),  # shrink splits: one; three; sixteen (the most)
                         [(s, t, k) for s in (1, 3, 20) for t in (2, 17, 45) for k in (40, 1100)] + [(3, 17, 9000)])
def test_slot_counts_token_counts_and_tokens_without_an_adapter(num_slots, num_tokens, in_features):
    """Against the reference at several slot and token counts, with a share of tokens without an adapter (all of
    them in one case); one `lora_batch` serves several layers in a row (the shrink's counters are left at zero)."""
    g = torch.Generator().manual_seed(num_slots * 1000 + num_tokens + in_features)
    slices = (16, 8, 8)
    A = (torch.randn(num_slots, 24, in_features, generator=g) / in_features**0.5).to(DEVICE)
    B = torch.randn(num_slots, 32, 8, generator=g).to(DEVICE)
    scaling = (torch.rand(num_slots, generator=g) + 0.5).to(DEVICE)
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    idx[: num_tokens // 3] = -1
    for case in (idx, torch.full_like(idx, -1)):
        case = case.to(DEVICE)
        batch = lora_batch(case, num_slots)
        for layer in range(2):
            x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
            base = torch.randn(num_tokens, 32, generator=g).to(DEVICE)
            ours = add_lora(base.clone(), x, A, B, batch, scaling, slices=slices)
            torch.testing.assert_close(ours, add_lora_ref(base.clone(), x, A, B, case, scaling, slices=slices),
                                       rtol=1e-5, atol=1e-5)
            assert torch.equal(ours[case < 0], base[case < 0])
            assert torch.equal(ours, add_lora(base.clone(), x, A, B, case, scaling, slices=slices)), layer
            assert not batch.arrivals.any()


def test_empty_batch_and_bad_arguments():
    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    A, B, scaling = zeros(S, 8, 16), zeros(S, 12, 8), torch.ones(S, device=DEVICE)
    empty = zeros(0, dtype=torch.int32)
    assert lora_shrink(zeros(0, 16), A, empty).shape == (0, 8)
    assert add_lora(zeros(0, 12), zeros(0, 16), A, B, empty, scaling).shape == (0, 12)
    x, out, idx = zeros(3, 16), zeros(3, 12), zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="slices must be"):
        add_lora(out, x, A, B, idx, scaling, slices=(8, 3))
    with pytest.raises(ValueError, match="slices must be"):
        add_lora(out, x, A, B, idx, scaling, slices=(3, 3, 3, 3))
    with pytest.raises(ValueError, match="must agree in S, r_max"):
        add_lora(out, x, A, B, idx, scaling, slices=(6, 6))  # A has one slice's rows
    with pytest.raises(ValueError, match=r"A must be \[S, R, 16\]"):
        lora_shrink(x, torch.zeros(S, 8, 15, device=DEVICE), idx)
    with pytest.raises(ValueError, match="scaling must be"):
        add_lora(out, x, A, B, idx, torch.ones(S, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        add_lora(out.t(), x, A, B, idx, scaling)
    with pytest.raises(ValueError, match="the slot assignment is for 3 tokens and 5 slots"):
        lora_shrink(x, A, lora_batch(idx, S + 1))
    with pytest.raises(ValueError, match="idx must be"):
        lora_batch(idx.float(), S)
    with pytest.raises(ValueError, match="y must be"):
        lora_expand(torch.zeros(3, 8, dtype=torch.float16, device=DEVICE), B, idx, scaling, out)



@pytest.mark.parametrize("config", LAUNCH_SHAPES, ids=["fused", "two", "fused-narrow", "fused-block-ids", "two-wide"])
@pytest.mark.parametrize(("num_tokens", "in_features"), [(1, 40), (19, 1100), (45, 9000)])  # splits: 1, 3, 16
def test_every_launch_shape_gives_the_bits_of_the_default(config, num_tokens, in_features):
    """One launch or two, tile groups, column blocks and warps move work between programs only: the bits are
    the default's, the reference's within rounding, rows without an adapter untouched, the counters left at
    zero after several layers over one plan."""
    g = torch.Generator().manual_seed(num_tokens + in_features)
    slices = (16, 8, 8)
    A, B, scaling = _stacks(g, in_features, slices, 8, ranks=(8, 1, 5, 8))
    idx = _idx(g, num_tokens)
    if num_tokens > 2:
        idx[:3] = torch.tensor([-1, 3, 3])
    batch = lora_batch(idx, S)
    for layer in range(2):
        x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
        base = torch.randn(num_tokens, 32, generator=g).to(DEVICE)
        ours = add_lora(base.clone(), x, A, B, batch, scaling, slices=slices, config=config)
        assert torch.equal(ours, add_lora(base.clone(), x, A, B, idx, scaling, slices=slices)), layer
        torch.testing.assert_close(ours, add_lora_ref(base.clone(), x, A, B, idx, scaling, slices=slices),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(ours[idx < 0], base[idx < 0])
        assert not batch.arrivals.any()
    y = lora_shrink(x, A, batch, config=config)
    assert torch.equal(lora_expand(y, B, batch, scaling, base.clone(), slices=slices, config=config), ours)


def test_one_plan_reused_after_the_slot_assignment_changes():
    """As a replayed step does: the same idx tensor rewritten in place, the plan rebuilt from it, the layers run
    again in one launch each (all tokens without an adapter; one adapter for all; a fresh mix)."""
    g = torch.Generator().manual_seed(5)
    A, B, scaling = _stacks(g, 1100, (16, 8, 8), 8, ranks=(8, 4, 8, 2))
    idx = _idx(g, 33)
    x, base = torch.randn(33, 1100, generator=g).to(DEVICE), torch.randn(33, 32, generator=g).to(DEVICE)
    for trial, assign in enumerate((None, -1, 2, None)):
        if assign is None:
            idx.copy_(_idx(g, 33))
        else:
            idx.fill_(assign)
        batch = lora_batch(idx, S)
        out = add_lora(add_lora(base.clone(), x, A, B, batch, scaling, slices=(16, 8, 8)), x, A, B, batch, scaling,
                       slices=(16, 8, 8))
        ref = add_lora_ref(add_lora_ref(base.clone(), x, A, B, idx, scaling, slices=(16, 8, 8)), x, A, B, idx,
                           scaling, slices=(16, 8, 8))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[idx < 0], base[idx < 0]), trial
        assert not batch.arrivals.any()


def test_tile_tokens_list_each_tiles_tokens():
    g = torch.Generator().manual_seed(9)
    idx = torch.randint(-1, 3, (41,), generator=g, dtype=torch.int32)
    idx[:18] = 1
    batch = lora_batch(idx.to(DEVICE), 3)
    for j in range(batch.tile_slot.shape[0]):
        start, length = int(batch.tile_start[j]), int(batch.tile_len[j])
        want = batch.order[start:start + length].tolist() + [-1] * (BLOCK_M - length)
        assert batch.tile_tokens[j].tolist() == want, j
    used = int(batch.num_tiles[0])
    assert (batch.tile_slot[:used] >= 0).all() and (batch.tile_slot[used:] == -1).all()


@pytest.mark.parametrize("num_slots", [1, 5, 64])
def test_the_plan_lists_the_slots_in_use_ascending(num_slots):
    """`used_slots` / `num_used`: each slot with at least one token, ascending, then -1; values outside the stacks
    (and -1) use none. Over seeds with none, some and all slots in use."""
    for seed, width in ((0, 0), (1, 3), (2, num_slots + 2)):
        g = torch.Generator().manual_seed(seed + num_slots)
        idx = torch.randint(-1, width, (70,), generator=g, dtype=torch.int32)
        if seed == 2:
            idx[:num_slots] = torch.arange(num_slots, dtype=torch.int32)  # every slot in use
        batch = lora_batch(idx.to(DEVICE), num_slots)
        want = sorted({v for v in idx.tolist() if 0 <= v < num_slots})
        assert int(batch.num_used[0]) == len(want), seed
        assert batch.used_slots.tolist() == want + [-1] * (num_slots - len(want)), seed


def test_bad_launch_configs_are_refused():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        LoraKernelConfig(block_n=96)
    with pytest.raises(ValueError, match="groups_per_tile_row must be >= 1"):
        LoraKernelConfig(groups_per_tile_row=0)
    with pytest.raises(ValueError, match="block_k must be None or a power of two"):
        LoraKernelConfig(block_k=48)
    with pytest.raises(ValueError, match="or float32 with unit stride"):
        add_lora(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 8, 2),
                 torch.zeros(2, dtype=torch.int32), torch.ones(1))
    with pytest.raises(ValueError, match="shrink_stages must be >= 1"):
        LoraKernelConfig(shrink_stages=0)


# ---- CUDA: the Llama-3.1-8B decode shapes in bfloat16 ------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LLAMA_8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
            "down": (14336, (4096,))}


def _bf16_stacks(g, num_slots, in_features, slices, rank):
    A = torch.randn(num_slots, len(slices) * rank, in_features, generator=g) / in_features**0.5
    B = torch.randn(num_slots, sum(slices), rank, generator=g) / rank**0.5
    return (A.to("cuda", torch.bfloat16), B.to("cuda", torch.bfloat16),
            (torch.rand(num_slots, generator=g) + 0.5).cuda())


def _decode_idx(num_tokens, distinct, num_slots):
    idx = torch.arange(num_tokens, dtype=torch.int32) % distinct * (num_slots // distinct)  # spread over the slots
    idx[5] = -1
    return idx.cuda()


@cuda
@pytest.mark.parametrize("distinct", [1, 16])
@pytest.mark.parametrize("layer", sorted(LLAMA_8B))
def test_cuda_8b_decode_matches_the_reference_one_launch_and_two(layer, distinct):
    """T = 64 over 64 rank-16 slots, 1 or 16 of them in the batch. Tolerance (bfloat16): the kernel and the
    reference sum y in float32 in different orders, so y's rounding may differ by one ulp in any entry and the
    output's by one more: |ours - ref| <= 2**-7 * (|ref| + scaling * |y| @ |B|^T) elementwise."""
    from kernels.lora_ref import lora_expand_ref, lora_shrink_ref

    in_features, slices = LLAMA_8B[layer]
    g = torch.Generator().manual_seed(distinct + len(layer))
    A, B, scaling = _bf16_stacks(g, 64, in_features, slices, 16)
    x = torch.randn(64, in_features, generator=g).to("cuda", torch.bfloat16)
    base = torch.randn(64, sum(slices), generator=g).to("cuda", torch.bfloat16)
    idx = _decode_idx(64, distinct, 64)
    batch = lora_batch(idx, 64)
    fused = add_lora(base.clone(), x, A, B, batch, scaling, slices=slices, config=ONE_LAUNCH)
    two = add_lora(base.clone(), x, A, B, batch, scaling, slices=slices, config=TWO_LAUNCHES)
    assert torch.equal(fused, two)
    assert not batch.arrivals.any() and int(batch.ticket[0]) == 0
    y = lora_shrink_ref(x, A, idx)
    ref = lora_expand_ref(y, B, idx, scaling, base.clone(), slices=slices)
    mag = lora_expand_ref(y.abs(), B.abs(), idx, scaling, torch.zeros_like(base), slices=slices).float()
    err = (fused.float() - ref.float()).abs()
    assert (err <= 2.0**-7 * (ref.float().abs() + mag)).all()
    assert torch.equal(fused[idx < 0], base[idx < 0])


@cuda
def test_cuda_8b_token_bits_alone_and_in_any_batch():
    in_features, slices = LLAMA_8B["qkv"]
    g = torch.Generator().manual_seed(2)
    A, B, scaling = _bf16_stacks(g, 64, in_features, slices, 16)
    x = torch.randn(64, in_features, generator=g).to("cuda", torch.bfloat16)
    base = torch.randn(64, sum(slices), generator=g).to("cuda", torch.bfloat16)
    mixed = _decode_idx(64, 16, 64)
    batch = add_lora(base.clone(), x, A, B, mixed, scaling, slices=slices)
    for t in (0, 17, 63):
        alone = add_lora(base[t:t + 1].clone(), x[t:t + 1], A, B, mixed[t:t + 1], scaling, slices=slices,
                         config=TWO_LAUNCHES)
        assert torch.equal(batch[t:t + 1], alone), t
    same = add_lora(base.clone(), x, A, B, torch.full_like(mixed, int(mixed[17])), scaling, slices=slices,
                    config=LoraKernelConfig(fused=True, groups_per_tile_row=1, block_n=256, num_warps=8))
    assert torch.equal(same[17], batch[17])  # other adapters around it, other launch shape: the same bits


@cuda
@pytest.mark.parametrize("config", [ONE_LAUNCH, TWO_LAUNCHES], ids=["fused", "two"])
def test_cuda_graph_of_a_decode_step_replays_eager_bits_across_slot_changes(config):
    g = torch.Generator().manual_seed(4)
    layers = [(name, *_bf16_stacks(g, 64, LLAMA_8B[name][0], LLAMA_8B[name][1], 16)) for name in sorted(LLAMA_8B)]
    xs = {name: torch.randn(64, LLAMA_8B[name][0], generator=g).to("cuda", torch.bfloat16) for name in LLAMA_8B}
    bases = {name: torch.randn(64, sum(LLAMA_8B[name][1]), generator=g).to("cuda", torch.bfloat16)
             for name in LLAMA_8B}
    outs = {name: torch.empty_like(b) for name, b in bases.items()}
    idx = _decode_idx(64, 4, 64)

    def step(graphed: bool):
        batch = lora_batch(idx, 64)
        result = {}
        for name, A, B, scaling in layers:
            out = outs[name] if graphed else bases[name].clone()
            if graphed:
                out.copy_(bases[name])
            result[name] = add_lora(out, xs[name], A, B, batch, scaling, slices=LLAMA_8B[name][1], config=config)
        return result

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(True)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    for trial, fill in enumerate((None, 16, -1, 7, None)):
        if fill is None:
            idx.copy_(torch.randint(-1, 64, (64,), generator=g, dtype=torch.int32))
        else:
            idx.copy_(_decode_idx(64, fill, 64) if fill > 0 else torch.full_like(idx, -1))
        graph.replay()
        eager = step(False)
        for name in LLAMA_8B:
            assert torch.equal(outs[name], eager[name]), (trial, name)
