"""`python -m rollout demo` (and `make run`): the toy GRPO run end to end on the CPU.

Builds a tiny Llama and a character tokenizer for 2-digit addition, warms it up with supervised
training, scores held-out prompts, runs GRPO against a local engine through TrainerBridge, scores again,
and writes metrics.jsonl, plot.png (when matplotlib is installed: the `demo` extra), summary.json
(reward_warmup, reward_final) and an offline wandb run (when wandb is) under the output directory (default
./runs/demo). Options: `--config FILE` (e.g. configs/grpo_toy_pool.yaml
for a Ray pool), `--output-dir DIR`, `--set KEY=VALUE` (any RunConfig field, e.g. rl.steps=50); pass them
as `python -m trainer_bridge.demo ARGS` or `python -m rollout demo -- ARGS`.
This module only parses arguments and reports; the loop is trainer_bridge.grpo.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout demo", description="toy GRPO demo on the CPU")
    parser.add_argument("--config", default=None, help="a RunConfig YAML (default: the built-in toy demo)")
    parser.add_argument("--output-dir", default=None, help="default ./runs/demo")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # `rollout demo -- ARGS` keeps the "--"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trainer_bridge import grpo, ppo
    from trainer_bridge.config import load_run_config

    overrides = list(args.set) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
    start = time.perf_counter()
    try:
        cfg = load_run_config(args.config, overrides)
        summary = (grpo if cfg.algorithm == "grpo" else ppo).train(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - start
    print(
        f"\nheld-out reward: warm-up {summary['reward_warmup']:.3f} -> after {summary['algorithm'].upper()} "
        f"{summary['reward_final']:.3f} (greedy {summary['greedy_warmup']:.3f} -> {summary['greedy_final']:.3f}); "
        f"{wall:.0f} s" + (f"\nplot: {summary['plot']}" if "plot" in summary else "")
        + f"\nsummary: {summary['summary_json']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
