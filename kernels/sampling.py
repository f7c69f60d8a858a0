"""The Triton sampler: the same function as `sample_ref` in `kernels/sampling_ref.py`, without sorting.

One program per row makes a few chunked passes over the vocabulary:

    pass 1          raw max and argmax (first index on ties); the tempered max is raw max / temperature
    top-k           bisection on the order-preserving int32 key of the tempered logits: the largest key
                    t with count(x >= t) >= k is exactly the k-th largest value (each pass counts 16
                    candidate thresholds at once, so ~9 passes)
    top-p           one pass for the kept mass S, then the same bisection on mass: the largest t with
                    sum_{x >= t} exp(x - max) >= top_p * S, which is the reference's sorted-cumsum
                    threshold
    min-p           keep exp(x - max) >= min_p, i.e. p >= min_p * p_max
    last pass       Gumbel-max over the kept entries with the counter-based noise of (seed, position,
                    token id) computed in uint32 arithmetic (the reference's mix32), and the log-sum-exp
                    of the kept entries for the logprob

Truncation thresholds are data values, so the kept set is the reference's except where floating-point
rounding decides a boundary tie (two masses or probabilities equal to the last bit, which random logits
essentially never produce). The returned logprob is that of the sampled token under the distribution
it was drawn from (tempered, truncated, renormalized); greedy rows (temperature 0) take the first argmax
of the raw logits and its raw log_softmax. Rows never synchronize with the host.

The uniform is the reference's bit for bit: 23 hash bits, (k + 0.5) / 2**23, strictly inside (0, 1).

Not here: penalties, logit bias, structured output, speculative rejection sampling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_NUM_PROBES = 16  # thresholds counted per bisection pass


@triton.jit
def _mix32(x):
    """mix32 of sampling_ref on uint32 values: multiplications wrap mod 2**32, shifts are logical."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    x = x ^ (x >> 15)
    return x


@triton.jit
def _log(x, LIBDEVICE_LOG: tl.constexpr):
    """Natural log accurate to ~1 ulp. The Gumbel noise -log(-log(u)) needs it: for u near 1 the
    inner log is tiny and the GPU's fast log (absolute, not relative, error) would distort it."""
    if LIBDEVICE_LOG:
        return libdevice.log(x)
    else:
        return tl.log(x)  # the interpreter's numpy log is accurate


@triton.jit
def _order_key(x):
    """float32 -> int32 whose signed order is the float order (-0.0 sorts just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_to_float(key):
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tempered(row_ptr, offs, mask, temp):
    raw = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(raw, tl.zeros_like(raw) + temp)  # IEEE division, as torch's x / t


@triton.jit
def _row_key(seeds_ptr, positions_ptr, row):
    """The row's 32-bit noise key from its seed and output position (`row_keys` of the reference)."""
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    return _mix32(_mix32(seed) + position * 0x9E3779B9)


@triton.jit
def _gumbel(row_key, offs, LIBDEVICE_LOG: tl.constexpr):
    """Gumbel noise of tokens `offs`: -log(-log(u)), u = (23 hash bits + 0.5) / 2**23, inside (0, 1)."""
    h = _mix32(row_key ^ offs.to(tl.uint32))
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -_log(-_log(u, LIBDEVICE_LOG), LIBDEVICE_LOG)


@triton.jit
def _running_argmax(best, best_idx, values, start):
    """Fold one block of values (token ids start..) into a running (max, first argmax)."""
    block_max = tl.max(values, 0)
    take = block_max > best
    return tl.maximum(best, block_max), tl.where(take, start + tl.argmax(values, 0), best_idx)


@triton.jit
def _lane_argmax(values, idx):
    """(max, first token holding it) of per-lane running maxima `values` with their tokens `idx`."""
    best = tl.max(values, 0)
    return best, tl.min(tl.where(values == best, idx, 2147483647), 0)


