"""Triton kernels of speculative sampling without truncation: one launch per draft step, one for verification.

    draft_sample       one program per row: token ~ q = softmax(logits / t) with the DRAFT_SALT Gumbel
                       noise (greedy rows: first raw argmax), q written out; the `sample_draft_ref` function
    rejection_sample   one program per row, all of its positions: accept / resample / bonus, the output ids,
                       the accepted count and the logprobs; the `rejection_sample_ref` function

Both compute the functions of `runner/spec_decode/rejection.py` for rows without top-k / top-p / min-p: the
same counter-based noise bit for bit (the hash of `kernels/sampling.py`), the same first-index tie rule,
softmax as exp(x - max) / sum in float32. Sums are reduced in a different order than torch's, so
probabilities agree to a few ulp: a decision can differ from the reference only where it is tied to the
last bit. Nothing waits for the device; outputs are written in place (CUDA-graph capturable). On CPU
tensors the kernels run under TRITON_INTERPRET=1 only (tests). Not here: truncation, top-N logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.sampling import _gumbel, _lane_argmax, _log, _mix32, _tempered

_BLOCK_V = 1024


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
def _row_stats(row_ptr, vocab, temp, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    """(tempered max, sum of exp(x - max), first argmax of the raw logits) of one row of logits."""
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_raw = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        raw = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        take = raw > lane_raw
        lane_raw = tl.where(take, raw, lane_raw)
        lane_idx = tl.where(take, offs, lane_idx)
        lane_max = tl.maximum(lane_max, _tempered(row_ptr, offs, mask, temp))
    m = tl.max(lane_max, 0)
    _, argmax = _lane_argmax(lane_raw, lane_idx)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        acc += tl.where(mask, _exp(_tempered(row_ptr, offs, mask, temp) - m, LIBDEVICE), 0.0)
    return m, tl.sum(acc, 0), argmax


@triton.jit
def _noisy_argmax(row_ptr, vocab, temp, key, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    """First argmax of tempered logits + Gumbel noise of `key`."""
    lane = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        noisy = tl.where(mask, _tempered(row_ptr, offs, mask, temp) + _gumbel(key, offs, LIBDEVICE), float("-inf"))
        take = noisy > lane
        lane = tl.where(take, noisy, lane)
        lane_idx = tl.where(take, offs, lane_idx)
    _, argmax = _lane_argmax(lane, lane_idx)
    return argmax


@triton.jit
def _draft_kernel(
    logits_ptr, stride_logits, temperature_ptr, seeds_ptr, positions_ptr, offset, token_ptr, stride_token,
    q_ptr, stride_q, vocab, SALT: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    temperature = tl.load(temperature_ptr + row)
    temp = tl.where(temperature > 0.0, temperature, 1.0)
    m, s, raw_argmax = _row_stats(row_ptr, vocab, temp, BLOCK_V, LIBDEVICE)
    q_row = q_ptr + row.to(tl.int64) * stride_q
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        tl.store(q_row + offs, _exp(_tempered(row_ptr, offs, mask, temp) - m, LIBDEVICE) / s, mask=mask)
    if temperature <= 0.0:
        token = raw_argmax
    else:
        seed = tl.load(seeds_ptr + row).to(tl.uint32)
        position = (tl.load(positions_ptr + row) + offset).to(tl.uint32)
        token = _noisy_argmax(row_ptr, vocab, temp, _salted_key(seed, position, SALT), BLOCK_V, LIBDEVICE)
    tl.store(token_ptr + row * stride_token, token.to(tl.int64))


def draft_sample(
    logits: torch.Tensor,  # [B, V] f16 / bf16 / f32, contiguous in V
    temperature: torch.Tensor,  # [B] f32, 0 = greedy
    seeds: torch.Tensor,  # [B] int64 uint32 values
    positions: torch.Tensor,  # [B] int64; the drafted token's output position is positions + offset
    offset: int,
    tokens: torch.Tensor,  # [B] int64 out (any stride)
    q: torch.Tensor,  # [B, V] f32 out, contiguous in V
    salt: int,
) -> None:
    """Writes each row's draft token into `tokens` and its distribution into `q`."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and q.stride(1) == 1 and q.shape == (B, V) and tokens.shape == (B,)
    if B == 0:
        return
    _draft_kernel[(B,)](
        logits, logits.stride(0), temperature, seeds, positions, offset, tokens, tokens.stride(0), q, q.stride(0), V,
        SALT=salt, BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(V)), LIBDEVICE=logits.is_cuda, num_warps=4,
    )


