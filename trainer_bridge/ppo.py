"""PPO with a value head and GAE, in plain PyTorch, against the rollout engine through TrainerBridge.

    bridge.rollout(prompts, n) -> TokenSamples ------------------------------> engine (version v)
    reward at each completion's last token (+ nothing else)                         ^
    TrainingModel hidden states [B, T, H] -> logits (policy) and ValueHead -> V [B, T-1]
    GAE(gamma, lambda) over completion tokens -> advantages, returns  [B, T-1]
    loss = clipped policy loss (ratio vs rollout logprobs) + value_coef * (V - returns)^2
    (rl.off_policy_correction tis / mis: ratio vs the pre-update trainer logprobs, policy loss times the
     TIS / MIS weights; see trainer_bridge.bridge.importance_weights)
    AdamW step -> bridge.push_weights(policy)  (the value head stays on the trainer) -----+  v+1

Run: `python -m trainer_bridge.ppo --config configs/grpo_toy.yaml --set algorithm=ppo`. The value head is
a linear layer on the policy's final hidden states (shared trunk). This module shares the harness with
grpo.py and does not know how the engine samples or how weights travel.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from trainer_bridge.bridge import PaddedBatch, RolloutBatch, TrainerBridge
from trainer_bridge.config import RLConfig, RunConfig
from trainer_bridge.harness import cli_main, load_policy, rl_session, run_rl
from trainer_bridge.training_model import TrainingModel


class PolicyWithValue(nn.Module):
    """A TrainingModel plus a value head on its final hidden states."""

    def __init__(self, policy: TrainingModel) -> None:
        super().__init__()
        self.policy = policy
        hidden = policy.config.hidden_size
        param = next(policy.parameters())
        self.value_head = nn.Linear(hidden, 1, device=param.device, dtype=param.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, temperature: float,
                routed_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (logprob of each next token [B, T-1], value of each prefix [B, T-1]);
        `routed_experts` [B, T-1, L_moe, k] (MoE): the rollout's experts, replayed (`TrainingModel.hidden_states`)."""
        hidden = self.policy.hidden_states(input_ids, routed_experts)[:, :-1]  # [B, T-1, H]
        logits = self.policy.model.compute_logits(hidden).float() / temperature  # [B, T-1, V]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        values = self.value_head(hidden).squeeze(-1).float()  # [B, T-1]
        return logp, values


def terminal_rewards(mask: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """mask [B, T-1] (contiguous run of 1s per row), rewards [B] -> per-token rewards [B, T-1] at each row's last 1."""
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)  # [B]
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = rewards.to(mask.dtype)
    return out * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over masked token positions. All [B, T-1]; the value after a row's last token is 0.

    Returns (advantages, returns), both zero outside the mask.
    """
    num_steps = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(num_steps)):
        next_mask = mask[:, t + 1] if t + 1 < num_steps else torch.zeros_like(running)
        next_value = values[:, t + 1] * next_mask if t + 1 < num_steps else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * next_mask * running
        adv[:, t] = running
    adv = adv * mask
    return adv, (adv + values) * mask


def ppo_loss(
    logp: torch.Tensor, values: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
    advantages: torch.Tensor, returns: torch.Tensor, rl: RLConfig, is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss + value_coef * squared error; token mean over the mask. All inputs [B, T-1].

    `rollout_logp` is the ratio's baseline; `is_weights` (TIS / MIS, no grad) multiplies the policy loss per token.
    """
    ratio = torch.exp(logp - rollout_logp)
    clipped = ratio.clamp(1 - rl.clip_low, 1 + rl.clip_high)
    policy = -torch.minimum(ratio * advantages, clipped * advantages)
    if is_weights is not None:
        policy = policy * is_weights
    value = (values - returns) ** 2
    num_tokens = mask.sum().clamp(min=1)
    policy_loss = (policy * mask).sum() / num_tokens
    value_loss = (value * mask).sum() / num_tokens
    return policy_loss + rl.value_coef * value_loss, {"policy_loss": policy_loss.item(), "value_loss": value_loss.item()}


def update(model: PolicyWithValue, opt, padded: PaddedBatch, rewards: torch.Tensor, rl: RLConfig, bridge: TrainerBridge) -> dict:
    input_ids = padded.input_ids  # [B, T]
    mask = padded.loss_mask[:, 1:]  # [B, T-1]
    rollout_logp = padded.logprobs[:, 1:]  # [B, T-1]
    routed = padded.routed_experts  # the rollout's experts (MoE routing replay), or None
    with torch.no_grad():
        logp0, values0 = model(input_ids, rl.temperature, routed)
        advantages, returns = gae(terminal_rewards(mask, rewards), values0, mask, rl.gamma, rl.gae_lambda)
        sel = mask.bool()
        mean, std = advantages[sel].mean(), advantages[sel].std().clamp(min=1e-6)
        advantages = (advantages - mean) / std * mask
    is_weights = None
    if rl.off_policy_correction == "none":
        out = bridge.logprob_mismatch(padded, logp0)
    else:
        is_weights, out = bridge.importance_weights(padded, logp0, mode=rl.off_policy_correction, cap=rl.importance_cap)
        rollout_logp = logp0  # the ratio's baseline: the pre-update trainer policy
    for _ in range(rl.epochs_per_batch):
        logp, values = model(input_ids, rl.temperature, routed)
        loss, stats = ppo_loss(logp, values, rollout_logp, mask, advantages, returns, rl, is_weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), rl.max_grad_norm).item()
        opt.step()
        out |= {"loss": loss.item(), **stats}
    return out


def train(cfg: RunConfig) -> dict:
    """Warm-up (toy) -> evaluate -> PPO steps -> evaluate; returns the summary (also in summary.json)."""
    rl = cfg.rl
    with rl_session(cfg, "ppo") as (bridge, model_dir):
        model = PolicyWithValue(load_policy(cfg, model_dir))
        opt = torch.optim.AdamW(model.parameters(), lr=rl.lr, weight_decay=0.0)

        def step(batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
            return update(model, opt, batch.padded(device=cfg.trainer.device), rewards.to(cfg.trainer.device), rl,
                          bridge)

        return run_rl(cfg, bridge, model_dir, model.policy, step, salt=3)


def main(argv: list[str] | None = None) -> int:
    return cli_main("python -m trainer_bridge.ppo", "PPO on the toy task or a real model", train, argv,
                    preset=("algorithm=ppo",))


if __name__ == "__main__":
    sys.exit(main())
