"""PPO with a value head and GAE, in plain PyTorch, against the rollout engine through TrainerBridge.

    bridge.rollout(prompts, n) -> TokenSamples ------------------------------> engine (version v)
    reward at each completion's last token (+ nothing else)                         ^
    TrainingModel hidden states [B, T, H] -> logits (policy) and ValueHead -> V [B, T-1]
    GAE(gamma, lambda) over completion tokens -> advantages, returns  [B, T-1]
    loss = clipped policy loss (ratio vs rollout logprobs) + value_coef * (V - returns)^2
    AdamW step -> bridge.push_weights(policy)  (the value head stays on the trainer) -----+  v+1

Run: `python -m trainer_bridge.ppo --config configs/grpo_toy.yaml --set algorithm=ppo`. The value head is
a linear layer on the policy's final hidden states (shared trunk). This module shares the harness with
grpo.py and does not know how the engine samples or how weights travel.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from rollout.sampling_params import SamplingParams
from trainer_bridge.bridge import PaddedBatch, TrainerBridge
from trainer_bridge.config import RLConfig, RunConfig, load_run_config
from trainer_bridge.harness import (
    MetricsLogger, ProblemStream, evaluate, held_out_problems, open_engine, prepare_model, push_metrics,
    rewards_of, rollout_metrics, seed_everything, step_line,
)
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

    def forward(self, input_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (logprob of each next token [B, T-1], value of each prefix [B, T-1])."""
        hidden = self.policy.model.forward_dense(input_ids)[:, :-1]  # [B, T-1, H]
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
    advantages: torch.Tensor, returns: torch.Tensor, rl: RLConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss + value_coef * squared error; token mean over the mask. All inputs [B, T-1]."""
    ratio = torch.exp(logp - rollout_logp)
    clipped = ratio.clamp(1 - rl.clip_low, 1 + rl.clip_high)
    policy = -torch.minimum(ratio * advantages, clipped * advantages)
    value = (values - returns) ** 2
    num_tokens = mask.sum().clamp(min=1)
    policy_loss = (policy * mask).sum() / num_tokens
    value_loss = (value * mask).sum() / num_tokens
    return policy_loss + rl.value_coef * value_loss, {"policy_loss": policy_loss.item(), "value_loss": value_loss.item()}


def update(model: PolicyWithValue, opt, padded: PaddedBatch, rewards: torch.Tensor, rl: RLConfig, bridge: TrainerBridge) -> dict:
    input_ids = padded.input_ids  # [B, T]
    mask = padded.loss_mask[:, 1:]  # [B, T-1]
    rollout_logp = padded.logprobs[:, 1:]  # [B, T-1]
    with torch.no_grad():
        logp0, values0 = model(input_ids, rl.temperature)
        advantages, returns = gae(terminal_rewards(mask, rewards), values0, mask, rl.gamma, rl.gae_lambda)
        sel = mask.bool()
        mean, std = advantages[sel].mean(), advantages[sel].std().clamp(min=1e-6)
        advantages = (advantages - mean) / std * mask
    out = bridge.logprob_mismatch(padded, logp0)
    for _ in range(rl.epochs_per_batch):
        logp, values = model(input_ids, rl.temperature)
        loss, stats = ppo_loss(logp, values, rollout_logp, mask, advantages, returns, rl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), rl.max_grad_norm).item()
        opt.step()
        out |= {"loss": loss.item(), **stats}
    return out


def train(cfg: RunConfig) -> dict:
    """Warm-up (toy) -> evaluate -> PPO steps -> evaluate; returns the summary (also in summary.json)."""
    if cfg.algorithm != "ppo":
        raise ValueError(f"algorithm: this script runs ppo, the config says {cfg.algorithm!r}")
    seed_everything(cfg)
    rl, progress = cfg.rl, cfg.logging.progress
    model_dir = prepare_model(cfg)
    logger = MetricsLogger(cfg)
    held_out = held_out_problems(cfg)
    stream = ProblemStream(cfg, salt=3)
    with open_engine(cfg, model_dir) as engine:
        bridge = TrainerBridge(engine)
        model = PolicyWithValue(TrainingModel.from_pretrained(model_dir, dtype=cfg.trainer.dtype, device=cfg.trainer.device,
                                           deterministic=cfg.deterministic))
        opt = torch.optim.AdamW(model.parameters(), lr=rl.lr, weight_decay=0.0)
        bridge.push_weights(model.policy)  # dense: gives the differ its snapshot
        before = evaluate(bridge, cfg, held_out)
        logger.log(0, before)
        steps = range(1, rl.steps + 1)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(steps, desc="ppo", unit="step")
            steps = bar
        for step in steps:
            problems = stream.batch(step, rl.prompts_per_step)
            sampling = SamplingParams(n=rl.samples_per_prompt, max_tokens=rl.max_tokens, temperature=rl.temperature,
                                      seed=cfg.seed * 1_000_003 + step * 10_007)
            batch = bridge.rollout([p.prompt for p in problems], sampling)
            rewards = rewards_of(batch, problems).to(cfg.trainer.device)  # [B]
            metrics = {"reward": rewards.mean().item(), **rollout_metrics(batch)}
            metrics |= update(model, opt, batch.padded(device=cfg.trainer.device), rewards, rl, bridge)
            metrics |= push_metrics(bridge.push_weights(model.policy))
            if rl.eval_every and step % rl.eval_every == 0 and step != rl.steps:
                metrics |= evaluate(bridge, cfg, held_out)
            logger.log(step, metrics)
            if bar is not None:
                bar.write(step_line(step, rl.steps, metrics))
        after = evaluate(bridge, cfg, held_out)
        logger.log(rl.steps, after)
    summary = {
        "algorithm": "ppo", "steps": rl.steps, "reward_warmup": before["eval_reward"], "reward_final": after["eval_reward"],
        "greedy_warmup": before["eval_greedy"], "greedy_final": after["eval_greedy"],
        "final_policy_version": bridge.policy_version, "model": str(model_dir),
    }
    summary["summary_json"] = str(logger.finish(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_bridge.ppo", description="PPO on the toy task or a real model")
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        summary = train(load_run_config(args.config, ["algorithm=ppo", *args.set]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print({k: summary[k] for k in ("reward_warmup", "reward_final", "summary_json")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