@triton.jit
def _rejection_kernel(
    logits_ptr, stride_lr, stride_lj, drafts_ptr, stride_dr, stride_dj, q_ptr, stride_qr, stride_qj,
    num_drafts_ptr, temperature_ptr, seeds_ptr, positions_ptr, out_ptr, num_accepted_ptr, logprobs_ptr, K, vocab,
    ACCEPT_SALT: tl.constexpr, RESAMPLE_SALT: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature <= 0.0
    temp = tl.where(greedy, 1.0, temperature)
    num_drafts = tl.load(num_drafts_ptr + row)
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row)
    num_accepted = num_drafts * 0
    running = num_accepted == 0  # no draft rejected yet
    for j in range(K + 1):
        token = num_accepted * 0 - 1
        logprob = tl.zeros([], tl.float32)
        if running:
            row_ptr = logits_ptr + row * stride_lr + j * stride_lj
            m, s, raw_argmax = _row_stats(row_ptr, vocab, temp, BLOCK_V, LIBDEVICE)
            accepted = j < num_drafts
            draft = tl.load(drafts_ptr + row * stride_dr + tl.minimum(j, K - 1) * stride_dj, mask=accepted, other=0)
            if accepted:
                if greedy:
                    accepted = draft == raw_argmax
                else:
                    p_draft = _exp(_tempered_at(row_ptr, draft, temp) - m, LIBDEVICE) / s
                    q_draft = tl.load(q_ptr + row * stride_qr + j * stride_qj + draft)
                    h = _mix32(_salted_key(seed, (position + j).to(tl.uint32), ACCEPT_SALT))
                    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                    accepted = (u * q_draft <= p_draft) & (p_draft > 0.0)
            if accepted:
                token = draft
            else:  # the stop: greedy argmax, resampled after a rejection, or the bonus token
                running = num_accepted < 0
                num_accepted = num_drafts * 0 + j
                stop_key = (position + j).to(tl.uint32)
                if greedy:
                    token = raw_argmax.to(tl.int64)
                elif j < num_drafts:  # y ~ norm(max(0, p - q)), or p when that is all zero
                    q_row = q_ptr + row * stride_qr + j * stride_qj
                    mass = tl.zeros([BLOCK_V], tl.float32)
                    for start in range(0, vocab, BLOCK_V):
                        offs = start + tl.arange(0, BLOCK_V)
                        mask = offs < vocab
                        p = _exp(_tempered(row_ptr, offs, mask, temp) - m, LIBDEVICE) / s
                        mass += tl.where(mask, tl.maximum(p - tl.load(q_row + offs, mask=mask, other=0.0), 0.0), 0.0)
                    use_residual = tl.sum(mass, 0) > 0.0
                    key = _salted_key(seed, stop_key, RESAMPLE_SALT)
                    lane = tl.full([BLOCK_V], float("-inf"), tl.float32)
                    lane_idx = tl.zeros([BLOCK_V], tl.int32)
                    for start in range(0, vocab, BLOCK_V):
                        offs = start + tl.arange(0, BLOCK_V)
                        mask = offs < vocab
                        p = _exp(_tempered(row_ptr, offs, mask, temp) - m, LIBDEVICE) / s
                        residual = tl.maximum(p - tl.load(q_row + offs, mask=mask, other=0.0), 0.0)
                        residual = tl.where(use_residual, residual, p)
                        noisy = tl.where(mask, _log(residual, LIBDEVICE) + _gumbel(key, offs, LIBDEVICE), float("-inf"))
                        take = noisy > lane
                        lane = tl.where(take, noisy, lane)
                        lane_idx = tl.where(take, offs, lane_idx)
                    _, token = _lane_argmax(lane, lane_idx)
                    token = token.to(tl.int64)
                else:  # all drafts accepted: the ordinary sampler's noise (salt 0)
                    token = _noisy_argmax(row_ptr, vocab, temp, _mix32(_mix32(seed) + stop_key * 0x9E3779B9),
                                          BLOCK_V, LIBDEVICE).to(tl.int64)
            logprob = _tempered_at(row_ptr, token, temp) - m - _log(s, LIBDEVICE)
        tl.store(out_ptr + row * (K + 1) + j, token)
        tl.store(logprobs_ptr + row * (K + 1) + j, logprob)
    tl.store(num_accepted_ptr + row, num_accepted.to(tl.int64))


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output_ids int64 [R, K + 1] with -1 after the last new token, num_accepted int64 [R], logprobs f32
    [R, K + 1], 0 after the last new token), new tensors."""
    R, K1, V = target_logits.shape
    K = K1 - 1
    assert target_logits.stride(2) == 1 and draft_probs.stride(2) == 1
    assert draft_token_ids.shape == (R, K) and draft_probs.shape == (R, K, V)
    device = target_logits.device
    output_ids = torch.empty(R, K1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(R, dtype=torch.int64, device=device)
    logprobs = torch.empty(R, K1, dtype=torch.float32, device=device)
    if R:
        _rejection_kernel[(R,)](
            target_logits, target_logits.stride(0), target_logits.stride(1), draft_token_ids,
            draft_token_ids.stride(0), draft_token_ids.stride(1), draft_probs, draft_probs.stride(0),
            draft_probs.stride(1), num_drafts, temperature, seeds, positions, output_ids, num_accepted, logprobs, K, V,
            ACCEPT_SALT=accept_salt, RESAMPLE_SALT=resample_salt, BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(V)),
            LIBDEVICE=target_logits.is_cuda, num_warps=4,
        )
    return output_ids, num_accepted, logprobs
