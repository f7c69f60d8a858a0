"""Triton kernels of speculative sampling without truncation, split over the vocabulary.

A row's vocabulary is cut into chunks of CHUNK tokens (2048; fewer when the vocabulary is smaller); one
program per (row, chunk) makes the passes over the logits, and the chunks' partial results are merged per
row, so that a batch of one row still fills the GPU with a 150k-token vocabulary (the layout of
`sample_untruncated` in `kernels/sampling.py`):

    draft_sample       2 launches
        stats          (row, chunk): max of x = logits / t, its first token, sum of exp(x - max), best
                       x + Gumbel noise (DRAFT_SALT) and its token                      -> parts [B, C, 5]
        write          (row, chunk): merges the row's chunks, writes q = exp(x - max) / sum over the chunk;
                       chunk 0 writes the token (greedy rows: first argmax of the raw logits)
    rejection_sample   3 launches
        stats          (row, position, chunk): max, first argmax, sum of exp(x - max) of the target
                       logits; positions past a row's drafts are skipped              -> parts [R, K + 1, C, 3]
        verify         (row, chunk): every program replays the row's accept / reject decisions from the
                       merged stats (a few loads per position), chunk 0 writes the accepted tokens, the
                       greedy stop token, their logprobs and the accepted count; sampled rows then scan their
                       chunk of the stop position: after a rejection the best log(max(0, p - q)) + noise and
                       log(p) + noise (the all-zero-residual fallback) and the residual mass, after all drafts
                       the best x + the ordinary sampler's noise (salt 0)             -> cands [R, C, 5]
        finish         (row): sampled rows merge the candidates into the stop token and its logprob

This is the function of `sample_draft_ref` / `rejection_sample_ref` (`runner/spec_decode/rejection.py`)
for rows without top-k / top-p / min-p: the same counter-based noise bit for bit (the hash of
`kernels/sampling.py`), the same first-index tie rule (chunks are merged in token order), softmax as
exp(x - max) / sum in float32. Sums are reduced in a different order than torch's (per chunk, rescaled to
the row max), so probabilities agree to a few ulp: a decision can differ from the reference only where it
is tied to the last bit. Token ids travel through the float32 partials, exact below 2**24 (asserted).
Nothing waits for the device and every shape depends on the input shapes only; outputs and partials are
written in place (CUDA-graph capturable). On CPU tensors the kernels run under TRITON_INTERPRET=1 only
(tests). Not here: truncation, top-N logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.sampling import _gumbel, _lane_argmax, _log, _mix32, _tempered

_CHUNK = 2048  # tokens per program
_BLOCK_V = 1024  # tokens per step of a program's loop
_DRAFT_STATS = 5  # per chunk: max x, its token, sum of exp(x - max), max x + noise, its token
_TARGET_STATS = 3  # per chunk: max x, its token, sum of exp(x - max)
_CANDIDATES = 5  # per chunk: best candidate A, its token, best candidate B, its token, residual mass


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """exp accurate to ~1 ulp (as torch's), the fast approximation's error would show in p and q."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _tempered_at(row_ptr, token, temp):
    """The tempered logit of one token (IEEE division, as `_tempered`)."""
    return tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), temp)


@triton.jit
def _salted_key(seed, position, salt):
    """`row_keys(seed, position, salt)` of the reference on uint32 values."""
    return _mix32(_mix32(seed ^ salt) + position * 0x9E3779B9)


