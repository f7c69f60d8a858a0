"""Draft sampling and the rejection sampler of speculative decoding (plain torch, CPU and GPU).

    drafts:  t_j ~ q_j           Gumbel-max over the drafter's processed logits, noise salt DRAFT_SALT
    verify:  accept t_j  iff  u_j * q_j(t_j) <= p_j(t_j)     u_j uniform, salt ACCEPT_SALT
             first rejection at j: y ~ norm(max(0, p_j - q_j))   Gumbel-max, salt RESAMPLE_SALT
             all d drafts accepted: bonus y ~ p_d              the ordinary sampler's noise (salt 0)
    greedy rows: accept iff t_j == argmax(target logits_j); y = argmax(target logits at the stop)

p is the target's distribution after temperature / top-k / top-p / min-p (`processed_logits_ref`), and q
the drafter's after the same processing: drafts are drawn from q, so accepted tokens are distributed
exactly as the target's samples (Leviathan et al. 2023; Chen et al. 2023). Every random number is a pure
function of (seed, output position, salt[, token id]): a seeded request's speculative output does not
depend on the batch, and the noise of an output position is never reused for a decision that was kept.
A row with no drafts draws its one token exactly as `sample_ref` does.

Reported logprobs are under the target's processed distribution p (the distribution the output is
distributed as), for greedy rows the log-softmax of the raw target logits, as in `sample_ref`.
Every sampler here takes the rows' `SamplingTensors`. With its `uses` given, nothing here waits for the
device; without truncation (`NO_TRUNCATION`) nothing makes a host constant either, so
`runner/spec_decode/graphs.py` captures both functions in a CUDA graph.

`sample_draft_ref` and `rejection_sample_ref` are the plain-torch definitions. `sample_draft` and
`rejection_sample` run them, except for CUDA batches without truncation and top-N logprobs, which take the
Triton kernels of `rejection_kernel.py` (two launches per draft step, three for all of verification, each
split over the vocabulary; the same function up to float rounding ties). Not here: choosing how many tokens
to draft, the drafter itself, KV rollback.
"""

from __future__ import annotations

import torch

from kernels.sampling_ref import counter_uniform, gumbel_noise, processed_logits_ref
from runner.sampling_tensors import NO_TRUNCATION, SamplingTensors

DRAFT_SALT = 0x0D2AF7ED
ACCEPT_SALT = 0x0ACCE97E
RESAMPLE_SALT = 0x0E5A3F1E


def processed_logits(
    logits: torch.Tensor,  # [B, V] any float dtype
    temperature: torch.Tensor,  # [B] f32, 0 = greedy (treated as 1)
    top_k: torch.Tensor,  # [B] int
    top_p: torch.Tensor,  # [B] f32
    min_p: torch.Tensor,  # [B] f32
    uses: tuple[bool, bool, bool] | None,
) -> torch.Tensor:
    """`processed_logits_ref`, float32 [B, V]. Without truncation (uses == NO_TRUNCATION) it computes the same
    tempered logits without the reference's host-made -inf constant, so a CUDA graph can capture it."""
    if uses != NO_TRUNCATION:
        return processed_logits_ref(logits, temperature, top_k, top_p, min_p, uses)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    return logits.to(torch.float32) / temp[:, None]


def use_kernels(device: torch.device) -> bool:
    """Whether untruncated batches on `device` take the Triton kernels (`rejection_kernel.py`)."""
    return device.type == "cuda"


def salted_gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, salt: int) -> torch.Tensor:
    """Gumbel noise float32 [B, V] keyed by (seed, position, salt, token id)."""
    return -torch.log(-torch.log(counter_uniform(seeds, positions, vocab_size, salt)))


