"""Many LoRA adapters in one batch, in plain torch (the CPU path, and the reference of `kernels/lora.py`).

A batch of T tokens runs through one base linear layer; token t uses the adapter in slot `idx[t]` of a
stack of preallocated adapter slots (-1: no adapter, the token's row gets nothing). The contract, shared
with the Triton launchers:

  - `A` [S, R, in]: per slot, the LoRA "A" rows of every slice, stacked: slice j's rows are
    `[j * r_max, (j + 1) * r_max)` (R = num_slices * r_max).
  - `B` [S, N, r_max]: per slot, the LoRA "B" rows in the base output's column order: slice j's rows are
    the columns `[off_j, off_j + slices[j])` of the fused output (N = sum(slices)).
  - `slices`: the output widths of the slices of one fused base layer (q|k|v, gate|up), `(N,)` for a
    plain one. A slot's adapter of rank r <= r_max fills A rows `[j * r_max, j * r_max + r)` and
    B columns `[0, r)` of each slice; the rest is zero, which adds exact zeros.
  - `scaling` [S] float32: lora_alpha / r (or / sqrt(r) for rsLoRA) of each slot's adapter.

Numerics: shrink y = x @ A[slot]^T in float32 (products of the inputs, summed in float32); expand rounds
y to the weights' dtype (as a LoRA layer running in that dtype does), multiplies by B[slot] with float32
sums, scales, adds to the base output in float32 and rounds once to its dtype. Each token's result
depends on its own row, slot and the slot's weights only.

Not here: the base layer itself, dropout, DoRA or other LoRA variants, tensor-parallel shards, autograd
through the slots (plain torch ops, but nothing here is meant for training).
"""

from __future__ import annotations

import torch


def _slot_rows(idx: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, token rows) of every slot used in idx [T] (rows of -1 left out)."""
    return [(slot, (idx == slot).nonzero().squeeze(1)) for slot in torch.unique(idx).tolist() if slot >= 0]


def _slice_offsets(slices: tuple[int, ...]) -> list[tuple[int, int]]:
    offsets, start = [], 0
    for width in slices:
        offsets.append((start, width))
        start += width
    return offsets


def lora_shrink_ref(x: torch.Tensor, A: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [T, in], A [S, R, in], idx [T] -> y [T, R] float32: y[t] = A[idx[t]] @ x[t] (0 where idx[t] = -1)."""
    assert x.dim() == 2 and A.dim() == 3 and A.shape[2] == x.shape[1] and idx.shape == (x.shape[0],)
    y = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)  # [T, R]
    for slot, rows in _slot_rows(idx):
        assert slot < A.shape[0], (slot, A.shape)
        y[rows] = x[rows].float() @ A[slot].float().t()
    return y


def lora_expand_ref(y: torch.Tensor, B: torch.Tensor, idx: torch.Tensor, scaling: torch.Tensor, out: torch.Tensor,
                    accumulate: bool = True, *, slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """y [T, R] float32, B [S, N, r_max], idx [T], scaling [S] float32, out [T, N]: for each token with a slot,
    its slice j's columns of `out` get scaling[slot] * y[t, slice j's r_max entries] @ B[slot, slice j]^T,
    added to `out` (`accumulate`) or in place of it (rows without a slot are then zeroed). Returns out."""
    slices = tuple(slices) if slices is not None else (B.shape[1],)
    r_max = B.shape[2]
    assert sum(slices) == B.shape[1] == out.shape[1] and y.shape == (out.shape[0], len(slices) * r_max), (
        slices, tuple(B.shape), tuple(y.shape), tuple(out.shape))
    if not accumulate:
        out.zero_()
    for slot, rows in _slot_rows(idx):
        assert slot < B.shape[0], (slot, B.shape)
        yb = y[rows].to(B.dtype).float()  # [n, R]: rounded to the weights' dtype like a LoRA layer's input to B
        delta = torch.empty(rows.numel(), out.shape[1], dtype=torch.float32, device=out.device)  # [n, N]
        for j, (start, width) in enumerate(_slice_offsets(slices)):
            piece = yb[:, j * r_max:(j + 1) * r_max] @ B[slot, start:start + width].float().t()
            delta[:, start:start + width] = piece * scaling[slot]
        base = out[rows].float() if accumulate else 0.0
        out[rows] = (base + delta).to(out.dtype)
    return out


def add_lora_ref(out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, idx: torch.Tensor,
                 scaling: torch.Tensor, *, slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """out [T, N] += each token's scaled LoRA delta (shrink then expand); returns out."""
    return lora_expand_ref(lora_shrink_ref(x, A, idx), B, idx, scaling, out, slices=slices)
