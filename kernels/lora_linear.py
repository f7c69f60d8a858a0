"""A decode step's linear layer and its LoRA deltas in one Triton launch: out = x W^T (+ b) + each token's adapter
delta, with the delta added in the GEMM's epilogue instead of by a second kernel reading the output back.

`kernels/lora.py` adds the deltas after the base GEMM (a cuBLAS call): at a decode batch its hooks are short,
latency-bound kernels between the projections. Here one grid does both. Its lower program ids are the LoRA shrink's
programs (`kernels.lora._shrink_tiles`: the step's adapter tokens in tiles of one slot, partial sums of x A[slot]^T
over a fixed number of splits of `in`), each counting itself into the plan's counter (`LoraBatch.done`, a release
atomic) when its tiles are done. The counter runs through the step: zeroed by `lora_batch`, it reaches the shrink
programs of every launch so far, a sum the host keeps (`LoraBatch.counted`) and hands each launch as the value to
wait for. The programs after them are the GEMM's: one [BLOCK_M, BLOCK_N] block of the output each (BLOCK_N columns
within one slice of a fused output, BLOCK_M = 64 token rows: a decode batch is one row block), walking `in` in
BLOCK_K steps with tensor-core dots. A GEMM program rounds its block to the output dtype, then waits until the
counter reaches its launch's value, read with acquire semantics (by then long done: the shrink is small next to a
weight's read), and adds each row's delta: the row's partials summed in split order and rounded to the weights'
dtype, times its slot's B rows for the block's columns (float32 sums over the rank), scaled, added to the rounded
base in float32, rounded once: the numerics of `kernels/lora_ref.py` on the rounded output of the layer, so rows
without an adapter get the GEMM's result alone. By default that product is one tensor-core dot per slot the step
uses (the plan's list of them, `LoraBatch.used_slots`, ascending): the block's rows of that slot, the others'
masked to zero (exact zeros, so a row's sum is its own slot's dot alone), times the slot's B block, read once per
block; from 8 slots on, one dot per 8 of them (`expand_chunk`); `expand_by_slot=False` gathers each row's B rows
instead. Roles follow the order in which programs start (a ticket, `LoraKernelConfig.ticketed`, as
in `kernels/lora.py`'s one launch): the lower tickets are the shrink's, so every program a GEMM program waits on
has started, and the waits end.

Nothing is read back to the host and the grid is a function of T and the shapes, so it can be captured in a CUDA
graph and replayed with new slot assignments. The shrink's bits are `add_lora`'s under the same
`LoraKernelConfig` (same splits, same order; the fused linear's default splits are coarser, `SHRINK_CONFIG`); the
base GEMM's are not cuBLAS's (another tile order over `in`), and the expand sums the rank in another order than
`add_lora`'s dot: not for deterministic mode, whose linears are `kernels/matmul.py`'s.

The reference is `linear_lora_ref` (kernels/lora_ref.py). Not here: more than a few row blocks (a prefill's
linears belong to a GEMM library and `add_lora`), split-K of the GEMM, tensor-parallel sharding (the caller passes
its shard's weight and stacks, as for `add_lora`). Measured and left out (one H100, Llama-3.1-8B shapes, batch 64,
µs a hook at 0 / 1 / 4 / 16 distinct adapters, 2026-12-07, against 2.80 / 5.32 / 6.85 / 14.2 for the one launch
then): the shrink in a launch of its own before the GEMM's, 3.58 / 7.95 / 9.79 / 15.41; four GEMM stages (two of
down_proj's programs an SM), 7.84 / 12.56 / 14.16 / 18.52. Later that night (one H100, against the defaults' 1.56
/ 3.91 / 5.47 / 8.10, `python bench/lora_kernels.py --replays 3 --distinct 0,1,4,16`, docs/LORA_DECODE.md): the
slots' B blocks prefetched into L2 when a GEMM program starts, 1.77 / 4.22 / 5.93 / 9.62 (as last to evict, with
the weights first to evict, 1.72 / 3.69 / 5.35 / 8.75).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels.lora import (BLOCK_M as TILE_M, _FLAG_STRIDE, LoraBatch, LoraKernelConfig, _as_batch, _block_k,
                          _block_r, _check_layer, _check_x_a, _empty_partials, _program_role, _shrink_split,
                          _shrink_tiles, _tile_groups)

BLOCK_M = 64  # token rows per GEMM program (the smallest M of Hopper's wgmma)
DOT_R = 16  # rank entries per step of the expand by slot (the K of a 16-bit tensor-core dot)
_COMPILED = os.environ.get("TRITON_INTERPRET") != "1"  # Triton compiles (inline PTX allowed), not interprets


SHRINK_CONFIG = LoraKernelConfig(split_k_chunk=2048, shrink_stages=3)
"""The fused linear's shrink: splits of 2048 in-features (2 for a 4096-wide input, 7 for down_proj's 14336), fewer
partials for each GEMM program's epilogue to wait on and sum than `add_lora`'s 512 (one H100, Llama-3.1-8B shapes,
batch 64, µs a hook at 0 / 1 / 4 / 16 distinct adapters, splits of 2048 / 512: 1.98 / 2.80, 4.85 / 5.32, 6.43 /
6.85, 11.77 / 14.2, `bench/gpu_round.sh lora-linear`, 2026-12-07). Its sums are then not `add_lora`'s: the fused
linear is not batch-invariant anyway (its GEMM is not cuBLAS's). Three stages in its loop: at two, Triton's loop
waits for every copy in flight at each K step; at three it keeps two in flight (qkv_proj then takes 184 registers,
no spill; µs a hook at 1 / 4 / 16 adapters, one H100, same bench and batch, with the B tiles of
`LinearLoraConfig.expand_b_rows`: two stages 4.60 / 5.67 / 9.89, three 4.02 / 5.05 / 9.28, 2026-12-07). The stages
move no bit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearLoraConfig:
    """How `linear_lora` launches. The GEMM's tile (block_n, block_k) and the expand's rank step (block_r) move its
    sums; `lora`'s split-K chunk fixes the shrink's, as for `add_lora`."""

    block_n: int = 32
    """Output columns per GEMM program (within one slice of a fused output)."""
    block_k: int = 128
    """In-features per step of the GEMM's loop."""
    stages: int = 4
    """Software-pipeline stages of the GEMM's loop."""
    num_warps: int = 4
    """Warps per program, shrink and GEMM."""
    expand_by_slot: bool = True
    """The epilogue's expand as one tensor-core dot per slot the step uses: the block's rows of that slot (the
    others masked to zero) times the slot's B block, `DOT_R` rank entries a step (B read once per slot and
    block). False: each row's own B rows gathered, `block_r` rank entries a step (a [BLOCK_M, block_n, block_r]
    product), B read once per row."""
    block_r: int = 4
    """Rank entries per step of the gathered expand (`expand_by_slot=False`)."""
    expand_stages: int = 3
    """Software-pipeline stages of the expand by slot's loop over the slots the step uses, taken when the step uses
    at least that many slots (1: never): with 16 adapters in a batch, 16 loads of B blocks in a row, each waiting
    for the last without it; with one, the pipeline's prologue only costs (one H100, 8B shape, batch 64, µs a
    hook, none / 3 stages: 5.6 / 7.1 at one adapter, 20.5 / 16.6 at 16; 3 is also what Triton gives the loop
    unasked). The loop over chunks of slots (`expand_chunk`), taken only from `expand_chunk` slots on, always runs
    in this many stages."""
    expand_chunk: int = 8
    """Slots a tensor-core dot of the expand by slot takes once the step uses at least that many (1: one dot per
    slot): the rows' y spread over `expand_chunk` blocks of `DOT_R` entries (a row's in its slot's block, exact
    zeros in the others) times those slots' B blocks stacked, one dot of K = expand_chunk * DOT_R in place of
    `expand_chunk` dots of K = DOT_R in a row, each waiting for the last. The same bits: a row's products fall in
    one K step of 16 either way, in the same slot order, and the other steps add exact zeros. 8 since 2026-12-07
    (late), 4 before: 8B shapes, batch 64, µs a hook at 1 / 4 / 16 distinct adapters, 4 then 8 (`python
    bench/lora_kernels.py --systems linear_by_shape,linear_by_shape_chunk8 --replays 3 --distinct 1,4,16` in `bash
    bench/gpu_round.sh lora-linear`): one H100, 4.02 / 5.33 / 9.40 and 4.19 / 5.63 / 8.18; one H200, 5.56 / 6.39 /
    10.09 and 5.64 / 6.99 / 8.93, and in the engine there (the decode graph's time over the base's, `python
    bench/lora.py --device cuda --fused-linear only --linear-system linear_by_shape,linear_by_shape_chunk8`) 13.5% /
    15.6% / 24.6% and 13.5% / 16.7% / 21.7%; on the H100 in a later call, 8.6% / 10.7% / 18.9% and 8.8% / 11.8% /
    16.3% (docs/LORA_DECODE.md). Four slots to seven then take one dot a slot. Measured and taken out
    (docs/LORA_DECODE.md): chunks of 8 from 2 or 4 slots on (no faster at four), and chunks of 8 from 8 slots with
    chunks of 4 from 4 (spills in gate_up_proj's kernel; with 8 warps there, twice as slow). gate_up_proj's kernel
    takes 255 registers a thread, no spill. Earlier (one
    H100, µs a hook at 0 / 1 / 16 adapters, `--systems default,linear_by_shape,linear_by_shape_chunk4,
    linear_by_shape_chunk16`, one dot a slot then the default): one per slot 1.88 / 4.82 / 11.69, chunks of 4 1.99 /
    4.93 / 10.64, of 16 4.77 / 7.94 / 13.35 (the larger chunk's registers cost even where its loop is not taken)."""
    expand_b_rows: bool = True
    """The chunks' B blocks (`expand_chunk` > 1) as one [expand_chunk * DOT_R, block_n] tile, each row's address
    from its slot (the plan's list read row by row), which feeds the tensor-core dot as it is loaded, the next
    chunk's copy in flight meanwhile. False: a [expand_chunk, DOT_R, block_n] block reshaped to that tile, which
    Triton takes from shared memory to registers and back, waiting for every copy at each chunk
    (docs/LORA_DECODE.md). The same bits either way. One H100, 8B shapes, batch 64, µs a hook at 0 / 1 / 4 / 16
    distinct adapters with two shrink stages (`python bench/lora_kernels.py --systems
    linear_by_shape_b_reshaped_shrink_stages2,linear_by_shape_shrink_stages2 --replays 3 --distinct 0,1,4,16`,
    2026-12-07, reshaped then row by row): 1.79 / 4.54 / 5.70 / 10.16 and 1.67 / 4.60 / 5.67 / 9.89; with three,
    the default, 1.72 / 4.04 / 5.16 / 9.82 and 1.73 / 4.02 / 5.05 / 9.28."""
    step_count: bool = True
    """The epilogue's wait without a count of its own: the GEMM programs wait until the plan's counter
    (`LoraBatch.done`, zeroed once a step by `lora_batch`) holds the shrink programs of this and every earlier
    launch of the step (the host keeps that sum, `LoraBatch.counted`), read with acquire semantics. False: each
    GEMM program counts itself in after its wait (an atomic on one word for every program of the launch) and the
    last one takes the counter back to zero. The same bits. One H100, 8B shapes, batch 64, µs a hook at 0 / 1 / 4 /
    16 distinct adapters, the step's count then the launch's (`python bench/lora_kernels.py --systems
    linear_by_shape,linear_by_shape_launch_count --replays 3 --distinct 0,1,4,16`, 2026-12-07, night): 1.56 / 3.91
    / 5.47 / 8.10 and 1.95 / 4.05 / 5.65 / 8.36."""
    expand_early: bool = False
    """The expand's first chunk (the slots `used_slots[:expand_chunk]`, their B tile, `expand_b_rows`'s) loaded
    right after the GEMM's loop, before the wait for the shrink, so that its latency runs beside the wait and the
    partials' loads instead of after them; that chunk then always takes one dot (with fewer slots than
    `expand_chunk` in use too: the same bits, as `expand_chunk` says). Needs `expand_by_slot`, `expand_b_rows` and
    `expand_chunk` > 1."""
    max_rows: int = 64
    """The most tokens a forward may have for the engine to take this kernel (`linear_lora` itself takes any)."""
    lora: LoraKernelConfig = field(default_factory=lambda: SHRINK_CONFIG)
    """The shrink's split of `in`, K step, pipeline stages and tile groups (`num_warps` and the expand's fields of
    it are not used)."""

    def __post_init__(self) -> None:
        for name in ("stages", "num_warps", "max_rows", "expand_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"LinearLoraConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name, low in (("block_n", 16), ("block_k", 16), ("block_r", 1), ("expand_chunk", 1)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                raise ValueError(f"LinearLoraConfig.{name} must be a power of two >= {low}, got {value}")
        if self.expand_early and not (self.expand_by_slot and self.expand_b_rows and self.expand_chunk > 1):
            raise ValueError("LinearLoraConfig.expand_early needs expand_by_slot, expand_b_rows and expand_chunk > 1")


DEFAULT_LINEAR_CONFIG = LinearLoraConfig()
WIDE_CONFIG = LinearLoraConfig(block_n=64, block_k=64, stages=5)
"""For a layer whose output is at least 4x its input (gate_up_proj): 64 columns a program, K steps of 64 in five
stages."""
LONG_CONFIG = LinearLoraConfig(stages=7)
"""For a layer whose input is at least 2x its output (down_proj): the default tile in seven stages (168 KiB of
shared memory; one program an SM, as at five: 4096 columns in blocks of 32 are 128 programs). Seven since
2026-12-07 (night), five before: one H100, 8B shapes, batch 64, down_proj alone, µs a hook over cuBLAS at 0 / 16
distinct adapters, 5 / 6 / 7 / 8 stages 0.29 / 8.05, -0.88 / 6.68, -1.25 / 6.37, -1.18 / 6.54 (`python
bench/lora_kernels.py --per-linear --systems linear_by_shape,linear_by_shape_narrow_s6,... --replays 3 --distinct
0,16` at 17bc3f8); the whole layer at 0 / 1 / 4 / 16 adapters, seven then five, 1.24 / 3.53 / 5.23 / 7.73 and 1.64
/ 3.99 / 5.51 / 8.16 (`--systems linear_by_shape,linear_by_shape_long_s5`). o_proj, also one program an SM, gains
at no adapter from 6 to 8 stages (3.71 -> 1.73-1.81) but loses at 16 (7.22 -> 8.51-8.78), so it keeps four."""


def linear_config_for(in_features: int, out_features: int) -> LinearLoraConfig:
    """The tile of a layer's shape, measured at the Llama-3.1-8B decode shapes (`python bench/lora_kernels.py
    --per-linear --sweep --systems 'linear*'`, batch 64, one H100, 2026-12-06; µs over cuBLAS's GEMM with one
    adapter in the batch): gate_up_proj 12.1 with `WIDE_CONFIG` against 27.2 with the default; down_proj 9.5
    with `LONG_CONFIG` against 20.8; qkv_proj and o_proj within 0.2 of the best tile with the default (7.3, 6.6).
    Any shape is served by any tile: this only picks speed."""
    if out_features >= 4 * in_features:
        return WIDE_CONFIG
    if in_features >= 2 * out_features:
        return LONG_CONFIG
    return DEFAULT_LINEAR_CONFIG


@triton.jit
def _load_acquire(ptr, ASM: tl.constexpr):
    """*ptr read with acquire semantics at GPU scope (ASM: PTX's ld.acquire; else a volatile load, for the
    interpreter, which runs programs one after another)."""
    if ASM:
        value = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                          is_pure=False, pack=1)
    else:
        value = tl.load(ptr, volatile=True)
    return value


@triton.jit
def _rows_y(y_rows, rr, ymask, stride_pp, SPLITS: tl.constexpr):
    """The rows' y entries `rr` [BLOCK_M, len(rr)] float32: the shrink's partials summed in split order (the caller
    rounds them to the weights' dtype, as a LoRA layer in that dtype rounds them)."""
    y = tl.load(y_rows + rr[None, :], mask=ymask, other=0.0, cache_modifier=".cg")
    for p in tl.static_range(1, SPLITS):
        y += tl.load(y_rows + p * stride_pp + rr[None, :], mask=ymask, other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def _expand_slots(delta, y, slot, used_slots_ptr, num_used, b_cols, bmask, stride_bs, STAGES: tl.constexpr):
    """delta [BLOCK_M, BLOCK_N] += one tensor-core dot per slot the step uses (the plan's `used_slots`, ascending):
    the rows' y [BLOCK_M, DOT_R] of that slot (the others' exact zeros) times its B block (`b_cols` + slot *
    stride_bs, [DOT_R, BLOCK_N]), the loads software-pipelined in STAGES stages (1: none). The stages move no bit."""
    for i in tl.range(0, num_used, num_stages=STAGES):
        s = tl.load(used_slots_ptr + i)  # the i-th slot the step uses
        bt = tl.load(b_cols + s.to(tl.int64) * stride_bs, mask=bmask, other=0.0)
        delta = tl.dot(tl.where((slot == s)[:, None], y, 0.0), bt, delta, input_precision="ieee")
    return delta


@triton.jit
def _chunk_b_rows(used_slots_ptr, i, num_used, b_slot0, r0, rank, nmask, stride_bs, CHUNK: tl.constexpr,
                  DOT_R: tl.constexpr):
    """The B blocks of the slots used_slots[i : i + CHUNK] (past the last in use, zeros) stacked as one [CHUNK *
    DOT_R, BLOCK_N] tile, row j from slot j // DOT_R at rank entry r0 + j % DOT_R (`b_slot0`: slot 0's B at rank
    entry 0 of the block's columns), and those slots [CHUNK] (-1 past the last)."""
    c = tl.arange(0, CHUNK)
    j = tl.arange(0, CHUNK * DOT_R)
    jr = r0 + j % DOT_R
    s = tl.load(used_slots_ptr + i + c, mask=i + c < num_used, other=-1)
    sj = tl.load(used_slots_ptr + i + j // DOT_R, mask=i + j // DOT_R < num_used, other=-1)  # each row's slot
    bt = tl.load(b_slot0 + jr[:, None] + sj.to(tl.int64)[:, None] * stride_bs,
                 mask=(jr < rank)[:, None] & nmask[None, :] & (sj >= 0)[:, None], other=0.0)
    return bt, s


@triton.jit
def _chunk_dot(delta, y, slot, s, bt, BLOCK_M: tl.constexpr, DOT_R: tl.constexpr, CHUNK: tl.constexpr):
    """delta += the rows' y [BLOCK_M, DOT_R] spread over the CHUNK slots `s` (a row's entries in its slot's block,
    exact zeros in the others) times their stacked B tile `bt` [CHUNK * DOT_R, BLOCK_N]."""
    mine = (slot[:, None] == s[None, :]) & (s >= 0)[None, :]  # [BLOCK_M, CHUNK]
    ys = tl.where(mine[:, :, None], y[:, None, :], 0.0)  # [BLOCK_M, CHUNK, DOT_R]
    return tl.dot(tl.reshape(ys, (BLOCK_M, CHUNK * DOT_R)), bt, delta, input_precision="ieee")


@triton.jit
def _expand_chunks(delta, y, slot, used_slots_ptr, start, num_used, b_slot0, r0, rank, nmask, stride_bs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_R: tl.constexpr, CHUNK: tl.constexpr,
                   B_ROWS: tl.constexpr, STAGES: tl.constexpr):
    """delta [BLOCK_M, BLOCK_N] += one tensor-core dot per CHUNK slots the step uses from the start-th (ascending;
    past the last, nothing): the rows' y [BLOCK_M, DOT_R] (rank entries r0...) spread to [BLOCK_M, CHUNK * DOT_R]
    (a row's entries in its slot's block, exact zeros in the others) times the CHUNK slots' B blocks stacked
    [CHUNK * DOT_R, BLOCK_N], read from `b_slot0` ([1, BLOCK_N]: slot 0's B at rank entry 0 of the block's columns,
    `nmask`). With B_ROWS the stack is loaded as that tile (`_chunk_b_rows`); without, as [CHUNK, DOT_R, BLOCK_N]
    blocks reshaped to it."""
    if not B_ROWS:
        c = tl.arange(0, CHUNK)
        rr = r0 + tl.arange(0, DOT_R)
        b_cols = b_slot0 + rr[:, None]  # [DOT_R, BLOCK_N]
        bmask = (rr < rank)[:, None] & nmask[None, :]
    for i in tl.range(start, num_used, CHUNK, num_stages=STAGES):
        if B_ROWS:
            bt, s = _chunk_b_rows(used_slots_ptr, i, num_used, b_slot0, r0, rank, nmask, stride_bs, CHUNK, DOT_R)
            delta = _chunk_dot(delta, y, slot, s, bt, BLOCK_M, DOT_R, CHUNK)
        else:  # B reshaped here, after y's spread: the order of the measured kernel, which compiles as before
            s = tl.load(used_slots_ptr + i + c, mask=i + c < num_used, other=-1)  # [CHUNK] the next slots in use
            bt = tl.load(b_cols[None, :, :] + s.to(tl.int64)[:, None, None] * stride_bs,
                         mask=bmask[None, :, :] & (s >= 0)[:, None, None], other=0.0)  # [CHUNK, DOT_R, BLOCK_N]
            mine = (slot[:, None] == s[None, :]) & (s >= 0)[None, :]  # [BLOCK_M, CHUNK]
            ys = tl.where(mine[:, :, None], y[:, None, :], 0.0)  # [BLOCK_M, CHUNK, DOT_R]
            delta = tl.dot(tl.reshape(ys, (BLOCK_M, CHUNK * DOT_R)), tl.reshape(bt, (CHUNK * DOT_R, BLOCK_N)), delta,
                           input_precision="ieee")
    return delta


@triton.jit
def _gemm_lora_block(q, x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, b_ptr, scaling_ptr, token_slot_ptr, used_slots_ptr,
                     num_used_ptr, done_ptr, num_tokens, in_features, shrink_programs, gemm_programs, wait_for,
                     m_blocks, blocks0, blocks1, rank, width0, width1, width2, stride_xt, stride_wn, stride_ot,
                     stride_pp, stride_pt, stride_bs, stride_bn, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, BLOCK_R: tl.constexpr, BY_SLOT: tl.constexpr, DOT_R: tl.constexpr,
                     EXPAND_STAGES: tl.constexpr, EXPAND_CHUNK: tl.constexpr, EXPAND_B_ROWS: tl.constexpr,
                     EXPAND_EARLY: tl.constexpr, STEP_COUNT: tl.constexpr, ASM: tl.constexpr):
    """GEMM program q = (column block of one slice, row block): out[rows, block] = round(round(x W^T + b) + the
    rows' deltas), after the shrink's programs have all counted into `done` (up to `wait_for` with STEP_COUNT)."""
    f = q // m_blocks  # the row blocks of one column block are neighbours: they share its weight rows in L2
    mb = q % m_blocks
    sl = (f >= blocks0).to(tl.int32) + (f >= blocks0 + blocks1).to(tl.int32)
    n = (f - tl.where(sl >= 1, blocks0, 0) - tl.where(sl >= 2, blocks1, 0)) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < tl.where(sl == 0, width0, tl.where(sl == 1, width1, width2))
    cols = tl.where(sl >= 1, width0, 0) + tl.where(sl >= 2, width1, 0) + n  # columns of the fused output
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rows < num_tokens
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xt  # [BLOCK_M, 1]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    kk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, in_features, BLOCK_K, num_stages=STAGES):
        kk = k + kk0
        if EVEN_K:
            xt = tl.load(x_rows + kk[None, :], mask=mmask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            wt = tl.load(w_cols + kk[:, None], mask=nmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        else:
            kmask = kk < in_features
            xt = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            wt = tl.load(w_cols + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    base = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the layer's output, rounded as the GEMM's
    # what does not depend on the shrink first: the rows' slots and scales
    slot = tl.load(token_slot_ptr + rows, mask=mmask, other=-1)
    has = slot >= 0
    slot64 = tl.where(has, slot, 0).to(tl.int64)
    scale = tl.load(scaling_ptr + slot64, mask=has, other=0.0)
    if BY_SLOT:
        num_used = tl.load(num_used_ptr)  # the slots the step uses
        b_slot0 = b_ptr + cols[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]: slot 0's B, rank entry 0
        if EXPAND_EARLY:  # the first chunk's slots and B tile in flight while the shrink is awaited
            bt0, s0 = _chunk_b_rows(used_slots_ptr, 0, num_used, b_slot0, 0, rank, nmask, stride_bs, EXPAND_CHUNK,
                                    DOT_R)
    if STEP_COUNT:  # the partials visible from here on
        arrived = _load_acquire(done_ptr, ASM)
        while arrived < wait_for:
            arrived = _load_acquire(done_ptr, ASM)
    else:
        arrived = tl.load(done_ptr, volatile=True)
        while arrived < shrink_programs:
            arrived = tl.load(done_ptr, volatile=True)
        seen = tl.atomic_add(done_ptr, 1, sem="acquire")  # the partials visible from here on; counted in
        if seen == shrink_programs + gemm_programs - 1:  # the last GEMM program: ready for the next launch
            tl.atomic_xchg(done_ptr, 0, sem="relaxed")
    y_rows = part_ptr + rows[:, None].to(tl.int64) * stride_pt + sl * rank  # [BLOCK_M, 1]: the slice's entries
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BY_SLOT:
        rr0 = tl.arange(0, DOT_R)
        if EXPAND_EARLY:  # rank entries 0...DOT_R: the first chunk's dot, then the other chunks'
            y = _rows_y(y_rows, rr0, has[:, None] & (rr0 < rank)[None, :], stride_pp, SPLITS).to(b_ptr.dtype.element_ty)
            if num_used > 0:
                delta = _chunk_dot(delta, y, slot, s0, bt0, BLOCK_M, DOT_R, EXPAND_CHUNK)
            delta = _expand_chunks(delta, y, slot, used_slots_ptr, EXPAND_CHUNK, num_used, b_slot0, 0, rank, nmask,
                                   stride_bs, BLOCK_M, BLOCK_N, DOT_R, EXPAND_CHUNK, EXPAND_B_ROWS, EXPAND_STAGES)
        for r0 in range(DOT_R if EXPAND_EARLY else 0, rank, DOT_R):
            rr = r0 + rr0
            y = _rows_y(y_rows, rr, has[:, None] & (rr < rank)[None, :], stride_pp, SPLITS).to(b_ptr.dtype.element_ty)
            b_cols = b_slot0 + rr[:, None]  # [DOT_R, BLOCK_N] of slot 0
            bmask = (rr < rank)[:, None] & nmask[None, :]
            chunked = False
            if EXPAND_CHUNK > 1:
                chunked = num_used >= EXPAND_CHUNK
            if chunked:
                delta = _expand_chunks(delta, y, slot, used_slots_ptr, 0, num_used, b_slot0, r0, rank, nmask,
                                       stride_bs, BLOCK_M, BLOCK_N, DOT_R, EXPAND_CHUNK, EXPAND_B_ROWS, EXPAND_STAGES)
            elif num_used >= EXPAND_STAGES:  # enough slots for the pipeline's prologue to pay
                delta = _expand_slots(delta, y, slot, used_slots_ptr, num_used, b_cols, bmask, stride_bs,
                                      EXPAND_STAGES)
            else:
                delta = _expand_slots(delta, y, slot, used_slots_ptr, num_used, b_cols, bmask, stride_bs, 1)
    else:
        b_rows = b_ptr + slot64[:, None, None] * stride_bs + cols[None, :, None].to(tl.int64) * stride_bn
        rr0 = tl.arange(0, BLOCK_R)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + rr0
            ymask = has[:, None] & (rr < rank)[None, :]  # [BLOCK_M, BLOCK_R]
            y = _rows_y(y_rows, rr, ymask, stride_pp, SPLITS).to(b_ptr.dtype.element_ty).to(tl.float32)
            bt = tl.load(b_rows + rr[None, None, :], mask=ymask[:, None, :] & nmask[None, :, None], other=0.0)
            delta += tl.sum(y[:, None, :] * bt.to(tl.float32), axis=2)  # [BLOCK_M, BLOCK_N]
    result = delta * scale[:, None] + base
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :], result.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["wait_for"])
def _linear_lora_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, part_ptr, b_ptr, scaling_ptr, tile_tokens_ptr,
                        tile_slot_ptr, arrivals_ptr, token_slot_ptr, used_slots_ptr, num_used_ptr, done_ptr,
                        ticket_ptr, num_tokens, in_features, num_tile_rows, groups, shrink_programs, gemm_programs,
                        wait_for, lora_rows, k_per_split, m_blocks, blocks0, blocks1, rank, width0, width1,
                        width2, stride_xt, stride_wn, stride_ot, stride_as, stride_ar, stride_pp, stride_pt,
                        stride_bs, stride_bn, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
                        FLAG_STRIDE: tl.constexpr, TILE_M: tl.constexpr, BLOCK_RA: tl.constexpr,
                        SHRINK_K: tl.constexpr, SHRINK_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                        BLOCK_R: tl.constexpr, BY_SLOT: tl.constexpr, DOT_R: tl.constexpr,
                        EXPAND_STAGES: tl.constexpr, EXPAND_CHUNK: tl.constexpr, EXPAND_B_ROWS: tl.constexpr,
                        EXPAND_EARLY: tl.constexpr, TICKETED: tl.constexpr, STEP_COUNT: tl.constexpr,
                        ASM: tl.constexpr):
    """The shrink programs (ids below `shrink_programs`), each counting into `done` at its end, then the GEMM
    programs, which wait for all of them before their epilogue."""
    pid = _program_role(ticket_ptr, shrink_programs + gemm_programs, TICKETED)
    if pid < shrink_programs:
        _shrink_tiles(pid, x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, arrivals_ptr, num_tile_rows,
                      groups, lora_rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp,
                      stride_pt, SPLITS, False, FLAG_STRIDE, TILE_M, BLOCK_RA, SHRINK_K, SHRINK_STAGES)
        tl.debug_barrier()  # every thread's partials stored before the count is published
        tl.atomic_add(done_ptr, 1, sem="release")
    else:
        _gemm_lora_block(pid - shrink_programs, x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, b_ptr, scaling_ptr,
                         token_slot_ptr, used_slots_ptr, num_used_ptr, done_ptr, num_tokens, in_features,
                         shrink_programs, gemm_programs, wait_for, m_blocks, blocks0, blocks1, rank, width0, width1,
                         width2, stride_xt, stride_wn, stride_ot, stride_pp, stride_pt, stride_bs, stride_bn,
                         HAS_BIAS, SPLITS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, BLOCK_R, BY_SLOT, DOT_R,
                         EXPAND_STAGES, EXPAND_CHUNK, EXPAND_B_ROWS, EXPAND_EARLY, STEP_COUNT, ASM)


def _check_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.shape != (out.shape[1], x.shape[1]) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{out.shape[1]}, {x.shape[1]}] {x.dtype}; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if weight.stride(1) != 1 or weight.device != x.device:
        raise ValueError("weight must have unit stride in `in` and be on x's device")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1
                             or bias.device != x.device):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype} on x's device; got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")


def linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
                lora: torch.Tensor | LoraBatch, scaling: torch.Tensor, *, slices: tuple[int, ...] | None = None,
                out: torch.Tensor | None = None, config: LinearLoraConfig = DEFAULT_LINEAR_CONFIG) -> torch.Tensor:
    """x [T, in] -> out [T, N] = round(x weight^T (+ bias)) + each token's scaled LoRA delta, rounded once, in one
    launch. weight [N, in], bias [N] or None, A [S, R, in], B [S, N, r_max], scaling [S] float32 (the stacks of
    `kernels/lora.py`), all but scaling in x's dtype; lora: idx [T] (-1: no adapter) or its `lora_batch`; `slices`:
    the output widths of a fused layer, (N,) when None; `out`: where to write it (a new tensor when None).
    Returns out. With `config.step_count` (the default) a plan serves launches in the order they were issued on
    the host: a CUDA graph that replays them must also rebuild their plan (`lora_batch`) before them, as the
    engine's decode graphs do."""
    _check_x_a(x, A)
    if out is None:
        out = torch.empty(x.shape[0], B.shape[1], dtype=x.dtype, device=x.device)
    elif out.dtype != x.dtype:
        raise ValueError(f"out must be x's dtype {x.dtype}; got {out.dtype}")
    slices = _check_layer(out, x, A, B, scaling, slices)
    _check_weight(x, weight, bias, out)
    batch = _as_batch(lora, x.shape[0], A.shape[0])
    if x.shape[0]:
        _launch(x, weight, bias, A, _empty_partials(x, A, config.lora), B, batch, scaling, out, slices, config)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, part: torch.Tensor,
            B: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor, out: torch.Tensor, slices: tuple[int, ...],
            config: LinearLoraConfig) -> None:
    num_tokens, in_features = x.shape
    shrink_k = _block_k(x.dtype, config.lora)
    splits, per_split = _shrink_split(in_features, shrink_k, config.lora)
    groups = _tile_groups(num_tokens, batch.num_slots, config.lora.groups_per_tile_row)
    blocks = [triton.cdiv(w, config.block_n) for w in slices] + [0] * (3 - len(slices))
    widths = tuple(slices) + (0,) * (3 - len(slices))
    m_blocks = triton.cdiv(num_tokens, BLOCK_M)
    shrink_programs, gemm_programs = splits * groups, sum(blocks) * m_blocks
    wait_for = 0
    if config.step_count:
        batch.counted[0] += shrink_programs
        wait_for = batch.counted[0]
    _linear_lora_kernel[(shrink_programs + gemm_programs,)](
        x, weight, x if bias is None else bias, out, A, part, B, scaling, batch.tile_tokens, batch.tile_slot,
        batch.arrivals, batch.token_slot, batch.used_slots, batch.num_used, batch.done, batch.ticket, num_tokens,
        in_features, batch.tile_slot.shape[0], groups, shrink_programs, gemm_programs, wait_for, A.shape[1],
        per_split, m_blocks, blocks[0], blocks[1], B.shape[2], *widths, x.stride(0), weight.stride(0), out.stride(0),
        A.stride(0), A.stride(1), part.stride(0), part.stride(1), B.stride(0), B.stride(1), HAS_BIAS=bias is not None,
        SPLITS=splits, FLAG_STRIDE=_FLAG_STRIDE, TILE_M=TILE_M,
        BLOCK_RA=_block_r(A.shape[1]), SHRINK_K=shrink_k, SHRINK_STAGES=config.lora.shrink_stages,
        EVEN_K=in_features % config.block_k == 0, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        STAGES=config.stages, BLOCK_R=config.block_r, BY_SLOT=config.expand_by_slot,
        DOT_R=DOT_R, EXPAND_STAGES=config.expand_stages, EXPAND_CHUNK=config.expand_chunk,
        EXPAND_B_ROWS=config.expand_b_rows, EXPAND_EARLY=config.expand_early, TICKETED=config.lora.ticketed,
        STEP_COUNT=config.step_count, ASM=_COMPILED, num_warps=config.num_warps)


__all__ = ["BLOCK_M", "DEFAULT_LINEAR_CONFIG", "LONG_CONFIG", "LinearLoraConfig", "SHRINK_CONFIG", "WIDE_CONFIG",
           "linear_config_for", "linear_lora"]
