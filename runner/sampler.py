"""The sampler the runner calls: the torch reference on CPU, the Triton kernel on CUDA.

Both compute the same function (see `kernels/sampling_ref.py`): Gumbel-max over counter-based noise of
(seed, output position, token id), after temperature / top-k / top-p / min-p. The logprob returned for
each token is its log-probability under the distribution it was actually drawn from.
"""

from __future__ import annotations

import torch

from kernels.sampling_ref import sample_ref
from runner.sampling_tensors import SamplingTensors


class Sampler:
    """Called as `sampler(logits, sampling)` with a `SamplingTensors` of the logits' rows.

    On CUDA, steps whose rows use no top-k / top-p / min-p (the caller knows, from the host-side
    parameters, and says so in `sampling.uses`) take the split-vocabulary kernel, which fills the GPU even
    at batch 1; other steps take the one-pass kernel. In deterministic mode a row without truncation always
    gets the split-vocabulary kernel's token and logprob, whatever else is in its batch: that is the
    reduction the trainer side reproduces bitwise (`kernels.sampling.token_logprobs`)."""

    def __init__(self, device: torch.device, deterministic: bool = False) -> None:
        self._fn = sample_ref
        self._untruncated = None
        self._deterministic = deterministic
        if device.type == "cuda":
            from kernels.sampling import sample, sample_untruncated

            self._fn = sample
            self._untruncated = sample_untruncated

    def __call__(
        self, logits: torch.Tensor, sampling: SamplingTensors  # logits [R, V]; sampling: R rows
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(token_ids int64 [R], logprobs f32 [R], top: None or (ids [R, N], logprobs [R, N]) with N =
        `sampling.num_top_logprobs`). `sampling.uses` known to be NO_TRUNCATION allows the split kernel."""
        s = sampling
        N = s.num_top_logprobs
        if not s.truncates and N == 0 and self._untruncated is not None:
            tokens, logprobs = self._untruncated(logits, s.temperature, s.seeds, s.positions)
            return tokens, logprobs, None
        tokens, logprobs, top = self._fn(logits, s.temperature, s.top_k, s.top_p, s.min_p, s.seeds, s.positions, N)
        if self._deterministic and self._untruncated is not None:
            plain = ((s.top_k <= 0) | (s.top_k >= logits.shape[1])) & (s.top_p >= 1.0) & (s.min_p <= 0.0)  # [R]
            plain_tokens, plain_logprobs = self._untruncated(logits, s.temperature, s.seeds, s.positions)
            tokens = torch.where(plain, plain_tokens, tokens)
            logprobs = torch.where(plain, plain_logprobs, logprobs)
        return tokens, logprobs, top