@triton.jit
def _raw_max(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """(max, first argmax) of a row's raw logits."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        raw = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        best, best_idx = _running_argmax(best, best_idx, raw, start)
    return best, best_idx


@triton.jit
def _bisect_threshold(
    row_ptr, vocab, temp, row_max, lo, hi, target, BY_MASS: tl.constexpr,
    BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr,
):
    """Largest int32 key t in [lo, hi) with f(t) >= target, where f(t) = count(x >= t) (BY_MASS false)
    or sum over x >= t of exp(x - row_max) (BY_MASS true). f must satisfy f(lo) >= target; hi is an
    exclusive bound never evaluated. lo, hi: int64 scalars."""
    probes = tl.arange(1, NUM_PROBES + 1).to(tl.int64)  # [P]
    while hi - lo > 1:
        cand = lo + ((hi - lo) * probes) // (NUM_PROBES + 1)  # [P], strictly inside (lo, hi) or == lo
        total = tl.zeros([NUM_PROBES], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            x = _tempered(row_ptr, offs, mask, temp)
            above = (_order_key(x).to(tl.int64)[:, None] >= cand[None, :]) & mask[:, None]  # [V, P]
            if BY_MASS:
                total += tl.sum(tl.where(above, tl.exp(x - row_max)[:, None], 0.0), 0)
            else:
                total += tl.sum(above.to(tl.float32), 0)
        ok = total >= target
        lo = tl.max(tl.where(ok, cand, lo), 0)
        hi = tl.min(tl.where(ok, hi, cand), 0)
    return lo


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, positions_ptr,
    token_ptr, logprob_ptr, row_max_ptr, row_lse_ptr, row_thr_ptr, row_min_p_ptr,
    stride_row, vocab,
    BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr, LIBDEVICE_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    greedy = temperature <= 0.0
    temp = tl.where(greedy, 1.0, temperature)

    # pass 1: raw max and first argmax
    best_raw, best_idx = _raw_max(row_ptr, vocab, BLOCK_V)
    row_max = tl.math.div_rn(best_raw, temp)  # division by t > 0 is monotone: max of the tempered row

    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    use_k = (top_k > 0) & (top_k < vocab) & (~greedy)
    use_p = (top_p < 1.0) & (~greedy)
    min_p = tl.where(greedy, 0.0, min_p)
    min_key = -(2**31)
    max_key = _order_key(row_max).to(tl.int64) + 1
    thr_key = tl.full([], min_key, tl.int64)
    if use_k:
        thr_key = _bisect_threshold(row_ptr, vocab, temp, row_max, thr_key, max_key, top_k.to(tl.float32),
                                    False, BLOCK_V, NUM_PROBES)
    if use_p:
        kept_mass = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            x = _tempered(row_ptr, offs, mask, temp)
            kept_mass += tl.where(mask & (_order_key(x).to(tl.int64) >= thr_key), tl.exp(x - row_max), 0.0)
        thr_key = _bisect_threshold(row_ptr, vocab, temp, row_max, thr_key, max_key,
                                    top_p * tl.sum(kept_mass, 0), True, BLOCK_V, NUM_PROBES)
    threshold = tl.where(thr_key == min_key, float("-inf"), _key_to_float(thr_key))

    # last pass: Gumbel-max over the kept entries and their log-sum-exp
    row_key = _row_key(seeds_ptr, positions_ptr, row)
    kept_sum = tl.zeros([BLOCK_V], tl.float32)
    best_noisy = tl.full([], float("-inf"), tl.float32)
    best_sample = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = _tempered(row_ptr, offs, mask, temp)
        e = tl.exp(x - row_max)
        keep = mask & (x >= threshold) & (e >= min_p)
        kept_sum += tl.where(keep, e, 0.0)
        noisy = tl.where(keep, x + _gumbel(row_key, offs, LIBDEVICE_LOG), float("-inf"))
        best_noisy, best_sample = _running_argmax(best_noisy, best_sample, noisy, start)
    lse = tl.log(tl.sum(kept_sum, 0))  # log sum exp(x - row_max) over kept entries
    token = tl.where(greedy, best_idx, best_sample)
    x_token = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), temp)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x_token - row_max - lse)
    tl.store(row_max_ptr + row, row_max)
    tl.store(row_lse_ptr + row, lse)
    tl.store(row_thr_ptr + row, threshold)
    tl.store(row_min_p_ptr + row, min_p)


def token_logprobs(
    logits: torch.Tensor,  # [N, V] float16 / bfloat16 / float32
    token_ids: torch.Tensor,  # [N] int64
    temperature: torch.Tensor,  # [N] float32; <= 0 means raw logits (greedy rows)
) -> torch.Tensor:
    """log_softmax(logits / temperature)[row, token] as `sample_untruncated` computes it: float32 [N],
    bitwise equal to that sampler's logprob of the same token on the same logits — the same chunk kernel
    (without its noise) and the same merge (the trainer side of deterministic mode scores sequences with it)."""
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] of {_LOGIT_DTYPES}, contiguous in V; got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if token_ids.shape != (num_rows,) or token_ids.dtype != torch.int64:
        raise ValueError(f"token_ids must be [{num_rows}] int64; got {token_ids.dtype} {tuple(token_ids.shape)}")
    if temperature.shape != (num_rows,) or temperature.dtype != torch.float32:
        raise ValueError(f"temperature must be [{num_rows}] float32; got {temperature.dtype} {tuple(temperature.shape)}")
    token_ids, temperature = token_ids.contiguous(), temperature.contiguous()
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        _launch_chunked(logits, temperature, token_ids, out)
    return out


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, positions_ptr, part_ptr, stride_row, vocab, num_chunks,
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE_LOG: tl.constexpr, NOISE: tl.constexpr,
):
    """Untruncated sampling, split over the vocabulary: one program per (row, chunk of CHUNK tokens) writes
    the chunk's raw max and first argmax, its best Gumbel-perturbed tempered logit and index (when NOISE;
    scoring given tokens skips it), and its tempered max and sum of exp(x - max). `_sample_combine_kernel`
    merges the chunks of a row."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    temp = tl.where(temperature <= 0.0, 1.0, temperature)
    if NOISE:
        row_key = _row_key(seeds_ptr, positions_ptr, row)
    # per lane: the best raw logit so far and its token, the best perturbed logit and its token (strict >
    # keeps a lane's first index; the lanes are merged once, after the loop)
    lane_raw = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_raw_idx = tl.zeros([BLOCK_V], tl.int32)
    lane_noisy = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)  # sum of exp(x - m) per lane, rescaled when m grows
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        raw = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        take = raw > lane_raw
        lane_raw = tl.where(take, raw, lane_raw)
        lane_raw_idx = tl.where(take, offs, lane_raw_idx)
        if temp == 1.0:
            x = raw  # x / 1 is x: skip the IEEE division
        else:
            x = tl.math.div_rn(raw, tl.zeros_like(raw) + temp)
        if NOISE:
            noisy = tl.where(mask, x + _gumbel(row_key, offs, LIBDEVICE_LOG), float("-inf"))
            take = noisy > lane_noisy
            lane_noisy = tl.where(take, noisy, lane_noisy)
            lane_idx = tl.where(take, offs, lane_idx)
        new_m = tl.maximum(m, tl.max(x, 0))
        acc = acc * tl.exp(m - new_m) + tl.where(mask, tl.exp(x - new_m), 0.0)
        m = new_m
    best_raw, best_raw_idx = _lane_argmax(lane_raw, lane_raw_idx)
    best_noisy, best_idx = _lane_argmax(lane_noisy, lane_idx)
    out = part_ptr + (row.to(tl.int64) * num_chunks + chunk) * 6
    tl.store(out + 0, best_raw)
    tl.store(out + 1, best_raw_idx.to(tl.float32))
    tl.store(out + 2, best_noisy)
    tl.store(out + 3, best_idx.to(tl.float32))
    tl.store(out + 4, m)
    tl.store(out + 5, tl.sum(acc, 0))


