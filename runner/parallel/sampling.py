"""Sampling from vocabulary-sharded logits, in two ways with the same results.

Each rank holds logits for its vocabulary shard of every sampling row, `[R, V/P]`.

    "sharded" (batch-sharded sampling, the default):
        pad R to a multiple of P; one all-to-all turns [R, V/P] per rank into [R/P, V] per rank (rank j
        gets rows [j R/P, (j+1) R/P) over the whole vocabulary); each rank samples its rows; one
        all-gather returns tokens and logprobs (and top logprobs) in batch order.
    "allgather":
        one all-gather of the logits gives every rank [R, V]; every rank samples every row.

The sampler is the single-process one, and its randomness depends only on (seed, position, token id),
so both ways sample exactly what one process would from the same logits. The sharded way holds 1/P of
the full-vocabulary logits per rank, and runs the sampler's [rows, V] temporaries on 1/P of the rows.
Not here: speculative decoding's rejection sampler.
"""

from __future__ import annotations

import torch

from runner.parallel.group import TPGroup
from runner.sampling_tensors import SamplingTensors

TP_SAMPLING_MODES = ("sharded", "allgather")


def gather_vocab(tp: TPGroup, local_logits: torch.Tensor) -> torch.Tensor:
    """[R, V/P] on every rank -> [R, V] on every rank."""
    parts = tp.all_gather(local_logits)  # [P, R, V/P]
    return parts.permute(1, 0, 2).reshape(local_logits.shape[0], -1)


class TensorParallelSampler:
    """Called like `runner.sampler.Sampler`, with the rank's vocabulary shard of the logits."""

    def __init__(self, sampler, tp: TPGroup, mode: str = "sharded") -> None:
        if mode not in TP_SAMPLING_MODES:
            raise ValueError(f"tp_sampling must be one of {TP_SAMPLING_MODES}, got {mode!r}")
        self.sampler, self.tp, self.mode = sampler, tp, mode

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors):
        # logits [R, V/P]; sampling: the R rows (see Sampler)
        if self.mode == "allgather":
            return self.sampler(gather_vocab(self.tp, logits), sampling)
        P, R = self.tp.size, logits.shape[0]
        pad = -R % P
        rows = (R + pad) // P
        mine = slice(self.tp.rank * rows, (self.tp.rank + 1) * rows)
        local = padded_rows(logits, pad).view(P, rows, -1)  # [P, R/P, V/P]: block j goes to rank j
        full = self.tp.all_to_all(local).permute(1, 0, 2).reshape(rows, -1)  # [R/P, V], this rank's rows
        tokens, logprobs, top = self.sampler(full, sampling.padded(pad)[mine])
        tokens = self.tp.all_gather(tokens).reshape(-1)[:R]  # [R]
        logprobs = self.tp.all_gather(logprobs).reshape(-1)[:R]  # [R]
        if top is not None:
            top = tuple(self.tp.all_gather(t).reshape(-1, t.shape[-1])[:R] for t in top)  # [R, N] each
        return tokens, logprobs, top


def padded_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [R, C] with `pad` zero rows appended."""
    return torch.cat([x, x.new_zeros((pad, x.shape[1]))]) if pad else x
