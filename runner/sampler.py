"""The sampler the runner calls: the torch reference on CPU, the Triton kernel on CUDA.

Both compute the same function (see `kernels/sampling_ref.py`): Gumbel-max over counter-based noise of
(seed, output position, token id), after temperature / top-k / top-p / min-p. The logprob returned for
each token is its log-probability under the distribution it was actually drawn from.
"""

from __future__ import annotations

import torch

from kernels.sampling_ref import sample_ref


class Sampler:
    """On CUDA, steps whose rows use no top-k / top-p / min-p (the caller knows, from the host-side
    parameters) take the split-vocabulary kernel, which fills the GPU even at batch 1; deterministic mode
    always takes the one-pass kernel, whose logprob reduction the trainer side reproduces bitwise."""

    def __init__(self, device: torch.device, deterministic: bool = False) -> None:
        self._fn = sample_ref
        self._untruncated = None
        if device.type == "cuda":
            from kernels.sampling import sample, sample_untruncated

            self._fn = sample
            self._untruncated = None if deterministic else sample_untruncated

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
        truncation: bool = True,  # False: the caller guarantees no row truncates
    ):
        if not truncation and num_top_logprobs == 0 and self._untruncated is not None:
            tokens, logprobs = self._untruncated(logits, temperature, seeds, positions)
            return tokens, logprobs, None
        return self._fn(logits, temperature, top_k, top_p, min_p, seeds, positions, num_top_logprobs)