@triton.jit
def _sample_combine_kernel(
    logits_ptr, temperature_ptr, part_ptr, token_ptr, logprob_ptr, stride_row, num_chunks,
    BLOCK_C: tl.constexpr, GIVEN: tl.constexpr,
):
    """Merges a row's chunks into its token (or, when GIVEN, reads the token from token_ptr) and the
    token's logprob."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    cmask = c < num_chunks
    base = part_ptr + row.to(tl.int64) * num_chunks * 6 + c * 6
    raw_max = tl.load(base + 0, mask=cmask, other=float("-inf"))
    raw_idx = tl.load(base + 1, mask=cmask, other=0.0).to(tl.int32)
    noisy = tl.load(base + 2, mask=cmask, other=float("-inf"))
    noisy_idx = tl.load(base + 3, mask=cmask, other=0.0).to(tl.int32)
    m = tl.load(base + 4, mask=cmask, other=float("-inf"))
    sums = tl.load(base + 5, mask=cmask, other=0.0)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    greedy = temperature <= 0.0
    temp = tl.where(greedy, 1.0, temperature)
    greedy_idx = tl.sum(tl.where(c == tl.argmax(raw_max, 0), raw_idx, 0), 0)  # first chunk holding the max
    sample_idx = tl.sum(tl.where(c == tl.argmax(noisy, 0), noisy_idx, 0), 0)
    row_max = tl.max(m, 0)
    lse = tl.log(tl.sum(tl.where(cmask, sums * tl.exp(m - row_max), 0.0), 0))
    if GIVEN:
        token = tl.load(token_ptr + row)
    else:
        token = tl.where(greedy, greedy_idx, sample_idx)
        tl.store(token_ptr + row, token.to(tl.int64))
    x_token = tl.math.div_rn(tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32), temp)
    tl.store(logprob_ptr + row, x_token - row_max - lse)


_CHUNK = 2048


def sample_untruncated(
    logits: torch.Tensor,  # [B, V] float16 / bfloat16 / float32
    temperature: torch.Tensor,  # [B] float32; <= 0 marks greedy rows
    seeds: torch.Tensor,  # [B] int64 holding uint32 values
    positions: torch.Tensor,  # [B] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for rows without top-k / top-p / min-p, split over the vocabulary so that a small batch
    still fills the GPU (one program per 2048 tokens of a row, then a merge per row).

    The caller guarantees that no row truncates (it knows the sampling parameters on the host). Same
    tokens as `sample` (the same noise and the same first-index tie rule); logprobs agree to ~1e-6 (the
    log-sum-exp is merged per chunk instead of summed in one pass). Returns new (token_ids int64 [B],
    logprobs float32 [B]).
    """
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] of {_LOGIT_DTYPES}, contiguous in V; got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    for name, t in (("temperature", temperature), ("seeds", seeds), ("positions", positions)):
        if t.shape != (num_rows,) or t.device != logits.device or (num_rows and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{num_rows}] tensor on {logits.device}")
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        _launch_chunked(logits, temperature, token_ids, logprobs, seeds, positions)
    return token_ids, logprobs


