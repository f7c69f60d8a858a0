"""GRPO in plain PyTorch against the rollout engine, through TrainerBridge only.

    problems (seeded, held-out prompts excluded)
        |
        v
    bridge.rollout(prompts, n=G) ---------------------> engine / RolloutPool (policy version v)
        |  TokenSamples: token ids, loss mask, rollout logprobs, versions          ^
        v                                                                          |
    reward(problem, completion)      [B]                                          |
    advantage = (r - mean_group) / (std_group + eps)   [B], broadcast over tokens  |
        |                                                                          |
        v                                                                          |
    TrainingModel.token_logprobs(input_ids)   [B, T-1]  (same model code as the engine; MoE: the rollout's
                                                        routed experts replayed, rl.routing_replay)
    ratio = exp(logp - rollout_logp); loss = -min(ratio*A, clip(ratio)*A) (+ kl_coef * k3 KL to ref)
    (rl.off_policy_correction tis / mis: ratio against the pre-update trainer logprobs, loss times the
     TIS / MIS weight of each token; see trainer_bridge.bridge.importance_weights)
    token-level mean over every completion token of the batch
        |                                                                          |
        v                                                                          |
    AdamW step -> bridge.push_weights(model)  (sparse patch of changed coordinates) -+  version v+1

Run: `python -m trainer_bridge.grpo --config configs/grpo_toy.yaml [--set rl.steps=20]`. Swap the config for
configs/grpo_toy_pool.yaml and the same loop runs against a Ray pool. Metrics per step: reward, loss,
KL to the reference, rollout-vs-trainer logprob mismatch, rollout tokens/s, weight-sync time and bytes,
policy-version lag. This module does not know how the engine samples or how weights travel.
"""

from __future__ import annotations

import sys

import torch

from trainer_bridge.bridge import PaddedBatch, RolloutBatch, TrainerBridge
from trainer_bridge.config import RLConfig, RunConfig
from trainer_bridge.harness import cli_main, load_policy, rl_session, run_rl


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P * G] (prompt-major) -> advantages [P * G]; a group whose rewards are all equal gets 0."""
    r = rewards.view(-1, group_size)  # [P, G]
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=False) + eps)  # [P, G]
    return adv.reshape(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref) on tokens sampled from the policy; >= 0. Same shapes."""
    log_ratio = ref_logp - logp
    return log_ratio.exp() - log_ratio - 1


def grpo_loss(
    logp: torch.Tensor,  # [B, T-1] trainer logprobs (with grad)
    rollout_logp: torch.Tensor,  # [B, T-1]
    mask: torch.Tensor,  # [B, T-1] 1 on completion tokens
    advantages: torch.Tensor,  # [B]
    rl: RLConfig,
    ref_logp: torch.Tensor | None = None,  # [B, T-1]
    is_weights: torch.Tensor | None = None,  # [B, T-1] TIS / MIS weights (no grad), None: no correction
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss (+ KL to ref), averaged over all completion tokens of the batch.

    `rollout_logp` is the ratio's baseline (the behaviour policy; with an off-policy correction, the trainer's
    pre-update logprobs). `is_weights` multiplies each token's policy loss (not the KL term).
    """
    ratio = torch.exp(logp - rollout_logp)  # [B, T-1]
    adv = advantages[:, None]  # [B, 1]
    clipped = ratio.clamp(1 - rl.clip_low, 1 + rl.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [B, T-1]
    if is_weights is not None:
        per_token = per_token * is_weights
    num_tokens = mask.sum().clamp(min=1)
    stats = {"clip_frac": (((ratio - clipped).abs() > 0).float() * mask).sum().item() / num_tokens.item()}
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)  # [B, T-1]
        per_token = per_token + rl.kl_coef * kl
        stats["kl_ref"] = ((kl * mask).sum() / num_tokens).item()
    return (per_token * mask).sum() / num_tokens, stats


def train(cfg: RunConfig) -> dict:
    """Warm-up (toy) -> evaluate -> GRPO steps -> evaluate; returns the summary (also in summary.json)."""
    rl = cfg.rl
    with rl_session(cfg, "grpo") as (bridge, model_dir):
        policy = load_policy(cfg, model_dir)
        ref = None
        if rl.kl_coef > 0:
            ref = load_policy(cfg, model_dir).eval()
            ref.requires_grad_(False)
        opt = torch.optim.AdamW(policy.parameters(), lr=rl.lr, weight_decay=0.0)

        def step(batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
            advantages = group_advantages(rewards, rl.samples_per_prompt)  # [B]
            padded = batch.padded(device=cfg.trainer.device)
            return update(policy, ref, opt, padded, advantages.to(cfg.trainer.device), rl, bridge)

        return run_rl(cfg, bridge, model_dir, policy, step, salt=2)


def update(policy, ref, opt, padded: PaddedBatch, advantages: torch.Tensor, rl: RLConfig, bridge: TrainerBridge) -> dict:
    """`epochs_per_batch` optimizer steps on one batch; the mismatch (and with `rl.off_policy_correction`, the
    TIS / MIS weights, against the pre-update policy) is measured before the first."""
    input_ids = padded.input_ids  # [B, T]
    mask = padded.loss_mask[:, 1:]  # [B, T-1]
    rollout_logp = padded.logprobs[:, 1:]  # [B, T-1]
    routed = padded.routed_experts  # [B, T-1, L_moe, k] the rollout's experts (MoE routing replay), or None
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = ref.token_logprobs(input_ids, rl.temperature, routed_experts=routed)  # [B, T-1]
    out: dict[str, float] = {}
    is_weights = None
    for epoch in range(rl.epochs_per_batch):
        logp = policy.token_logprobs(input_ids, rl.temperature, routed_experts=routed)  # [B, T-1]
        if epoch == 0 and rl.off_policy_correction == "none":
            out |= bridge.logprob_mismatch(padded, logp)
        elif epoch == 0:
            is_weights, is_stats = bridge.importance_weights(padded, logp, mode=rl.off_policy_correction,
                                                             cap=rl.importance_cap)
            out |= is_stats
            rollout_logp = logp.detach()  # the ratio's baseline: the pre-update trainer policy
        loss, stats = grpo_loss(logp, rollout_logp, mask, advantages, rl, ref_logp, is_weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out["grad_norm"] = torch.nn.utils.clip_grad_norm_(policy.parameters(), rl.max_grad_norm).item()
        opt.step()
        out |= {"loss": loss.item(), **stats}
    return out


def main(argv: list[str] | None = None) -> int:
    return cli_main("python -m trainer_bridge.grpo", "GRPO on the toy task or a real model", train, argv)


if __name__ == "__main__":
    sys.exit(main())
