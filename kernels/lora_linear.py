"""A decode step's linear layer and its LoRA deltas in one Triton launch: out = x W^T (+ b) + each token's adapter
delta, with the delta added in the GEMM's epilogue instead of by a second kernel reading the output back.

`kernels/lora.py` adds the deltas after the base GEMM (a cuBLAS call): at a decode batch its hooks are short,
latency-bound kernels between the projections. Here one grid does both, in two kinds of programs:

  - GEMM programs: one [BLOCK_M, BLOCK_N] block of the output each (BLOCK_N columns within one slice of a fused
    output, BLOCK_M = 64 token rows: a decode batch is one row block), walking `in` in BLOCK_K steps with
    tensor-core dots. A GEMM program rounds its block to the output dtype, loads what does not depend on the
    shrink (its rows' slots and scales, the B blocks of the expand's first chunk), takes any shrink items still
    unclaimed, waits until every item is done, and adds each row's delta: the row's partials summed in split order
    and rounded to the weights' dtype, times its slot's B rows for the block's columns (float32 sums over the
    rank), scaled, added to the rounded base in float32, rounded once: the numerics of `kernels/lora_ref.py` on the
    rounded output of the layer, so rows without an adapter get the GEMM's result alone.
  - shrink programs: they take shrink items from the plan's counter (`LoraBatch.claim`; an item is one split of
    `in` of one tile of the step's adapter tokens of one slot, `kernels.lora._shrink_tile`: partial sums of
    x A[slot]^T) until the items of the tiles in use are all handed out, counting each into `LoraBatch.done` (a
    release atomic) once its partials are stored.

The first `gemm_lead` block ids (the SM count by default) are GEMM programs, the shrink's come next, then the other
GEMM programs: the GEMM's first wave starts at once and the shrink runs beside it, its bytes read while the weights
stream in, instead of in front of them. No order of dispatch can stall the launch: an item is claimed only by a
program that runs, and a GEMM program that finds items unclaimed computes them itself, so every wait ends. The last
program to finish (`LoraBatch.exits`) sets the three counters back to zero.

The expand is, by default, tensor-core dots over chunks of `expand_tiles` plan tiles (tiles are sorted by slot, so
each slot the step uses is the first of its tiles in exactly one place): each row's y spread to its slot's first
tile's place in a [BLOCK_M, expand_tiles * 16] operand, exact zeros elsewhere, times those tiles' B blocks stacked
[expand_tiles * 16, BLOCK_N]; a row's sum is its own slot's 16 products, one tensor-core step of K, whatever else
the chunk holds. B is read once per slot and block; the first chunk's B is loaded before the wait.
`expand_by_slot=False` gathers each row's B rows instead.

Nothing is read back to the host and the grid is a function of T and the shapes, so it can be captured in a CUDA
graph and replayed with new slot assignments. The shrink's bits are `add_lora`'s (same splits, same order); the
base GEMM's are not cuBLAS's (another tile order over `in`), and the expand sums the rank in another order than
`add_lora`'s dot: not for deterministic mode, whose linears are `kernels/matmul.py`'s.

The reference is `linear_lora_ref` (kernels/lora_ref.py). Not here: more than a few row blocks (a prefill's
linears belong to a GEMM library and `add_lora`), split-K of the GEMM, tensor-parallel sharding (the caller passes
its shard's weight and stacks, as for `add_lora`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels.lora import (BLOCK_M as TILE_M, DEFAULT_CONFIG, LoraBatch, LoraKernelConfig, _as_batch, _block_k,
                          _block_r, _check_layer, _check_x_a, _empty_partials, _load_tile, _shrink_split, _shrink_tile,
                          _tile_groups)

BLOCK_M = 64  # token rows per GEMM program (the smallest M of Hopper's wgmma)
DOT_R = 16  # rank entries per step of the expand by slot (the K of a 16-bit tensor-core dot)


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
    expand_tiles: int = 8
    """Plan tiles per tensor-core dot of the expand by slot: the dot's K is expand_tiles * `DOT_R`, each row's
    entries in its slot's first tile's place and zeros elsewhere, so one dot serves every slot of up to that many
    tiles, and the B blocks of the first chunk are loaded before the wait on the shrink."""
    expand_stages: int = 3
    """Software-pipeline stages of the expand by slot's loop over the chunks of tiles past the first (1: none)."""
    gemm_lead: int | None = None
    """GEMM programs with block ids before the shrink's programs (the rest come after them). None: the device's SM
    count, so the GEMM programs of the first wave start first and the shrink's programs run beside them (on the
    CPU: all of them). Only moves work: the GEMM programs take whatever shrink items are left unclaimed when they
    reach their epilogue, so no order of dispatch can stall the launch."""
    max_rows: int = 64
    """The most tokens a forward may have for the engine to take this kernel (`linear_lora` itself takes any)."""
    lora: LoraKernelConfig = field(default_factory=lambda: DEFAULT_CONFIG)
    """The shrink's split of `in`, K step, pipeline stages and tile groups (`num_warps` and the expand's fields of
    it are not used)."""

    def __post_init__(self) -> None:
        for name in ("stages", "num_warps", "max_rows", "expand_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"LinearLoraConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.gemm_lead is not None and self.gemm_lead < 0:
            raise ValueError(f"LinearLoraConfig.gemm_lead must be None or >= 0, got {self.gemm_lead}")
        for name, low in (("block_n", 16), ("block_k", 16), ("block_r", 1), ("expand_tiles", 1)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                raise ValueError(f"LinearLoraConfig.{name} must be a power of two >= {low}, got {value}")


DEFAULT_LINEAR_CONFIG = LinearLoraConfig()
WIDE_CONFIG = LinearLoraConfig(block_n=64, block_k=64, stages=5)
"""For a layer whose output is at least 4x its input (gate_up_proj): 64 columns a program, K steps of 64 in five
stages."""
LONG_CONFIG = LinearLoraConfig(stages=5)
"""For a layer whose input is at least 2x its output (down_proj): the default tile in five stages."""


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
def _rows_y(y_rows, rr, ymask, stride_pp, SPLITS: tl.constexpr):
    """The rows' y entries `rr` [BLOCK_M, len(rr)] float32: the shrink's partials summed in split order (the caller
    rounds them to the weights' dtype, as a LoRA layer in that dtype rounds them)."""
    y = tl.load(y_rows + rr[None, :], mask=ymask, other=0.0, cache_modifier=".cg")
    for p in tl.static_range(1, SPLITS):
        y += tl.load(y_rows + p * stride_pp + rr[None, :], mask=ymask, other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def _claim_shrink(x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, claim_ptr, done_ptr, num_tile_rows,
                  lora_rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp, stride_pt,
                  SPLITS: tl.constexpr, TILE_M: tl.constexpr, BLOCK_RA: tl.constexpr, SHRINK_K: tl.constexpr,
                  SHRINK_STAGES: tl.constexpr):
    """Takes shrink items (tile-major: item i is split i % SPLITS of tile i // SPLITS) until one falls past the tiles
    in use, computing each and counting it into `done` (a release atomic) once its partials are stored."""
    item = tl.atomic_add(claim_ptr, 1, sem="relaxed")
    slot, toks = _load_tile(tile_slot_ptr, tile_tokens_ptr, item // SPLITS, num_tile_rows, TILE_M)
    while slot >= 0:
        _shrink_tile(slot, toks, item % SPLITS, x_ptr, a_ptr, part_ptr, lora_rows, in_features, k_per_split,
                     stride_xt, stride_as, stride_ar, stride_pp, stride_pt, TILE_M, BLOCK_RA, SHRINK_K, SHRINK_STAGES)
        tl.debug_barrier()  # every thread's partials stored before the count is published
        tl.atomic_add(done_ptr, 1, sem="release")
        item = tl.atomic_add(claim_ptr, 1, sem="relaxed")
        slot, toks = _load_tile(tile_slot_ptr, tile_tokens_ptr, item // SPLITS, num_tile_rows, TILE_M)


@triton.jit
def _tile_chunk(tile_slot_ptr, c, num_tile_rows, b_ptr, cols, nmask, rr, rank, stride_bs, stride_bn,
                TILES: tl.constexpr, DOT_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tiles c .. c + TILES of the plan: their slots [TILES], whether each is its slot's first tile (tiles are sorted
    by slot, so each slot the step uses is first in exactly one), and the B block of each first tile's slot for the
    rank entries `rr` [DOT_R] and the columns `cols` [BLOCK_N], as [TILES * DOT_R, BLOCK_N] (zeros elsewhere)."""
    j = c + tl.arange(0, TILES)
    slots = tl.load(tile_slot_ptr + j, mask=j < num_tile_rows, other=-1)
    before = tl.load(tile_slot_ptr + j - 1, mask=(j >= 1) & (j < num_tile_rows), other=-1)
    first = (slots >= 0) & (slots != before)
    ptrs = (b_ptr + tl.where(first, slots, 0).to(tl.int64)[:, None, None] * stride_bs
            + cols[None, None, :].to(tl.int64) * stride_bn + rr[None, :, None])  # [TILES, DOT_R, BLOCK_N]
    bt = tl.load(ptrs, mask=first[:, None, None] & (rr < rank)[None, :, None] & nmask[None, None, :], other=0.0)
    return slots, first, tl.reshape(bt, (TILES * DOT_R, BLOCK_N))


@triton.jit
def _chunk_dot(delta, y, slot, slots, first, bt, BLOCK_M: tl.constexpr, TILES: tl.constexpr, DOT_R: tl.constexpr):
    """delta += the rows' y [BLOCK_M, DOT_R] (B's dtype) times the B blocks of a `_tile_chunk`, each row against its
    own slot's block only: y spread to [BLOCK_M, TILES * DOT_R], a row's entries in its slot's first tile's place
    and exact zeros elsewhere, so a row's sum is its own slot's DOT_R products, one tensor-core step of K."""
    pick = (slot[:, None] == slots[None, :]) & first[None, :]  # [BLOCK_M, TILES]
    spread = tl.where(pick[:, :, None], y[:, None, :], tl.zeros_like(y)[:, None, :])  # [BLOCK_M, TILES, DOT_R]
    return tl.dot(tl.reshape(spread, (BLOCK_M, TILES * DOT_R)), bt, delta, input_precision="ieee")


@triton.jit
def _expand_chunks(delta, y, slot, c0, in_use, tile_slot_ptr, num_tile_rows, b_ptr, cols, nmask, rr, rank, stride_bs,
                   stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, DOT_R: tl.constexpr,
                   EXPAND_STAGES: tl.constexpr):
    """`_chunk_dot` over the chunks of TILES tiles from tile c0 to the tiles in use (`in_use`), their loads
    software-pipelined in EXPAND_STAGES stages."""
    for c in tl.range(c0, in_use, TILES, num_stages=EXPAND_STAGES):
        slots, first, bt = _tile_chunk(tile_slot_ptr, c, num_tile_rows, b_ptr, cols, nmask, rr, rank, stride_bs,
                                       stride_bn, TILES, DOT_R, BLOCK_N)
        delta = _chunk_dot(delta, y, slot, slots, first, bt, BLOCK_M, TILES, DOT_R)
    return delta


@triton.jit
def _gemm_lora_block(q, x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, part_ptr, b_ptr, scaling_ptr, tile_tokens_ptr,
                     tile_slot_ptr, num_tiles_ptr, token_slot_ptr, claim_ptr, done_ptr, num_tokens, in_features,
                     num_tile_rows, lora_rows, k_per_split, m_blocks, blocks0, blocks1, rank, width0, width1, width2,
                     stride_xt, stride_wn, stride_ot, stride_as, stride_ar, stride_pp, stride_pt, stride_bs,
                     stride_bn, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, TILE_M: tl.constexpr,
                     BLOCK_RA: tl.constexpr, SHRINK_K: tl.constexpr, SHRINK_STAGES: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, BLOCK_R: tl.constexpr, BY_SLOT: tl.constexpr, TILES: tl.constexpr,
                     DOT_R: tl.constexpr, EXPAND_STAGES: tl.constexpr):
    """GEMM program q = (column block of one slice, row block): out[rows, block] = round(round(x W^T + b) + the
    rows' deltas), after the shrink's items are all done (it takes those still unclaimed itself)."""
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
    # what does not depend on the shrink first: the rows' slots and scales, the tiles in use, B's first chunk
    slot = tl.load(token_slot_ptr + rows, mask=mmask, other=-1)
    has = slot >= 0
    slot64 = tl.where(has, slot, 0).to(tl.int64)
    scale = tl.load(scaling_ptr + slot64, mask=has, other=0.0)
    in_use = tl.load(num_tiles_ptr)
    rr0 = tl.arange(0, DOT_R)
    if BY_SLOT:
        slots, first, bt = _tile_chunk(tile_slot_ptr, 0, num_tile_rows, b_ptr, cols, nmask, rr0, rank, stride_bs,
                                       stride_bn, TILES, DOT_R, BLOCK_N)
    _claim_shrink(x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, claim_ptr, done_ptr, num_tile_rows,
                  lora_rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp, stride_pt, SPLITS,
                  TILE_M, BLOCK_RA, SHRINK_K, SHRINK_STAGES)
    # every item is claimed now, each by a program that runs: wait for them (acquire: their partials visible)
    arrived = tl.atomic_add(done_ptr, 0, sem="acquire")
    while arrived < in_use * SPLITS:
        arrived = tl.atomic_add(done_ptr, 0, sem="acquire")
    y_rows = part_ptr + rows[:, None].to(tl.int64) * stride_pt + sl * rank  # [BLOCK_M, 1]: the slice's entries
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BY_SLOT:
        y = _rows_y(y_rows, rr0, has[:, None] & (rr0 < rank)[None, :], stride_pp, SPLITS).to(b_ptr.dtype.element_ty)
        delta = _chunk_dot(delta, y, slot, slots, first, bt, BLOCK_M, TILES, DOT_R)
        delta = _expand_chunks(delta, y, slot, TILES, in_use, tile_slot_ptr, num_tile_rows, b_ptr, cols, nmask, rr0,
                               rank, stride_bs, stride_bn, BLOCK_M, BLOCK_N, TILES, DOT_R, EXPAND_STAGES)
        for r0 in range(DOT_R, rank, DOT_R):  # ranks above DOT_R
            rr = r0 + rr0
            y = _rows_y(y_rows, rr, has[:, None] & (rr < rank)[None, :], stride_pp, SPLITS).to(b_ptr.dtype.element_ty)
            delta = _expand_chunks(delta, y, slot, 0, in_use, tile_slot_ptr, num_tile_rows, b_ptr, cols, nmask, rr,
                                   rank, stride_bs, stride_bn, BLOCK_M, BLOCK_N, TILES, DOT_R, EXPAND_STAGES)
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


@triton.jit
def _linear_lora_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, part_ptr, b_ptr, scaling_ptr, tile_tokens_ptr,
                        tile_slot_ptr, num_tiles_ptr, token_slot_ptr, claim_ptr, done_ptr, exits_ptr, num_tokens,
                        in_features, num_tile_rows, lead, shrink_programs, gemm_programs, lora_rows, k_per_split,
                        m_blocks, blocks0, blocks1, rank, width0, width1, width2, stride_xt, stride_wn, stride_ot,
                        stride_as, stride_ar, stride_pp, stride_pt, stride_bs, stride_bn, HAS_BIAS: tl.constexpr,
                        SPLITS: tl.constexpr, TILE_M: tl.constexpr, BLOCK_RA: tl.constexpr, SHRINK_K: tl.constexpr,
                        SHRINK_STAGES: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, BLOCK_R: tl.constexpr,
                        BY_SLOT: tl.constexpr, TILES: tl.constexpr, DOT_R: tl.constexpr, EXPAND_STAGES: tl.constexpr):
    """Block ids below `lead` and from `lead + shrink_programs` on: GEMM programs; between them: shrink programs,
    which take shrink items until none is left. The last program to finish sets the counters back to zero."""
    pid = tl.program_id(0)
    if (pid >= lead) & (pid < lead + shrink_programs):
        _claim_shrink(x_ptr, a_ptr, part_ptr, tile_tokens_ptr, tile_slot_ptr, claim_ptr, done_ptr, num_tile_rows,
                      lora_rows, in_features, k_per_split, stride_xt, stride_as, stride_ar, stride_pp, stride_pt,
                      SPLITS, TILE_M, BLOCK_RA, SHRINK_K, SHRINK_STAGES)
    else:
        _gemm_lora_block(tl.where(pid < lead, pid, pid - shrink_programs), x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr,
                         part_ptr, b_ptr, scaling_ptr, tile_tokens_ptr, tile_slot_ptr, num_tiles_ptr, token_slot_ptr,
                         claim_ptr, done_ptr, num_tokens, in_features, num_tile_rows, lora_rows, k_per_split, m_blocks,
                         blocks0, blocks1, rank, width0, width1, width2, stride_xt, stride_wn, stride_ot, stride_as,
                         stride_ar, stride_pp, stride_pt, stride_bs, stride_bn, HAS_BIAS, SPLITS, TILE_M, BLOCK_RA,
                         SHRINK_K, SHRINK_STAGES, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, BLOCK_R, BY_SLOT, TILES,
                         DOT_R, EXPAND_STAGES)
    # after this program's last claim and count: the last of all sees every claim and count of the launch made
    if tl.atomic_add(exits_ptr, 1, sem="acq_rel") == shrink_programs + gemm_programs - 1:
        tl.atomic_xchg(claim_ptr, 0, sem="relaxed")
        tl.atomic_xchg(done_ptr, 0, sem="relaxed")
        tl.atomic_xchg(exits_ptr, 0, sem="relaxed")


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
    Returns out."""
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


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SM count, asked once per device (each eager decode step launches this kernel per linear)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


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
    lead = min(gemm_programs, _sm_count(x.device) if config.gemm_lead is None else config.gemm_lead)
    tile_rows = batch.tile_slot.shape[0]
    _linear_lora_kernel[(shrink_programs + gemm_programs,)](
        x, weight, x if bias is None else bias, out, A, part, B, scaling, batch.tile_tokens, batch.tile_slot,
        batch.num_tiles, batch.token_slot, batch.claim, batch.done, batch.exits, num_tokens, in_features, tile_rows,
        lead, shrink_programs, gemm_programs, A.shape[1], per_split, m_blocks, blocks[0], blocks[1], B.shape[2],
        *widths, x.stride(0), weight.stride(0), out.stride(0), A.stride(0), A.stride(1), part.stride(0), part.stride(1),
        B.stride(0), B.stride(1), HAS_BIAS=bias is not None, SPLITS=splits, TILE_M=TILE_M,
        BLOCK_RA=_block_r(A.shape[1]), SHRINK_K=shrink_k, SHRINK_STAGES=config.lora.shrink_stages,
        EVEN_K=in_features % config.block_k == 0, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        STAGES=config.stages, BLOCK_R=config.block_r, BY_SLOT=config.expand_by_slot,
        TILES=min(config.expand_tiles, triton.next_power_of_2(tile_rows)), DOT_R=DOT_R,
        EXPAND_STAGES=config.expand_stages, num_warps=config.num_warps)


__all__ = ["BLOCK_M", "DEFAULT_LINEAR_CONFIG", "LONG_CONFIG", "LinearLoraConfig", "WIDE_CONFIG", "linear_config_for",
           "linear_lora"]