def sample_draft(
    logits: torch.Tensor,  # [B, V] drafter logits
    sampling: SamplingTensors,  # B rows; the drafted token's output position is sampling.positions + offset
    *,
    offset: int = 0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (tokens [B] int64, q [B, V] f32) to write into
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_draft_ref` of positions + offset; (token_ids, q), written into `out` when given."""
    s = sampling
    if s.uses == NO_TRUNCATION and use_kernels(logits.device):
        tokens, q = out if out is not None else (
            torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device),
            torch.empty(logits.shape, dtype=torch.float32, device=logits.device),
        )
        from runner.spec_decode import rejection_kernel

        rejection_kernel.draft_sample(logits, s.temperature, s.seeds, s.positions, offset, tokens, q, DRAFT_SALT)
        return tokens, q
    tokens, q = sample_draft_ref(logits, s.replace(positions=s.positions + offset) if offset else s)
    if out is None:
        return tokens, q
    out[0].copy_(tokens)
    out[1].copy_(q)
    return out


def sample_draft_ref(
    logits: torch.Tensor,  # [B, V] drafter logits
    sampling: SamplingTensors,  # B rows; positions: output position of the drafted token
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token per row and the distribution q it was drawn from.

    Returns (token_ids int64 [B], q float32 [B, V]); greedy rows take the argmax of the raw logits (their q
    is not used by the verifier).
    """
    s = sampling
    processed = processed_logits(logits, s.temperature, s.top_k, s.top_p, s.min_p, s.uses)  # [B, V]
    q = torch.softmax(processed, dim=-1)
    noisy = processed + salted_gumbel(s.seeds, s.positions, logits.shape[-1], DRAFT_SALT)
    tokens = torch.where(s.temperature <= 0, torch.argmax(logits, dim=-1), torch.argmax(noisy, dim=-1))
    return tokens, q


def rejection_sample(
    target_logits: torch.Tensor,  # [R, K + 1, V]
    draft_token_ids: torch.Tensor,  # [R, K] int64
    draft_probs: torch.Tensor,  # [R, K, V] f32
    num_drafts: torch.Tensor,  # [R] int64 in [0, K]
    sampling: SamplingTensors,  # R rows; positions: output position of each row's first new token
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`rejection_sample_ref`; logprobs after a row's last new token are unspecified."""
    s = sampling
    if s.uses == NO_TRUNCATION and s.num_top_logprobs == 0 and use_kernels(target_logits.device):
        from runner.spec_decode import rejection_kernel

        output_ids, num_accepted, logprobs = rejection_kernel.rejection_sample(
            target_logits, draft_token_ids, draft_probs, num_drafts, s.temperature, s.seeds, s.positions, ACCEPT_SALT,
            RESAMPLE_SALT,
        )
        return output_ids, num_accepted, logprobs, None
    return rejection_sample_ref(target_logits, draft_token_ids, draft_probs, num_drafts, s)


def rejection_sample_ref(
    target_logits: torch.Tensor,  # [R, K + 1, V] target logits at the last token and each draft
    draft_token_ids: torch.Tensor,  # [R, K] int64
    draft_probs: torch.Tensor,  # [R, K, V] f32, q each draft was drawn from
    num_drafts: torch.Tensor,  # [R] int64 in [0, K]: drafts of each row (the rest is padding)
    sampling: SamplingTensors,  # R rows; positions: output position of each row's first new token
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Verify drafts against the target; no host sync when `sampling.uses` is given.

    Returns (output_ids int64 [R, K + 1] with -1 after the last new token, num_accepted int64 [R] drafts
    accepted, logprobs f32 [R, K + 1], top) where row r's new tokens are output_ids[r, : num_accepted[r] + 1]
    and top is None or (ids int64 [R, K + 1, N], logprobs f32 [R, K + 1, N]) of p at each position, N =
    `sampling.num_top_logprobs`.
    """
    s = sampling
    temperature, seeds, positions = s.temperature, s.seeds, s.positions
    R, K1, V = target_logits.shape
    K = K1 - 1
    assert draft_token_ids.shape == (R, K) and draft_probs.shape == (R, K, V), (draft_token_ids.shape, draft_probs.shape)
    device = target_logits.device

    def per_pos(x: torch.Tensor, n: int = K1) -> torch.Tensor:  # [R] -> [R * n], each entry n times
        return x[:, None].expand(R, n).reshape(-1)

    flat = target_logits.reshape(R * K1, V)
    processed = processed_logits(flat, per_pos(temperature), per_pos(s.top_k), per_pos(s.top_p), per_pos(s.min_p),
                                 s.uses)
    processed = processed.view(R, K1, V)
    p = torch.softmax(processed, dim=-1)  # [R, K1, V]
    greedy = temperature <= 0  # [R]
    raw_logprobs = torch.log_softmax(target_logits.to(torch.float32), dim=-1)
    logprobs_all = torch.where(greedy[:, None, None], raw_logprobs, torch.log_softmax(processed, dim=-1))
    argmax_ids = torch.argmax(target_logits, dim=-1)  # [R, K1]
    offsets = torch.arange(K1, device=device)
    out_pos = positions[:, None] + offsets[None, :]  # [R, K1] output position of each slot

    if K > 0:
        p_draft = p[:, :K].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [R, K]
        q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [R, K]
        u = counter_uniform(per_pos(seeds, K), out_pos[:, :K].reshape(-1), 1, ACCEPT_SALT).view(R, K)
        accept = (u * q_draft <= p_draft) & (p_draft > 0)
        accept = torch.where(greedy[:, None], draft_token_ids == argmax_ids[:, :K], accept)
        accept &= offsets[None, :K] < num_drafts[:, None]
        num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [R]
        q_pad = torch.cat([draft_probs, torch.zeros(R, 1, V, dtype=draft_probs.dtype, device=device)], dim=1)
    else:
        num_accepted = torch.zeros(R, dtype=torch.int64, device=device)
        q_pad = torch.zeros(R, 1, V, dtype=torch.float32, device=device)

    stop = num_accepted[:, None, None].expand(R, 1, V)
    p_stop = p.gather(1, stop).squeeze(1)  # [R, V]
    q_stop = q_pad.gather(1, stop).squeeze(1)  # [R, V]
    processed_stop = processed.gather(1, stop).squeeze(1)  # [R, V]
    stop_pos = positions + num_accepted  # [R]
    rejected = num_accepted < num_drafts  # [R]
    residual = torch.clamp(p_stop - q_stop, min=0.0)
    # p == q up to rounding can reject with an all-zero residual; p itself is then the right fallback
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
    resampled = torch.argmax(torch.log(residual) + salted_gumbel(seeds, stop_pos, V, RESAMPLE_SALT), dim=-1)
    bonus = torch.argmax(processed_stop + gumbel_noise(seeds, stop_pos, V), dim=-1)
    final = torch.where(rejected, resampled, bonus)
    final = torch.where(greedy, argmax_ids.gather(1, num_accepted[:, None]).squeeze(1), final)  # [R]

    drafts_pad = torch.cat([draft_token_ids, torch.zeros(R, 1, dtype=torch.int64, device=device)], dim=1)
    output_ids = torch.where(offsets[None, :] < num_accepted[:, None], drafts_pad, final[:, None])
    output_ids = torch.where(offsets[None, :] <= num_accepted[:, None], output_ids, torch.full_like(output_ids, -1))
    logprobs = logprobs_all.gather(-1, output_ids.clamp(min=0)[..., None]).squeeze(-1)  # [R, K1]
    top = None
    if s.num_top_logprobs > 0:
        vals, ids = torch.topk(logprobs_all, s.num_top_logprobs, dim=-1)
        top = (ids, vals)
    return output_ids, num_accepted, logprobs, top