@triton.jit
def _chunk_stats(row_ptr, chunk, vocab, temp, key, NOISE: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Over tokens chunk * CHUNK .. + CHUNK of one row, x = logits / temp: (max x, its first token, sum of
    exp(x - max x), and when NOISE: max of x + Gumbel noise of `key`, its first token). With temp == 1 (greedy
    rows) x is the raw logits, so the first token is the raw argmax."""
    lane_x = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: best so far and its token (strict >
    lane_x_idx = tl.zeros([BLOCK_V], tl.int32)  # keeps a lane's first index); lanes merged after the loop
    lane_noisy = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_noisy_idx = tl.zeros([BLOCK_V], tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)  # sum of exp(x - m) per lane, rescaled when m grows
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = _tempered(row_ptr, offs, mask, temp)
        take = x > lane_x
        lane_x = tl.where(take, x, lane_x)
        lane_x_idx = tl.where(take, offs, lane_x_idx)
        if NOISE:
            noisy = tl.where(mask, x + _gumbel(key, offs, LIBDEVICE), float("-inf"))
            take = noisy > lane_noisy
            lane_noisy = tl.where(take, noisy, lane_noisy)
            lane_noisy_idx = tl.where(take, offs, lane_noisy_idx)
        new_m = tl.maximum(m, tl.max(x, 0))
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: a sum of 0, not NaN
        acc = acc * _exp(m - ref, LIBDEVICE) + tl.where(mask, _exp(x - ref, LIBDEVICE), 0.0)
        m = new_m
    _, x_idx = _lane_argmax(lane_x, lane_x_idx)
    noisy_max, noisy_idx = _lane_argmax(lane_noisy, lane_noisy_idx)
    return m, x_idx, tl.sum(acc, 0), noisy_max, noisy_idx


@triton.jit
def _merge_chunks(part_ptr, num_chunks, NUM_STATS: tl.constexpr, BLOCK_C: tl.constexpr, LIBDEVICE: tl.constexpr):
    """(max x, its first token, sum of exp(x - max x)) of a whole row from its chunks' (max, first token,
    sum) at part_ptr [C, NUM_STATS]. Chunks hold increasing token ranges, so the smallest token among the
    chunks holding the max is the row's first argmax."""
    c = tl.arange(0, BLOCK_C)
    cmask = c < num_chunks
    m = tl.load(part_ptr + c * NUM_STATS, mask=cmask, other=float("-inf"))
    idx = tl.load(part_ptr + c * NUM_STATS + 1, mask=cmask, other=0.0).to(tl.int32)
    s = tl.load(part_ptr + c * NUM_STATS + 2, mask=cmask, other=0.0)
    row_max, argmax = _lane_argmax(m, idx)
    total = tl.sum(tl.where(cmask, s * _exp(m - row_max, LIBDEVICE), 0.0), 0)
    return row_max, argmax, total


@triton.jit
def _merge_candidates(part_ptr, num_chunks, NUM_STATS: tl.constexpr, BLOCK_C: tl.constexpr):
    """First token holding the best value among the chunks' (best value, its token) at part_ptr [C, NUM_STATS]."""
    c = tl.arange(0, BLOCK_C)
    cmask = c < num_chunks
    best = tl.load(part_ptr + c * NUM_STATS, mask=cmask, other=float("-inf"))
    idx = tl.load(part_ptr + c * NUM_STATS + 1, mask=cmask, other=0.0).to(tl.int32)
    _, token = _lane_argmax(best, idx)
    return token


