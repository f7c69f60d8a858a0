"""The sampler the runner calls: the torch reference on CPU, the Triton kernel on CUDA.

Both compute the same function (see `kernels/sampling_ref.py`): Gumbel-max over counter-based noise of
(seed, output position, token id), after temperature / top-k / top-p / min-p. The logprob returned for
each token is its log-probability under the distribution it was actually drawn from.
"""

from __future__ import annotations

import torch

from kernels.sampling_ref import sample_ref


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self._fn = sample_ref
        if device.type == "cuda":
            from kernels.sampling import sample

            self._fn = sample

    def __call__(
        self,
        logits: torch.Tensor,  # [R, V]
        temperature: torch.Tensor,  # [R] f32
        top_k: torch.Tensor,  # [R] int
        top_p: torch.Tensor,  # [R] f32
        min_p: torch.Tensor,  # [R] f32
        seeds: torch.Tensor,  # [R] int64
        positions: torch.Tensor,  # [R] int64 output position
        num_top_logprobs: int = 0,
    ):
        return self._fn(logits, temperature, top_k, top_p, min_p, seeds, positions, num_top_logprobs)