def _launch_chunked(logits, temperature, tokens, logprobs, seeds=None, positions=None) -> None:
    """The chunk and merge kernels over logits [B, V]. With seeds and positions ([B]): sample into tokens
    [B] int64; without: score the given tokens. Writes logprobs [B] float32 either way."""
    num_rows, vocab = logits.shape
    noise = seeds is not None
    num_chunks = triton.cdiv(vocab, _CHUNK)
    parts = torch.empty(num_rows, num_chunks, 6, dtype=torch.float32, device=logits.device)  # per-chunk stats
    _sample_chunk_kernel[(num_rows, num_chunks)](
        logits, temperature, seeds if noise else tokens, positions if noise else tokens, parts, logits.stride(0),
        vocab, num_chunks, CHUNK=_CHUNK, BLOCK_V=min(1024, _CHUNK), LIBDEVICE_LOG=logits.is_cuda, NOISE=noise,
        num_warps=4,
    )
    _sample_combine_kernel[(num_rows,)](
        logits, temperature, parts, tokens, logprobs, logits.stride(0), num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks), GIVEN=not noise, num_warps=1,
    )


def sample(
    logits: torch.Tensor,  # [B, V] float16 / bfloat16 / float32
    temperature: torch.Tensor,  # [B] float32; <= 0 marks greedy rows
    top_k: torch.Tensor,  # [B] int32/int64; 0 (or >= V) = off
    top_p: torch.Tensor,  # [B] float32; 1 = off
    min_p: torch.Tensor,  # [B] float32; 0 = off
    seeds: torch.Tensor,  # [B] int64 (or int32) holding uint32 values
    positions: torch.Tensor,  # [B] int64 (or int32), output position of the token being sampled
    num_top_logprobs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Sample one token per row; same outputs as `sample_ref`.

    Returns (token_ids int64 [B], logprobs float32 [B], top) where top is None or (top_ids int64 [B, N],
    top_logprobs float32 [B, N]), all new tensors. The logprob is that of the sampled token under the
    distribution it was drawn from (log_softmax of the tempered, truncated logits); greedy rows report the
    raw log_softmax. Tokens equal the reference's exactly except at floating-point boundary ties of a
    truncation threshold (see the module docstring); logprobs agree to ~1e-5. `top` is computed with
    torch.topk over the processed logprobs, which materializes a float32 [B, V] tensor.
    """
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits must be [B, V] with V > 0 and dtype in {_LOGIT_DTYPES}; got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    expected = {
        "temperature": (temperature, (torch.float32,)),
        "top_k": (top_k, _INDEX_DTYPES),
        "top_p": (top_p, (torch.float32,)),
        "min_p": (min_p, (torch.float32,)),
        "seeds": (seeds, _INDEX_DTYPES),
        "positions": (positions, _INDEX_DTYPES),
    }
    for name, (t, dtypes) in expected.items():
        if t.shape != (num_rows,) or t.dtype not in dtypes:
            raise ValueError(f"{name} must be [{num_rows}] of {dtypes}; got {t.dtype} {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")
        if num_rows and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in the vocab dimension")
    if not 0 <= num_top_logprobs <= vocab:
        raise ValueError(f"num_top_logprobs must be in [0, {vocab}]; got {num_top_logprobs}")

    device = logits.device
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    row_stats = torch.empty(4, num_rows, dtype=torch.float32, device=device)  # max, lse, threshold, min_p
    if num_rows:
        _sample_kernel[(num_rows,)](
            logits, temperature, top_k, top_p, min_p, seeds, positions,
            token_ids, logprobs, row_stats[0], row_stats[1], row_stats[2], row_stats[3],
            logits.stride(0), vocab,
            BLOCK_V=min(1024, triton.next_power_of_2(vocab)), NUM_PROBES=_NUM_PROBES,
            LIBDEVICE_LOG=logits.is_cuda, num_warps=4,
        )
    top = None
    if num_top_logprobs > 0:
        row_max, lse, threshold, row_min_p = (s[:, None] for s in row_stats)  # each [B, 1]
        temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
        x = logits.to(torch.float32) / temp  # [B, V]
        keep = (x >= threshold) & (torch.exp(x - row_max) >= row_min_p)
        logprobs_all = torch.where(keep, x - row_max - lse, float("-inf"))
        vals, ids = torch.topk(logprobs_all, num_top_logprobs, dim=-1)
        top = (ids, vals)
    return token_ids, logprobs, top