# ---- draft_sample ---------------------------------------------------------------------------------------
@triton.jit
def _draft_stats_kernel(
    logits_ptr, stride_logits, temperature_ptr, seeds_ptr, positions_ptr, offset, part_ptr, vocab, num_chunks,
    SALT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    temp = tl.where(temperature > 0.0, temperature, 1.0)
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = (tl.load(positions_ptr + row) + offset).to(tl.uint32)
    m, m_idx, s, noisy, noisy_idx = _chunk_stats(
        logits_ptr + row.to(tl.int64) * stride_logits, chunk, vocab, temp, _salted_key(seed, position, SALT), True,
        CHUNK, BLOCK_V, LIBDEVICE,
    )
    out = part_ptr + (row.to(tl.int64) * num_chunks + chunk) * 5
    tl.store(out + 0, m)
    tl.store(out + 1, m_idx.to(tl.float32))
    tl.store(out + 2, s)
    tl.store(out + 3, noisy)
    tl.store(out + 4, noisy_idx.to(tl.float32))


@triton.jit
def _draft_write_kernel(
    logits_ptr, stride_logits, temperature_ptr, part_ptr, token_ptr, stride_token, q_ptr, stride_q, vocab,
    num_chunks, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    temperature = tl.load(temperature_ptr + row)
    temp = tl.where(temperature > 0.0, temperature, 1.0)
    parts = part_ptr + row.to(tl.int64) * num_chunks * 5
    m, argmax, s = _merge_chunks(parts, num_chunks, 5, BLOCK_C, LIBDEVICE)
    q_row = q_ptr + row.to(tl.int64) * stride_q
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        tl.store(q_row + offs, _exp(_tempered(row_ptr, offs, mask, temp) - m, LIBDEVICE) / s, mask=mask)
    if chunk == 0:
        if temperature <= 0.0:
            token = argmax
        else:
            token = _merge_candidates(parts + 3, num_chunks, 5, BLOCK_C)
        tl.store(token_ptr + row * stride_token, token.to(tl.int64))


def _chunking(vocab: int, chunk: int) -> tuple[int, int, int]:
    """(CHUNK, BLOCK_V, number of chunks) for a vocabulary: chunks of `chunk` tokens (a power of two), or one
    chunk of next_power_of_2(vocab) when that is smaller."""
    assert chunk > 0 and chunk & (chunk - 1) == 0, chunk
    assert vocab < 2**24, vocab  # token ids pass through float32 partials
    CHUNK = min(chunk, triton.next_power_of_2(vocab))
    return CHUNK, min(_BLOCK_V, CHUNK), triton.cdiv(vocab, CHUNK)


def draft_sample(
    logits: torch.Tensor,  # [B, V] f16 / bf16 / f32, contiguous in V
    temperature: torch.Tensor,  # [B] f32, 0 = greedy
    seeds: torch.Tensor,  # [B] int64 uint32 values
    positions: torch.Tensor,  # [B] int64; the drafted token's output position is positions + offset
    offset: int,
    tokens: torch.Tensor,  # [B] int64 out (any stride)
    q: torch.Tensor,  # [B, V] f32 out, contiguous in V
    salt: int,
    *,
    chunk: int = _CHUNK,  # tokens per program, a power of two (tests use small ones)
) -> None:
    """Writes each row's draft token into `tokens` and its distribution into `q` (two launches)."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and q.stride(1) == 1 and q.shape == (B, V) and tokens.shape == (B,)
    if B == 0:
        return
    CHUNK, BLOCK_V, num_chunks = _chunking(V, chunk)
    parts = torch.empty(B, num_chunks, _DRAFT_STATS, dtype=torch.float32, device=logits.device)
    _draft_stats_kernel[(B, num_chunks)](
        logits, logits.stride(0), temperature, seeds, positions, offset, parts, V, num_chunks,
        SALT=salt, CHUNK=CHUNK, BLOCK_V=BLOCK_V, LIBDEVICE=logits.is_cuda, num_warps=4,
    )
    _draft_write_kernel[(B, num_chunks)](
        logits, logits.stride(0), temperature, parts, tokens, tokens.stride(0), q, q.stride(0), V, num_chunks,
        CHUNK=CHUNK, BLOCK_V=BLOCK_V, BLOCK_C=triton.next_power_of_2(num_chunks), LIBDEVICE=logits.is_cuda,
        num_warps=4,
    )


# ---- rejection_sample -----------------------------------------------------------------------------------
@triton.jit
def _target_stats_kernel(
    logits_ptr, stride_lr, stride_lj, num_drafts_ptr, temperature_ptr, part_ptr, vocab, num_chunks,
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    chunk = tl.program_id(2)
    if j <= tl.load(num_drafts_ptr + row):  # later positions are never reached
        temperature = tl.load(temperature_ptr + row)
        temp = tl.where(temperature > 0.0, temperature, 1.0)
        m, m_idx, s, _, _ = _chunk_stats(logits_ptr + row * stride_lr + j * stride_lj, chunk, vocab, temp, 0, False,
                                         CHUNK, BLOCK_V, LIBDEVICE)
        out = part_ptr + ((row * tl.num_programs(1) + j) * num_chunks + chunk) * 3
        tl.store(out + 0, m)
        tl.store(out + 1, m_idx.to(tl.float32))
        tl.store(out + 2, s)


@triton.jit
def _residual_candidates(row_ptr, q_row, chunk, vocab, temp, m, s, key, CHUNK: tl.constexpr,
                         BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Over one chunk, p = exp(x - m) / s against q: (best log(max(0, p - q)) + noise, its first token, best
    log(p) + noise, its first token, the chunk's residual mass), the noise of `key`."""
    lane_res = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_res_idx = tl.zeros([BLOCK_V], tl.int32)
    lane_p = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_p_idx = tl.zeros([BLOCK_V], tl.int32)
    mass = tl.zeros([BLOCK_V], tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        p = _exp(_tempered(row_ptr, offs, mask, temp) - m, LIBDEVICE) / s
        residual = tl.maximum(p - tl.load(q_row + offs, mask=mask, other=0.0), 0.0)
        mass += tl.where(mask, residual, 0.0)
        noise = _gumbel(key, offs, LIBDEVICE)
        noisy = tl.where(mask, _log(residual, LIBDEVICE) + noise, float("-inf"))
        take = noisy > lane_res
        lane_res = tl.where(take, noisy, lane_res)
        lane_res_idx = tl.where(take, offs, lane_res_idx)
        noisy = tl.where(mask, _log(p, LIBDEVICE) + noise, float("-inf"))
        take = noisy > lane_p
        lane_p = tl.where(take, noisy, lane_p)
        lane_p_idx = tl.where(take, offs, lane_p_idx)
    res_best, res_idx = _lane_argmax(lane_res, lane_res_idx)
    p_best, p_idx = _lane_argmax(lane_p, lane_p_idx)
    return res_best, res_idx, p_best, p_idx, tl.sum(mass, 0)


@triton.jit
def _verify_kernel(
    logits_ptr, stride_lr, stride_lj, drafts_ptr, stride_dr, stride_dj, q_ptr, stride_qr, stride_qj,
    num_drafts_ptr, temperature_ptr, seeds_ptr, positions_ptr, part_ptr, cand_ptr, out_ptr, num_accepted_ptr,
    logprobs_ptr, K, vocab, num_chunks, ACCEPT_SALT: tl.constexpr, RESAMPLE_SALT: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    first = chunk == 0  # the program that writes the row's outputs
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature <= 0.0
    temp = tl.where(greedy, 1.0, temperature)
    num_drafts = tl.load(num_drafts_ptr + row)
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row)
    num_accepted = num_drafts * 0
    running = num_accepted == 0  # no draft rejected yet
    stop_max = tl.zeros([], tl.float32)
    stop_sum = tl.zeros([], tl.float32)
    for j in range(K + 1):
        token = num_accepted * 0 - 1
        logprob = tl.zeros([], tl.float32)
        if running:
            row_ptr = logits_ptr + row * stride_lr + j * stride_lj
            m, argmax, s = _merge_chunks(part_ptr + (row * (K + 1) + j) * num_chunks * 3, num_chunks, 3, BLOCK_C,
                                         LIBDEVICE)
            accepted = j < num_drafts
            draft = tl.load(drafts_ptr + row * stride_dr + tl.minimum(j, K - 1) * stride_dj, mask=accepted, other=0)
            if accepted:
                if greedy:
                    accepted = draft == argmax
                else:
                    p_draft = _exp(_tempered_at(row_ptr, draft, temp) - m, LIBDEVICE) / s
                    q_draft = tl.load(q_ptr + row * stride_qr + j * stride_qj + draft)
                    h = _mix32(_salted_key(seed, (position + j).to(tl.uint32), ACCEPT_SALT))
                    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                    accepted = (u * q_draft <= p_draft) & (p_draft > 0.0)
            if accepted:
                token = draft
            else:  # the stop: the greedy argmax here, the sampled rows' token in `_finish_kernel`
                running = num_accepted < 0
                num_accepted = num_drafts * 0 + j
                stop_max = m
                stop_sum = s
                if greedy:
                    token = argmax.to(tl.int64)
            logprob = tl.where(token >= 0,
                               _tempered_at(row_ptr, tl.maximum(token, 0), temp) - m - _log(s, LIBDEVICE), 0.0)
        tl.store(out_ptr + row * (K + 1) + j, token, mask=first)
        tl.store(logprobs_ptr + row * (K + 1) + j, logprob, mask=first)
    tl.store(num_accepted_ptr + row, num_accepted.to(tl.int64), mask=first)
    if temperature > 0.0:
        stop_ptr = logits_ptr + row * stride_lr + num_accepted * stride_lj
        stop_key = (position + num_accepted).to(tl.uint32)
        if num_accepted < num_drafts:  # y ~ norm(max(0, p - q)), or p when that is all zero
            best, best_idx, p_best, p_idx, mass = _residual_candidates(
                stop_ptr, q_ptr + row * stride_qr + num_accepted * stride_qj, chunk, vocab, temp, stop_max, stop_sum,
                _salted_key(seed, stop_key, RESAMPLE_SALT), CHUNK, BLOCK_V, LIBDEVICE,
            )
        else:  # all drafts accepted: the ordinary sampler's noise (salt 0)
            _, _, _, best, best_idx = _chunk_stats(stop_ptr, chunk, vocab, temp,
                                                   _mix32(_mix32(seed) + stop_key * 0x9E3779B9), True, CHUNK,
                                                   BLOCK_V, LIBDEVICE)
            p_best = best
            p_idx = best_idx
            mass = tl.zeros([], tl.float32)
        out = cand_ptr + (row * num_chunks + chunk) * 5
        tl.store(out + 0, best)
        tl.store(out + 1, best_idx.to(tl.float32))
        tl.store(out + 2, p_best)
        tl.store(out + 3, p_idx.to(tl.float32))
        tl.store(out + 4, mass)


@triton.jit
def _finish_kernel(
    logits_ptr, stride_lr, stride_lj, num_drafts_ptr, temperature_ptr, part_ptr, cand_ptr, out_ptr, num_accepted_ptr,
    logprobs_ptr, K, num_chunks, BLOCK_C: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        stop = tl.load(num_accepted_ptr + row)
        cands = cand_ptr + row * num_chunks * 5
        c = tl.arange(0, BLOCK_C)
        mass = tl.sum(tl.load(cands + c * 5 + 4, mask=c < num_chunks, other=0.0), 0)
        use_best = (mass > 0.0) | (stop >= tl.load(num_drafts_ptr + row))  # the residual or the bonus candidate
        token = tl.where(use_best, _merge_candidates(cands, num_chunks, 5, BLOCK_C),
                         _merge_candidates(cands + 2, num_chunks, 5, BLOCK_C))
        m, _, s = _merge_chunks(part_ptr + (row * (K + 1) + stop) * num_chunks * 3, num_chunks, 3, BLOCK_C, LIBDEVICE)
        logprob = _tempered_at(logits_ptr + row * stride_lr + stop * stride_lj, token, temperature) - m - _log(s, LIBDEVICE)
        tl.store(out_ptr + row * (K + 1) + stop, token.to(tl.int64))
        tl.store(logprobs_ptr + row * (K + 1) + stop, logprob)


def rejection_sample(
    target_logits: torch.Tensor,  # [R, K + 1, V] f16 / bf16 / f32, contiguous in V
    draft_token_ids: torch.Tensor,  # [R, K] int64 (any strides)
    draft_probs: torch.Tensor,  # [R, K, V] f32, contiguous in V
    num_drafts: torch.Tensor,  # [R] int64 in [0, K]
    temperature: torch.Tensor,  # [R] f32, 0 = greedy
    seeds: torch.Tensor,  # [R] int64 uint32 values
    positions: torch.Tensor,  # [R] int64 output position of the first new token
    accept_salt: int,
    resample_salt: int,
    *,
    chunk: int = _CHUNK,  # tokens per program, a power of two (tests use small ones)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output_ids int64 [R, K + 1] with -1 after the last new token, num_accepted int64 [R], logprobs f32
    [R, K + 1], 0 after the last new token), new tensors (three launches)."""
    R, K1, V = target_logits.shape
    K = K1 - 1
    assert target_logits.stride(2) == 1 and draft_probs.stride(2) == 1
    assert draft_token_ids.shape == (R, K) and draft_probs.shape == (R, K, V)
    device = target_logits.device
    output_ids = torch.empty(R, K1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(R, dtype=torch.int64, device=device)
    logprobs = torch.empty(R, K1, dtype=torch.float32, device=device)
    if R == 0:
        return output_ids, num_accepted, logprobs
    CHUNK, BLOCK_V, num_chunks = _chunking(V, chunk)
    BLOCK_C = triton.next_power_of_2(num_chunks)
    lr, lj = target_logits.stride(0), target_logits.stride(1)
    parts = torch.empty(R, K1, num_chunks, _TARGET_STATS, dtype=torch.float32, device=device)
    cands = torch.empty(R, num_chunks, _CANDIDATES, dtype=torch.float32, device=device)
    _target_stats_kernel[(R, K1, num_chunks)](
        target_logits, lr, lj, num_drafts, temperature, parts, V, num_chunks,
        CHUNK=CHUNK, BLOCK_V=BLOCK_V, LIBDEVICE=target_logits.is_cuda, num_warps=4,
    )
    _verify_kernel[(R, num_chunks)](
        target_logits, lr, lj, draft_token_ids, draft_token_ids.stride(0), draft_token_ids.stride(1), draft_probs,
        draft_probs.stride(0), draft_probs.stride(1), num_drafts, temperature, seeds, positions, parts, cands,
        output_ids, num_accepted, logprobs, K, V, num_chunks, ACCEPT_SALT=accept_salt, RESAMPLE_SALT=resample_salt,
        CHUNK=CHUNK, BLOCK_V=BLOCK_V, BLOCK_C=BLOCK_C, LIBDEVICE=target_logits.is_cuda, num_warps=4,
    )
    _finish_kernel[(R,)](
        target_logits, lr, lj, num_drafts, temperature, parts, cands, output_ids, num_accepted, logprobs, K,
        num_chunks, BLOCK_C=BLOCK_C, LIBDEVICE=target_logits.is_cuda, num_warps=1,
    )
    return output_ids, num_accepted, logprobs
