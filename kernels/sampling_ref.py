"""Counter-based sampling noise and the plain-torch sampler (the reference every device path matches).

Randomness is a pure function of (seed, output position, token id): a 32-bit integer hash of the three
gives one uniform per vocabulary entry, and a Gumbel-max draw over the processed logits picks the token.
A seeded request therefore samples the same token whatever else is in the batch, on CPU and GPU alike
(the Triton sampler in `kernels/sampling.py` computes the same hash in uint32 arithmetic).

Processing order, per row: logits / temperature -> top-k -> top-p -> min-p (each keeps ties at its
threshold). The returned logprob is that of the sampled token under the distribution it was drawn from:
log_softmax over the kept tokens of the tempered logits. Greedy rows (temperature 0) take the argmax of
the raw logits (the first on ties) and report its log_softmax under the raw logits.

Not here: penalties, logit bias, structured output.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)  # a new tensor: the rounds below update it in place
    x.mul_(_MUL1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """Per-row 32-bit key from a seed (uint32 value) and an output position. int64 [B] -> int64 [B]."""
    s = mix32((seeds.to(torch.int64) ^ salt) & MASK32)
    return mix32((s + positions.to(torch.int64) * GOLDEN32) & MASK32)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, salt: int = 0) -> torch.Tensor:
    """Uniforms strictly inside (0, 1), float32 [B, vocab_size], each a function of (seed, position, token id).

    23 bits of the hash: (k + 0.5) / 2^23 is exact in float32 and never rounds to 1.
    """
    keys = row_keys(seeds, positions, salt)  # [B]
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = mix32(keys[:, None] ^ token_ids[None, :])  # [B, V]
    return h.bitwise_right_shift_(9).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), float32 [B, V]."""
    u = counter_uniform(seeds, positions, vocab_size)
    return -torch.log(-torch.log(u))


def fold_seed(seed: int) -> int:
    """Fold an arbitrary Python int seed into a uint32 value."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK32


def _mix32_int(x: int) -> int:
    """`mix32` on one Python int."""
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The uint32 seed of sample `sample_index` of a request (= `row_keys` of the folded seed and the index
    under a fixed salt): the n samples of one request differ."""
    s = _mix32_int((fold_seed(request_seed) ^ 0x5EED5EED) & MASK32)
    return _mix32_int((s + sample_index * GOLDEN32) & MASK32)


def processed_logits_ref(
    logits: torch.Tensor,  # [B, V] any float dtype
    temperature: torch.Tensor,  # [B] float32; 0 marks greedy rows (treated as 1 here)
    top_k: torch.Tensor,  # [B] int32/int64; 0 = off
    top_p: torch.Tensor,  # [B] float32; 1 = off
    min_p: torch.Tensor,  # [B] float32; 0 = off
    uses: tuple[bool, bool, bool] | None = None,
) -> torch.Tensor:
    """Tempered logits with truncated entries set to -inf, float32 [B, V].

    `uses`: whether any row uses (top-k, top-p, min-p), when the caller knows it on the host; otherwise
    it is read from the tensors (a host sync for device tensors)."""
    x = logits.to(torch.float32)
    vocab = x.shape[-1]
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    x = x / temp[:, None]
    neg_inf = float("-inf")

    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < vocab)
    any_k, any_p, any_min = uses if uses is not None else (bool(use_k.any()), bool((top_p < 1.0).any()),
                                                           bool((min_p > 0.0).any()))
    if any_k:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth = sorted_x.gather(1, (k.clamp(1, vocab) - 1)[:, None])  # [B, 1]
        x = torch.where(use_k[:, None] & (x < kth), neg_inf, x)

    if any_p:
        use_p = top_p < 1.0
        probs = torch.softmax(x, dim=-1)
        sorted_p = torch.sort(probs, dim=-1, descending=True).values
        cum = torch.cumsum(sorted_p, dim=-1)
        # index of the first sorted entry at which the cumulative mass reaches top_p
        idx = torch.searchsorted(cum, top_p.to(torch.float32)[:, None].contiguous()).clamp(max=vocab - 1)
        threshold = sorted_p.gather(1, idx)  # [B, 1]
        x = torch.where(use_p[:, None] & (probs < threshold), neg_inf, x)

    if any_min:
        use_min = min_p > 0.0
        probs = torch.softmax(x, dim=-1)
        cut = probs.max(dim=-1, keepdim=True).values * min_p.to(torch.float32)[:, None]
        x = torch.where(use_min[:, None] & (probs < cut), neg_inf, x)
    return x


def sample_ref(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float32
    top_k: torch.Tensor,  # [B] int
    top_p: torch.Tensor,  # [B] float32
    min_p: torch.Tensor,  # [B] float32
    seeds: torch.Tensor,  # [B] int64 holding uint32 values
    positions: torch.Tensor,  # [B] int64, output position of the token being sampled
    num_top_logprobs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Sample one token per row.

    Returns (token_ids int64 [B], logprobs float32 [B], top) where top is None or
    (top_ids int64 [B, N], top_logprobs float32 [B, N]) of the distribution each token was drawn from.
    """
    processed = processed_logits_ref(logits, temperature, top_k, top_p, min_p)
    greedy = temperature <= 0
    num_greedy = int(greedy.sum())
    any_greedy, all_greedy = num_greedy > 0, num_greedy == greedy.shape[0]
    logprobs_all = torch.log_softmax(processed, dim=-1) if not all_greedy else None
    if any_greedy:  # greedy rows report the raw distribution
        raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        logprobs_all = raw_logprobs if all_greedy else torch.where(greedy[:, None], raw_logprobs, logprobs_all)
    token_ids = torch.argmax(logits, dim=-1) if any_greedy else None
    if not all_greedy:
        # processed + Gumbel noise, as processed - log(-log(u)) (the same float32 values); a -inf entry stays
        # -inf since the noise is finite
        u = counter_uniform(seeds, positions, logits.shape[-1])
        sampled = torch.argmax(processed - torch.log(torch.log(u).neg_()), dim=-1)
        token_ids = sampled if token_ids is None else torch.where(greedy, token_ids, sampled)
    logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
    top = None
    if num_top_logprobs > 0:
        vals, ids = torch.topk(logprobs_all, num_top_logprobs, dim=-1)
        top = (ids, vals)
    return token_ids, logprobs, top
