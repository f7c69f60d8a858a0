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
    parameters) take the split-vocabulary kernel, which fills the GPU even at batch 1; other steps take the
    one-pass kernel. In deterministic mode a row without truncation always gets the split-vocabulary
    kernel's token and logprob, whatever else is in its batch: that is the reduction the trainer side
    reproduces bitwise (`kernels.sampling.token_logprobs`)."""

    def __init__(self, device: torch.device, deterministic: bool = False) -> None:
        self._fn = sample_ref
        self._untruncated = None
        self._deterministic = deterministic
        if device.type == "cuda":
            from kernels.sampling import sample, sample_untruncated

            self._fn = sample
            self._untruncated = sample_untruncated

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
        tokens, logprobs, top = self._fn(logits, temperature, top_k, top_p, min_p, seeds, positions, num_top_logprobs)
        if self._deterministic and self._untruncated is not None:
            plain = ((top_k <= 0) | (top_k >= logits.shape[1])) & (top_p >= 1.0) & (min_p <= 0.0)  # [R]
            plain_tokens, plain_logprobs = self._untruncated(logits, temperature, seeds, positions)
            tokens = torch.where(plain, plain_tokens, tokens)
            logprobs = torch.where(plain, plain_logprobs, logprobs)
        return tokens, logprobs, top
