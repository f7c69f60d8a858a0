"""What the GRPO and PPO scripts share: model preparation, the engine, prompts, evaluation and logging.

    prepare_model(cfg)        toy: write a tiny Llama + tokenizer, supervised warm-up; else cfg.model
    open_engine(cfg, model)   a local Engine, or a RolloutPool when cfg.pool names a pool YAML
    ProblemStream             seeded training prompts that never repeat a held-out prompt
    evaluate(bridge, ...)     mean reward on the held-out prompts (sampled like training, and greedy)
    MetricsLogger             metrics.jsonl + per-step line + wandb (offline by default) + plot.png
    rl_session / load_policy  the set-up both algorithms share (engine, bridge, the trainer's model)
    run_rl(...)               the step loop both algorithms share: rollout -> update -> push -> eval -> log
    cli_main(...)             the `--config FILE --set key=value` command line of both scripts

It holds no RL maths (see grpo.py / ppo.py) and talks to the engine only through TrainerBridge.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from rollout.sampling_params import SamplingParams
from trainer_bridge import toy_task
from trainer_bridge.bridge import RolloutBatch, TrainerBridge
from trainer_bridge.training_model import TrainingModel
from trainer_bridge.config import RunConfig, load_run_config

EVAL_SEED = 1_000_003


def prepare_model(cfg: RunConfig) -> Path:
    """The model directory the engine and the trainer start from (builds and warms up the toy model)."""
    if cfg.model is not None:
        path = Path(cfg.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json")
        return path
    path = Path(cfg.output_dir) / "model"
    tm = cfg.toy_model
    toy_task.write_model(path, hidden_size=tm.hidden_size, num_layers=tm.num_layers, seed=cfg.seed)
    toy_task.warm_up(
        path, steps=tm.warmup_steps, batch_size=tm.warmup_batch_size, lr=tm.warmup_lr,
        problems=ProblemStream(cfg, salt=1), progress=cfg.logging.progress,
    )
    return path


@contextmanager
def open_engine(cfg: RunConfig, model_dir: Path) -> Iterator[object]:
    """A local Engine, or a RolloutPool (shut down on exit) when `cfg.pool` is set."""
    if cfg.pool is None:
        from rollout.engine import Engine

        yield Engine(cfg.engine_config(str(model_dir)))
        return
    from rollout.pool import RolloutPool, load_pool_config

    pool = RolloutPool(load_pool_config(cfg.pool, model=str(model_dir)))
    try:
        yield pool
    finally:
        pool.shutdown()


def held_out_problems(cfg: RunConfig) -> list[toy_task.Problem]:
    return toy_task.make_problems(
        cfg.task.num_eval_prompts, max_digits=cfg.task.max_digits, seed=EVAL_SEED + cfg.seed,
        template=cfg.task.prompt_template,
    )


class ProblemStream:
    """Seeded batches of training problems; prompts of the held-out set are never drawn."""

    def __init__(self, cfg: RunConfig, *, salt: int) -> None:
        self.cfg = cfg
        self.salt = salt
        self.held_out = {p.prompt for p in held_out_problems(cfg)}

    def batch(self, step: int, size: int) -> list[toy_task.Problem]:
        out: list[toy_task.Problem] = []
        draw = 0
        while len(out) < size:
            seed = (self.cfg.seed * 1_000_033 + self.salt) * 1_000_037 + step * 101 + draw
            fresh = toy_task.make_problems(
                size, max_digits=self.cfg.task.max_digits, seed=seed, template=self.cfg.task.prompt_template
            )
            out += [p for p in fresh if p.prompt not in self.held_out]
            draw += 1
        return out[:size]


def rewards_of(batch: RolloutBatch, problems: list[toy_task.Problem]) -> torch.Tensor:
    """[B] reward of every sample of `batch` (samples are in prompt order)."""
    return torch.tensor([toy_task.reward(problems[s.prompt_index], s.completion_text or "") for s in batch.samples])


def evaluate(bridge: TrainerBridge, cfg: RunConfig, problems: list[toy_task.Problem]) -> dict[str, float]:
    """Mean reward on `problems`: sampled as in training (fixed seed) and greedy."""
    prompts = [p.prompt for p in problems]
    sampled = bridge.rollout(prompts, SamplingParams(
        n=cfg.task.eval_samples_per_prompt, max_tokens=cfg.rl.max_tokens, temperature=cfg.rl.temperature,
        seed=EVAL_SEED,
    ))
    greedy = bridge.rollout(prompts, SamplingParams(n=1, max_tokens=cfg.rl.max_tokens, temperature=0.0))
    return {"eval_reward": rewards_of(sampled, problems).mean().item(), "eval_greedy": rewards_of(greedy, problems).mean().item()}


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    lag_mean, lag_max = batch.version_lag()
    return {
        "rollout_s": batch.seconds, "rollout_tokens": batch.num_completion_tokens,
        "rollout_tokens_per_s": batch.tokens_per_s, "version_lag_mean": lag_mean, "version_lag_max": lag_max,
        "policy_version": batch.policy_version,
    }


def seed_everything(cfg: RunConfig) -> None:
    torch.manual_seed(cfg.seed)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)


class MetricsLogger:
    """Per-step metrics to metrics.jsonl, a summary line, wandb, and at the end plot.png + summary.json."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.history: list[dict] = []
        self._jsonl = open(self.out / "metrics.jsonl", "w")
        self._wandb = self._init_wandb()
        self._start = time.perf_counter()

    def _init_wandb(self):
        lc = self.cfg.logging
        mode = lc.wandb_mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if not lc.wandb or mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            print("wandb is not installed; metrics go to metrics.jsonl only")
            return None
        from dataclasses import asdict

        return wandb.init(
            project=lc.wandb_project, mode=mode, dir=str(self.out), config=asdict(self.cfg),
            settings=wandb.Settings(silent=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time_s": round(time.perf_counter() - self._start, 3), **metrics}
        self.history.append(row)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def finish(self, summary: dict) -> Path:
        """Write summary.json (and plot.png), close wandb; returns the summary path."""
        self._jsonl.close()
        if self.cfg.logging.plot and self.history:
            plot = self.plot(self.out / "plot.png")
            if plot is not None:
                summary["plot"] = str(plot)
        path = self.out / "summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self._wandb.finish()
        return path

    def plot(self, path: Path) -> Path | None:
        """Write the run's plot to `path`; without matplotlib, say so in one line and return None."""
        try:
            import matplotlib
        except ImportError:
            print("matplotlib is not installed, so no plot.png (pip install -e '.[demo]' brings it)")
            return None

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.history if "reward" in r]
        steps = [r["step"] for r in rows]
        evals = [r for r in self.history if "eval_reward" in r]
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        ax = axes[0]
        ax.plot(steps, [r["reward"] for r in rows], label="train reward (mean)", lw=1.2)
        ax.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o-", label="held-out reward (sampled)")
        ax.plot([r["step"] for r in evals], [r["eval_greedy"] for r in evals], "s--", label="held-out (greedy)")
        ax.set(xlabel="step", ylabel="reward", title=f"{self.cfg.algorithm.upper()} reward", ylim=(0, 1.02))
        ax.legend(fontsize=8)
        ax = axes[1]
        vals = [max(r["mismatch_abs_mean"], 1e-12) for r in rows]
        ax.semilogy(steps, vals, label="mean |Δ logprob|")
        ax.semilogy(steps, [max(r["mismatch_abs_max"], 1e-12) for r in rows], label="max |Δ logprob|", alpha=0.7)
        ax.set(xlabel="step", title="rollout vs trainer logprob mismatch")
        ax.legend(fontsize=8)
        ax = axes[2]
        ms = ax.plot(steps, [1e3 * r["sync_s"] for r in rows], label="weight sync (ms)")
        ax2 = ax.twinx()
        kib = ax2.plot(steps, [r["sync_bytes"] / 1024 for r in rows], color="tab:orange", alpha=0.6, label="KiB sent")
        ax.set(xlabel="step", ylabel="ms", title="weight sync per step", ylim=(0, None))
        ax2.set(ylabel="KiB", ylim=(0, None))
        ax.legend(ms + kib, [line.get_label() for line in ms + kib], fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def step_line(step: int, steps: int, m: dict[str, float]) -> str:
    """The per-step summary line."""
    kl = f" | kl_ref {m['kl_ref']:.2e}" if "kl_ref" in m else ""
    return (
        f"step {step:3d}/{steps} | reward {m['reward']:.3f} | loss {m['loss']:+.4f}{kl} | "
        f"mismatch {m['mismatch_abs_mean']:.1e} (max {m['mismatch_abs_max']:.1e}) | "
        f"rollout {m['rollout_s']:.2f}s {m['rollout_tokens_per_s']:.0f} tok/s | "
        f"sync {1e3 * m['sync_s']:.1f} ms {m['sync_bytes'] / 1024:.1f} KiB ({m['sync_num_patch']} patch/"
        f"{m['sync_num_dense']} dense) | lag {m['version_lag_max']}"
    )


def push_metrics(result) -> dict[str, float]:
    return {
        "sync_s": result.seconds, "sync_bytes": result.nbytes, "sync_dense_bytes": result.dense_nbytes,
        "sync_num_patch": result.num_patch, "sync_num_dense": result.num_dense,
        "sync_changed_fraction": result.changed_fraction,
    }


@contextmanager
def rl_session(cfg: RunConfig, algorithm: str) -> Iterator[tuple[TrainerBridge, Path]]:
    """Check the algorithm, seed everything, prepare the model, open the engine: yields (bridge, model_dir)."""
    if cfg.algorithm != algorithm:
        raise ValueError(f"algorithm: this script runs {algorithm}, the config says {cfg.algorithm!r}")
    seed_everything(cfg)
    model_dir = prepare_model(cfg)
    with open_engine(cfg, model_dir) as engine:
        yield TrainerBridge(engine, routed_experts=cfg.rl.routing_replay), model_dir


def load_policy(cfg: RunConfig, model_dir: Path) -> TrainingModel:
    """The trainer's copy of the model, with the engine's deterministic setting."""
    return TrainingModel.from_pretrained(model_dir, dtype=cfg.trainer.dtype, device=cfg.trainer.device,
                                         deterministic=cfg.deterministic)


def run_rl(
    cfg: RunConfig,
    bridge: TrainerBridge,
    model_dir: Path,
    policy: torch.nn.Module,
    update: Callable[[RolloutBatch, torch.Tensor], dict[str, float]],
    *,
    salt: int,
) -> dict:
    """First push (dense: it gives the bridge its snapshot), evaluate, then `cfg.rl.steps` steps of
    rollout -> `update(batch, rewards [B])` (one optimizer update, returns metrics) -> push `policy`, and a
    final evaluation on held-out prompts. `salt` separates the algorithms' training prompt streams.
    Returns the run summary (also written to summary.json)."""
    rl, progress = cfg.rl, cfg.logging.progress
    logger = MetricsLogger(cfg)
    held_out = held_out_problems(cfg)
    stream = ProblemStream(cfg, salt=salt)
    first = bridge.push_weights(policy)
    before = evaluate(bridge, cfg, held_out)
    logger.log(0, before)
    if progress:
        print(f"warm-up model: held-out reward {before['eval_reward']:.3f} (greedy {before['eval_greedy']:.3f}); "
              f"first push {first.nbytes / 1024:.0f} KiB dense in {1e3 * first.seconds:.1f} ms")
    steps = range(1, rl.steps + 1)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(steps, desc=cfg.algorithm, unit="step")
        steps = bar
    for step in steps:
        problems = stream.batch(step, rl.prompts_per_step)
        sampling = SamplingParams(n=rl.samples_per_prompt, max_tokens=rl.max_tokens, temperature=rl.temperature,
                                  seed=cfg.seed * 1_000_003 + step * 10_007)
        batch = bridge.rollout([p.prompt for p in problems], sampling)
        rewards = rewards_of(batch, problems)  # [B]
        metrics = {"reward": rewards.mean().item(), **rollout_metrics(batch)}
        if rl.sleep_level:  # the device is the trainer's while it updates
            bridge.engine.sleep(rl.sleep_level)
        metrics |= update(batch, rewards)
        if rl.sleep_level:
            bridge.engine.wake_up(["weights"])  # the push writes into the engine's weights ...
        metrics |= push_metrics(bridge.push_weights(policy))
        if rl.sleep_level:
            bridge.engine.wake_up(["kv_cache"])  # ... before the KV cache takes its memory back
        if rl.eval_every and step % rl.eval_every == 0 and step != rl.steps:
            metrics |= evaluate(bridge, cfg, held_out)
        logger.log(step, metrics)
        if bar is not None:
            bar.write(step_line(step, rl.steps, metrics))
    after = evaluate(bridge, cfg, held_out)
    logger.log(rl.steps, after)
    summary = {
        "algorithm": cfg.algorithm, "steps": rl.steps, "reward_warmup": before["eval_reward"],
        "reward_final": after["eval_reward"], "greedy_warmup": before["eval_greedy"],
        "greedy_final": after["eval_greedy"], "final_policy_version": bridge.policy_version,
        "model": str(model_dir),
    }
    summary["summary_json"] = str(logger.finish(summary))
    return summary


def cli_main(prog: str, description: str, train: Callable[[RunConfig], dict], argv: list[str] | None,
             preset: tuple[str, ...] = ()) -> int:
    """Parse `--config FILE --set key=value ...`, run `train`, print the headline figures."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help="a RunConfig YAML (default: the toy demo)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. rl.steps=20")
    args = parser.parse_args(argv)
    try:
        summary = train(load_run_config(args.config, [*preset, *args.set]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print({k: summary[k] for k in ("reward_warmup", "reward_final", "summary_json")})
    return 0
